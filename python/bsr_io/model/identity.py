"""A configuration as one canonical document, and its digest: the same settings give the
same bytes in every process.

A model identity is computed by the scheduler and by each worker, in different
processes with different hash seeds, and must come out the same in all of them (and
after a restart), or they read and write different namespaces. So nothing here goes by
`repr` or by iteration order: sets are sorted, dict keys are sorted, tuples are lists,
and a value with no canonical form is refused with an error naming where it sits in
the document, never guessed at.
"""

from __future__ import annotations

import enum
import hashlib
import json
from typing import Any

from bsr_io.errors import BsrTypeError

DIGEST_BYTES = 16  # 128-bit digests, as the chunk keys


class NotCanonical(BsrTypeError):
    """A configuration value has no canonical form; `path` says where it sits."""

    def __init__(self, path: str, value: object) -> None:
        self.path = path
        super().__init__(
            f"{path or '<document>'}: a {type(value).__qualname__} has no canonical form "
            "(use None, bool, int, float, str, bytes, lists, tuples, sets, dicts with "
            "str or number keys, enums, or objects with to_dict() or attributes)"
        )


def _text(doc: Any) -> str:
    return json.dumps(doc, sort_keys=True)


def canonical(value: Any, path: str = "") -> Any:
    """`value` as JSON holds it, independent of hash seed, insertion order and memory
    addresses. `path` names `value` in errors (`NotCanonical`)."""
    if isinstance(value, enum.Enum):  # first: an IntEnum or StrEnum is an int or str too
        return f"{type(value).__qualname__}.{value.name}"
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    if isinstance(value, bytes):
        return value.hex()
    if isinstance(value, dict):
        out: dict[str, Any] = {}
        for k, v in value.items():
            if isinstance(k, enum.Enum):
                name = canonical(k)
            elif isinstance(k, (str, int, float)):
                name = k if isinstance(k, str) else str(k)
            else:
                raise NotCanonical(f"{path}[{k!r}] (key)", k)
            if name in out:  # {1: .., "1": ..} would collapse into one key
                raise NotCanonical(f"{path}[{k!r}] (key, same text as another)", k)
            out[name] = canonical(v, f"{path}.{name}" if path else name)
        return out
    if isinstance(value, (list, tuple)):
        return [canonical(v, f"{path}[{i}]") for i, v in enumerate(value)]
    if isinstance(value, (set, frozenset)):
        items = [canonical(v, f"{path}{{}}") for v in value]
        return sorted(items, key=_text)
    if type(value).__module__ == "torch" and type(value).__name__ == "dtype":
        return str(value)  # "torch.bfloat16": a name, no address
    if isinstance(value, type) or callable(value):  # hf_overrides may be a function:
        # known by its qualified name, which is the same in every process
        module = getattr(value, "__module__", None)
        qualname = getattr(value, "__qualname__", None)
        if not isinstance(module, str) or not isinstance(qualname, str):
            raise NotCanonical(path, value)
        return f"{module}.{qualname}"
    to_dict = getattr(value, "to_dict", None)
    if callable(to_dict):
        return canonical(to_dict(), path)
    if hasattr(value, "__dict__"):
        return {"type": type(value).__qualname__, **canonical(vars(value), path)}
    raise NotCanonical(path, value)


def digest(doc: Any, person: bytes) -> str:
    """Hex blake2b of the canonical form of `doc` (`NotCanonical` if it has none)."""
    text = _text(canonical(doc)).encode()
    return hashlib.blake2b(text, digest_size=DIGEST_BYTES, person=person).hexdigest()
