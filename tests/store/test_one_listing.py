"""No component lists a store except through the tier's listing (tiers/files/listing.py,
issue 48 item 2): the source of every module under python/bsr_io is read (ast), and a
call that lists a directory (os.walk, os.scandir, os.listdir, Path.iterdir, glob) is
allowed in listing.py alone, and in the modules named below, which list something that
is not a store. A striped tier's capacity check counts a drive's records by the
listing's rules: links, temp files and files that are no record are not its bytes.
"""

from __future__ import annotations

import ast
from pathlib import Path

import bsr_io
from bsr_io import Engine
from bsr_io.cli.synthetic import fill_state
from bsr_io.model.layout import preset
from bsr_io.tiers import SSDTier
from bsr_io.tiers.files.listing import held_bytes
from bsr_io.tiers.striped import _held_bytes

PKG = Path(bsr_io.__file__).parent
LISTING = "tiers/files/listing.py"
# Modules that list a directory that is no store, and what they list.
NOT_A_STORE = {
    "integrations/vllm/cpus.py": "/proc/self/task: the process's threads",
    "cli/fio.py": "fio's own scratch files on the hugetlbfs mount it made",
}
LISTS = {"walk", "fwalk", "scandir", "listdir", "iterdir", "glob", "rglob", "iglob"}


def listing_calls(source: str) -> list[str]:
    """Each call in `source` that lists a directory, as `name:line`."""
    out = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Call):
            f = node.func
            name = f.attr if isinstance(f, ast.Attribute) else getattr(f, "id", "")
            if name in LISTS:
                out.append(f"{name}:{node.lineno}")
    return out


def test_no_module_lists_a_store_but_the_listing() -> None:
    found = {}
    for path in sorted(PKG.rglob("*.py")):
        rel = path.relative_to(PKG).as_posix()
        calls = listing_calls(path.read_text())
        if calls and rel != LISTING:
            found[rel] = calls
    assert set(found) == set(NOT_A_STORE), (
        f"modules that list directories: {found}; a store is listed through {LISTING} "
        "only (a module that lists something else goes in NOT_A_STORE, saying what)"
    )
    assert listing_calls((PKG / LISTING).read_text()), "the listing itself lists"


def test_the_check_finds_a_walk_a_scandir_and_a_glob() -> None:
    """Control: the capacity check as it was (os.walk), and other ways to list."""
    before = (
        "def _held_bytes(root):\n"
        "    for dirpath, _, files in os.walk(root / 'chunks'):\n"
        "        pass\n"
    )
    assert listing_calls(before) == ["walk:2"]
    more = "import os, glob\nos.scandir(d)\nglob.glob('*')\nPath(d).iterdir()\nlistdir(d)\n"
    assert listing_calls(more) == ["scandir:2", "glob:3", "iterdir:4", "listdir:5"]


def test_a_drives_held_bytes_are_its_records_by_the_listings_rules(tmp_path: Path) -> None:
    """Three records, and beside them a temp file of a save in progress, a link to a
    large file under a record's name, a linked rank directory and a file that is no
    record: only the three records are counted (the walk counted the temp file and the
    links)."""
    layout = preset("tiny")
    with Engine(1, layout.chunk_bytes) as engine:
        tier = SSDTier(tmp_path, None, engine, layout=layout)
        _, keys = fill_state(tier, layout, 3 * layout.chunk_tokens, seed=1, model="m")
        paths = [tier.path_of(k) for k in keys]
        want = sum(p.stat().st_size for p in paths)
        ns_dir = paths[0].parent
        (ns_dir / f".{'a' * 32}.0000abcd.1.1.tmp").write_bytes(b"t" * 65536)
        big = tmp_path / "elsewhere.bin"
        big.write_bytes(b"b" * 65536)
        (ns_dir / f"{0xABD:032x}.chunk").symlink_to(big)
        linked = ns_dir.with_name(ns_dir.name.replace("r0", "r1"))
        linked.symlink_to(ns_dir, target_is_directory=True)
        (ns_dir / "notes.txt").write_bytes(b"n" * 4096)
        tier.close()
        assert held_bytes(tmp_path / "chunks") == want
        assert _held_bytes(tmp_path) == want
        assert held_bytes(tmp_path / "absent") == 0
