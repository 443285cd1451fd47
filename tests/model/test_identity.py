"""A configuration's canonical form and digest: the same in every process whatever its
hash seed (the scheduler and each worker compute a model identity on their own), and a
value with no canonical form is refused naming where it sits, never digested by repr."""

from __future__ import annotations

import enum
import os
import subprocess
import sys
import threading

import pytest

from bsr_io.model.identity import NotCanonical, canonical, digest

# Enough strings that a set's iteration order differs between hash seeds.
_PROBE = """
from bsr_io.model.identity import digest
doc = {"rope": {"kinds": {"yarn", "linear", "dynamic", "ntk", "longrope", "llama3"}},
       "skip": frozenset({"layers.0", "layers.7", "layers.31", "lm_head"}), "n": (1, 2)}
print(digest(doc, b"test"))
"""


def _digest_with_seed(seed: int) -> str:
    env = {**os.environ, "PYTHONHASHSEED": str(seed)}
    out = subprocess.run(
        [sys.executable, "-c", _PROBE], env=env, check=True, capture_output=True, text=True
    )
    return out.stdout.strip()


def test_a_set_digests_the_same_under_every_hash_seed() -> None:
    digests = {_digest_with_seed(seed) for seed in (1, 2, 3)}
    assert len(digests) == 1, digests


def test_sets_sorted_keys_sorted_tuples_as_lists() -> None:
    assert canonical({"b": {3, 1, 2}, "a": (1, [2])}) == {"a": [1, [2]], "b": [1, 2, 3]}
    assert digest({"a": 1, "b": 2}, b"t") == digest({"b": 2, "a": 1}, b"t")
    assert digest({"a": (1, 2)}, b"t") == digest({"a": [1, 2]}, b"t")
    assert digest({"a": {1, 2}}, b"t") != digest({"a": {1, 3}}, b"t")


class _Kind(enum.Enum):
    YARN = "yarn"


def test_enums_objects_and_functions_have_names_without_addresses() -> None:
    class Quant:
        def __init__(self) -> None:
            self.bits = 4
            self.kind = _Kind.YARN

    assert canonical(_Kind.YARN) == "_Kind.YARN"
    assert canonical(Quant()) == {"type": Quant.__qualname__, "bits": 4, "kind": "_Kind.YARN"}
    assert canonical(len) == "builtins.len"


def test_a_value_with_no_canonical_form_is_refused_naming_its_key() -> None:
    doc = {"hf_overrides": {"rope": [1, {"lock": threading.Lock()}]}}
    with pytest.raises(NotCanonical, match=r"hf_overrides\.rope\[1\]\.lock: a lock has no"):
        digest(doc, b"t")
    with pytest.raises(NotCanonical, match=r"quant\[\(1, 2\)\] \(key\)"):
        canonical({"quant": {(1, 2): "x"}})
    with pytest.raises(NotCanonical, match="same text as another"):
        canonical({1: "a", "1": "b"})
