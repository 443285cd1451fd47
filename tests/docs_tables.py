"""The settings tables of the integration guides (docs/vllm.md, docs/sglang.md), read
back so that tests can hold them to the settings tables the code parses with
(`bsr_io.settings.Table`).

A guide's table has a row per key: the key, its type and its default as code spans
(`8`, `"auto"`, `null`, JSON as the configuration takes it) or the word "required";
the cells after them are prose. A key ending in `*` stands for a prefix another table
reads (`bsr.mooncake.*`).
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from bsr_io.settings import REQUIRED, Table, parse

CODE = re.compile(r"`([^`]*)`")


@dataclass(frozen=True)
class Row:
    key: str
    kind: str  # the type cell's first code span ("" when it has none)
    default: Any  # the default cell's first code span as JSON, or REQUIRED
    line: str


def settings_rows(path: Path, heading: str) -> dict[str, Row]:
    """The rows of the first table after the line `heading` in `path`, by key."""
    lines = path.read_text().splitlines()
    if heading not in lines:
        raise AssertionError(f"{path.name} has no line {heading!r}")
    at = lines.index(heading) + 1
    while at < len(lines) and not lines[at].startswith("|"):
        at += 1
    rows: dict[str, Row] = {}
    for line in lines[at + 2 :]:  # past the header and its separator
        if not line.startswith("|"):
            break
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        key = CODE.search(cells[0])
        if key is None:
            raise AssertionError(f"{path.name}: a settings row without a `key`: {line}")
        kind = CODE.search(cells[1])
        shown = CODE.search(cells[2])
        if cells[2].startswith("required"):
            default: Any = REQUIRED
        elif shown is None:
            default = None  # prose ("none") for a prefix row
        else:
            default = json.loads(shown.group(1))
        rows[key.group(1)] = Row(key.group(1), kind.group(1) if kind else "", default, line)
    if not rows:
        raise AssertionError(f"{path.name}: no table after {heading!r}")
    return rows


def check_table(table: Table, rows: dict[str, Row], base: dict[str, Any]) -> None:
    """Every key of `table` has a row with its type and default (as JSON gives them), and
    every row's key is one `table` accepts, with its shown default (`base`: the required
    keys' values, so that one key at a time is parsed); AssertionError naming the first
    that is not."""
    for key in table.keys:
        row = rows.get(key.name)
        assert row is not None, f"`{key.name}` ({key.kind}) is not in the table"
        assert row.kind == key.kind, f"`{key.name}`: the table says {row.kind!r}, code {key.kind!r}"
        if key.required:
            assert row.default is REQUIRED, f"`{key.name}` is required; the table shows a default"
        else:
            shown, code = row.default, key.default
            assert shown is not REQUIRED, f"`{key.name}` has a default; the table says required"
            same = shown == code and type(shown) is type(code)
            assert same, f"`{key.name}`: the table's default {shown!r}, code's {code!r}"
    for name, row in rows.items():
        if name.endswith("*"):
            prefix = name[:-1].removeprefix(table.prefix)
            assert prefix in table.others, f"`{name}`: no prefix {table.others} matches"
            continue
        assert name in table.names(), f"`{name}` is in the table, and the code knows no such key"
        value = base[name] if row.default is REQUIRED else row.default
        parse(table, {**base, name: value})  # accepted, with the value the table shows
