"""The operator's commands import only what they use: `bsr-io --help`, `store stats` and
`store verify` never load torch (3 s of a 3.2 s start), while `store fill`, which
builds tensors, does (the control: the check sees torch when it is there). And the
wheel's CLI holds one benchmark, `bench store`; the others are the lab's."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

from bsr_io.cli import build_parser

TORCH = re.compile(r"\|\s*torch(\.\S+)?\s*$", re.MULTILINE)


def _imports_torch(*argv: str) -> bool:
    """Run `python -X importtime -m bsr_io.cli ARGV` and say whether torch was imported
    (importtime lists every module the process imported, on stderr)."""
    cmd = [sys.executable, "-X", "importtime", "-m", "bsr_io.cli", *argv]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "| bsr_io.cli" in proc.stderr, "importtime saw no import at all"
    return TORCH.search(proc.stderr) is not None


@pytest.fixture(scope="module")
def store(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("light") / "store"
    argv = ["store", "fill", str(path), "--layout", "tiny", "--tokens", "64", "--quiet"]
    # Filling builds tensors: torch is imported, which shows the check can see it.
    assert _imports_torch(*argv)
    return path


@pytest.mark.parametrize(
    "argv",
    [["--help"], ["store", "--help"], ["bench", "store", "--help"], ["demo", "--help"]],
)
def test_help_does_not_import_torch(argv: list[str]) -> None:
    assert not _imports_torch(*argv)


def test_store_stats_and_verify_do_not_import_torch(store: Path) -> None:
    assert not _imports_torch("store", "stats", str(store))
    assert not _imports_torch("store", "stats", "--json", str(store))
    assert not _imports_torch("store", "verify", str(store))


def test_the_public_api_still_imports_by_name() -> None:
    """The package's names resolve on first use (PEP 562), each from its module."""
    code = (
        "import sys, bsr_io\n"
        "assert 'torch' not in sys.modules\n"
        "from bsr_io import Restorer, PagedKVCache, preset, ChunkError\n"
        "import bsr_io.restore\n"
        "assert Restorer is bsr_io.restore.Restorer\n"
        "assert 'torch' in sys.modules\n"
        "missing = [n for n in bsr_io.__all__ if not hasattr(bsr_io, n)]\n"
        "assert not missing, missing\n"
        "try:\n"
        "    bsr_io.NoSuchName\n"
        "except AttributeError as exc:\n"
        "    print(exc)\n"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr
    assert "module 'bsr_io' has no attribute 'NoSuchName'" in proc.stdout


def test_the_wheel_ships_one_benchmark() -> None:
    parser = build_parser()
    sub = next(a for a in parser._actions if a.dest == "command")
    bench = sub.choices["bench"]
    benches = next(a for a in bench._actions if a.dest == "bench")
    assert sorted(benches.choices) == ["store"]
