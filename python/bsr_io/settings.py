"""Typed settings: one declarative table per integration, one parser for all of them.

A `Table` lists its keys; each `Key` holds in one place its name, its type (`kind`),
its default (`REQUIRED` when it has none), what it allows (`allowed`, as the error
says it, with the `check` or `choices` that enforce it) and, where the plain error
does not say enough, its own message. `parse(table, given)`:

- refuses keys the table does not know, naming them and the known ones (keys outside
  the table's `prefix`, or under one of its `others`, belong to someone else);
- refuses a required key that is absent or empty;
- checks each value's type, then its range or choices; the error names the key and what
  it allows: "<label> must be <allowed>, got <value>";
- returns every key's value, defaults filled in.

`Table.text`: values may arrive as text (YAML, environment, command lines): "3", "2.5",
"false", "64GiB" are read as the key's type. Without it a value must have the key's type
already (JSON), an int standing for a float. `Table.null_is_default`: a null value means
the default; without it null is allowed only where the default is null.

`validate(table, values)` checks values already typed (a dataclass's fields after its
constructor) against the same table, with the same messages.

The tables themselves live beside the config classes that use them:
`bsr_io.tiers.mooncake.config` (the Mooncake pool), `bsr_io.integrations.lmcache.config`
(LMCache's `extra_config`), `bsr_io.integrations.vllm.config` (vLLM's
`kv_connector_extra_config`).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, Final, Literal

from bsr_io.errors import BsrValueError
from bsr_io.model.sizes import parse_size

Kind = Literal["str", "int", "float", "bool", "size"]
TRUE: Final = ("1", "true", "yes", "on")
FALSE: Final = ("0", "false", "no", "off")


class _Required:
    def __repr__(self) -> str:
        return "REQUIRED"


REQUIRED: Final[Any] = _Required()
"""The default of a key that has none: it must be given."""
_BAD: Final = object()  # a value that is not of its key's type


@dataclass(frozen=True)
class Key:
    """One setting: its name, type, default and what it allows."""

    name: str
    kind: Kind
    default: Any = REQUIRED
    allowed: str = ""  # what the key takes, as its error says it: "an int >= 1"
    check: Callable[[Any], bool] | None = None  # the typed value is in range
    choices: tuple[str, ...] = ()  # a str key takes only these
    fold: bool = False  # a str key is lower-cased first
    message: str = ""  # its own error instead: "{label}" the key, "{value!r}" the value
    missing: str = ""  # its own error when required and absent ("{label}", "{name}")

    @property
    def required(self) -> bool:
        return self.default is REQUIRED


@dataclass(frozen=True)
class Table:
    """An integration's keys, and how its errors name them."""

    keys: tuple[Key, ...]
    label: str  # a key as errors name it, from "{name}": "mooncake {name}"
    unknown: str  # the error for unknown keys: "{unknown}" (a list), "{known}"
    missing: str  # the error for an absent required key: "{label}", "{name}"
    prefix: str = ""  # the keys' prefix in the dict given ("bsr." in LMCache's)
    others: tuple[str, ...] = ()  # prefixes (after `prefix`) another table reads
    text: bool = False
    null_is_default: bool = False
    error: type[ValueError] = BsrValueError

    def key(self, name: str) -> Key:
        for k in self.keys:
            if k.name == name:
                return k
        raise KeyError(name)

    def default(self, name: str) -> Any:
        """`name`'s default (for a dataclass's field)."""
        return self.key(name).default

    def names(self) -> list[str]:
        return [k.name for k in self.keys]


def parse(table: Table, given: Mapping[str, Any] | None) -> dict[str, Any]:
    """Every key's value from `given` (defaults filled in), checked; `table.error` naming
    the key and what it allows otherwise (see the module doc)."""
    ours: dict[str, Any] = {}
    for k, v in (given or {}).items():
        if not k.startswith(table.prefix):
            continue  # not this table's: another layer's key
        name = k[len(table.prefix) :]
        if not (table.others and name.startswith(table.others)):
            ours[name] = v
    names = table.names()
    unknown = sorted(set(ours) - set(names))
    if unknown:
        raise table.error(
            table.unknown.format(
                unknown=[table.prefix + u for u in unknown],
                known=sorted(table.prefix + n for n in names),
            )
        )
    for key in table.keys:
        if key.required and (ours.get(key.name) is None or ours.get(key.name) == ""):
            label = table.label.format(name=key.name)
            raise table.error((key.missing or table.missing).format(label=label, name=key.name))
    out: dict[str, Any] = {}
    for key in table.keys:
        value = ours.get(key.name)
        if key.name not in ours or (value is None and table.null_is_default):
            out[key.name] = key.default
        else:
            out[key.name] = _value(table, key, value, table.text)
    return out


def validate(table: Table, values: Mapping[str, Any]) -> None:
    """Check typed `values` (every key of `table`) against it; `table.error` otherwise."""
    for key in table.keys:
        _value(table, key, values[key.name], text=False)


def _value(table: Table, key: Key, value: Any, text: bool) -> Any:
    """`value` as `key`'s type, checked; `table.error` naming the key otherwise."""
    if value is None and key.default is None:
        return None
    typed = _typed(key.kind, value, text)
    if typed is not _BAD and key.fold and isinstance(typed, str):
        typed = typed.lower()
    if (
        typed is _BAD
        or (key.choices and typed not in key.choices)
        or (key.check is not None and not key.check(typed))
    ):
        label = table.label.format(name=key.name)
        if key.message:
            raise table.error(key.message.format(label=label, value=value))
        raise table.error(f"{label} must be {key.allowed}, got {value!r}")
    return typed


def _typed(kind: Kind, v: Any, text: bool) -> Any:
    """`v` as a `kind`, reading text when `text`; _BAD when it is not one."""
    if v is None:
        return _BAD
    if kind == "str":
        return v if isinstance(v, str) else str(v) if text else _BAD
    if kind == "bool":
        if isinstance(v, bool):
            return v
        word = str(v).strip().lower() if text else None
        return (word in TRUE) if word in TRUE or word in FALSE else _BAD
    if isinstance(v, bool):  # not a number, though Python says it is an int
        return _BAD
    if kind == "int" or kind == "size":
        if isinstance(v, int):
            return v
        if text and isinstance(v, float) and v.is_integer():
            return int(v)
        if text and isinstance(v, str):
            try:
                return parse_size(v) if kind == "size" else int(v.strip())
            except ValueError:
                return _BAD
        return _BAD
    if isinstance(v, (int, float)):
        return float(v)
    if text and isinstance(v, str):
        try:
            return float(v)
        except ValueError:
            return _BAD
    return _BAD


# Range checks the tables share.
def at_least(n: float) -> Callable[[Any], bool]:
    return lambda v: v >= n


def positive(v: Any) -> bool:
    return bool(v > 0)


def not_empty(v: Any) -> bool:
    return bool(v)
