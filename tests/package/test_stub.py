"""The hand-written `_core.pyi` and the compiled module name the same things."""

from __future__ import annotations

import ast
from pathlib import Path

import bsr_io._core as core

STUB = Path(core.__file__).with_name("_core.pyi")


def _stub_names() -> dict[str, set[str]]:
    names: dict[str, set[str]] = {}
    for node in ast.parse(STUB.read_text()).body:
        if isinstance(node, ast.ClassDef):
            names[node.name] = {
                m.name
                for m in node.body
                if isinstance(m, ast.FunctionDef) and not m.name.startswith("__")
            }
        elif isinstance(node, ast.FunctionDef):
            names[node.name] = set()
    return names


def test_stub_matches_module() -> None:
    stub = _stub_names()
    for name, members in stub.items():
        assert hasattr(core, name), f"{name} is in the stub but not in the module"
        for member in members:
            assert hasattr(getattr(core, name), member), f"{name}.{member} missing"
    public = {n for n in dir(core) if not n.startswith("_")}
    assert public <= set(stub), f"not in the stub: {sorted(public - set(stub))}"


def test_exception_tree() -> None:
    for name in ("AlignmentError", "ShortReadError", "EngineClosedError", "NoSpaceError"):
        assert issubclass(getattr(core, name), core.BsrIoError)
    assert issubclass(core.BsrIoError, OSError)
    assert issubclass(core.FileMissingError, FileNotFoundError)
    assert issubclass(core.FilePermissionError, PermissionError)
    assert core.ShortReadError.__module__ == "bsr_io._core"
