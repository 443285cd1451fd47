"""The wheel is the library plus the commands an operator runs on their own machine:
`bsr-io store`, `bsr-io demo` and the drive-level `bsr-io bench store`. Benchmarks,
their plots, scenarios and stand-ins are the lab's (`lab/bsr_lab`), never shipped."""

from __future__ import annotations

import zipfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
# The operator's commands and what they need; a new module here is a decision, not drift.
CLI = {
    "__init__",
    "__main__",
    "bench_store",
    "fio",
    "host",
    "progress",
    "ranks",
    "report",
    "scratch",
    "store",
    "store_pool",
    "synthetic",
    "whole_plan",
    "demo/__init__",
    "demo/rank",
    "demo/report",
}


def _wheel() -> Path:
    wheels = sorted((ROOT / "target" / "wheels").glob("bsr_io-*-abi3-*.whl"))
    assert wheels, "no abi3 wheel in target/wheels: scripts/install.sh builds it"
    return max(wheels, key=lambda p: p.stat().st_mtime)


def test_the_cli_in_the_source_is_the_operators_commands():
    cli = ROOT / "python" / "bsr_io" / "cli"
    have = {str(p.relative_to(cli).with_suffix("")) for p in cli.rglob("*.py")}
    assert have == CLI, f"added: {sorted(have - CLI)}, gone: {sorted(CLI - have)}"


def test_the_wheel_ships_the_library_and_no_lab():
    names = zipfile.ZipFile(_wheel()).namelist()
    assert "bsr_io/_core.abi3.so" in names  # one build for every Python 3.11+
    assert "bsr_io/py.typed" in names
    assert not [n for n in names if n.startswith(("bsr_lab/", "tests/", "lab/"))]
    cli = {
        n.removeprefix("bsr_io/cli/").removesuffix(".py")
        for n in names
        if n.startswith("bsr_io/cli/") and n.endswith(".py")
    }
    assert cli == CLI, f"the wheel's commands differ: {sorted(cli ^ CLI)}"
    entry = next(n for n in names if n.endswith("entry_points.txt"))
    scripts = zipfile.ZipFile(_wheel()).read(entry).decode()
    assert "bsr-io=bsr_io.cli:main" in scripts.replace(" ", "") and "bsr-lab" not in scripts
