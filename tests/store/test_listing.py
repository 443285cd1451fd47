"""The store's one listing (tiers/files/listing.py) counts what a load can open.

Real records written by a real tier, then what an operator or another process may put
beside them: a link to a record under another record's name, a link in place of a rank
directory, a directory and a FIFO named as records. The listing, the per-name check,
the tier's scan and the engine's own open (RESOLVE_NO_SYMLINKS below the store root)
must agree on every one of them.
"""

from __future__ import annotations

import errno
import os
from dataclasses import replace
from pathlib import Path

import pytest

from bsr_io import Engine
from bsr_io.cli.synthetic import fill_state
from bsr_io.model.layout import preset
from bsr_io.tiers import LowerTier, SSDTier
from bsr_io.tiers.files.listing import chunk_hashes, holds, list_store, namespaces

LAYOUT = preset("tiny")
TOKENS = 3 * LAYOUT.chunk_tokens  # three records


def _store_with_extras(root: Path, engine: Engine) -> tuple[SSDTier, dict[str, Path]]:
    """Three real records of rank 0 (w2r0), and beside them what no load may open."""
    tier = SSDTier(root, None, engine, layout=LAYOUT)
    _, keys = fill_state(tier, LAYOUT, TOKENS, seed=1, rank=0, world_size=2, model="m")
    first = tier.path_of(keys[0])
    ns_dir = first.parent
    other = f"{0xABC:032x}.chunk"
    extras = {
        "linked record": ns_dir / other,  # a valid record's bytes, through a link
        "linked rank dir": ns_dir.with_name(ns_dir.name.replace("-w2r0", "-w2r1")),
        "directory": ns_dir / f"{0xDEF:032x}.chunk",
        "fifo": ns_dir / f"{0xFED:032x}.chunk",
    }
    extras["linked record"].symlink_to(first)
    extras["linked rank dir"].symlink_to(ns_dir, target_is_directory=True)
    extras["directory"].mkdir()
    os.mkfifo(extras["fifo"])
    return tier, extras


def test_every_view_lists_exactly_what_the_engine_opens(tmp_path):
    engine = Engine(1, LAYOUT.chunk_bytes)
    written, extras = _store_with_extras(tmp_path, engine)
    held = {(k.namespace(), k.chunk_hash) for k in written.keys()}
    assert len(held) == 3
    listed = {(ns, h) for ns, hashes in list_store(tmp_path / "chunks").items() for h in hashes}
    assert listed == held
    # A tier opened afresh scans the directory through the same listing.
    for fresh in (SSDTier(tmp_path, None, engine), LowerTier(tmp_path)):
        assert {(k.namespace(), k.chunk_hash) for k in fresh.keys()} == held
    chunks = tmp_path / "chunks"
    for ns, h in held:
        assert holds(chunks, ns, h)
        engine.open(chunks / ns / f"{h:032x}.chunk", root=tmp_path).close()
    # What the listing leaves out, the engine refuses to open, for the same reason.
    linked_ns = extras["linked rank dir"].name
    assert namespaces(chunks) == [next(iter(held))[0]]
    assert chunk_hashes(extras["linked rank dir"]) == set()
    for _, h in held:
        assert not holds(chunks, linked_ns, h)
        with pytest.raises(OSError) as exc:
            engine.open(chunks / linked_ns / f"{h:032x}.chunk", root=tmp_path)
        assert exc.value.errno == errno.ELOOP
    ns = next(iter(held))[0]
    for what, want in (("linked record", errno.ELOOP), ("directory", errno.EISDIR)):
        path = extras[what]
        assert not holds(chunks, ns, int(path.name.removesuffix(".chunk"), 16)), what
        with pytest.raises(OSError) as exc:
            engine.open(path, root=tmp_path)
        assert exc.value.errno == want, what
    assert not holds(chunks, ns, int(extras["fifo"].name.removesuffix(".chunk"), 16))
    engine.close()


def test_names_that_are_no_records_are_refused_without_a_system_call(tmp_path):
    chunks = tmp_path / "chunks"
    assert list_store(chunks) == {}  # no store yet: nothing held, no error
    assert chunk_hashes(chunks / "absent") == set()
    assert not holds(chunks, "../../etc", 1)
    assert not holds(chunks, "0" * 32 + "-" + "0" * 32 + "-w1r0", -1)
    assert not holds(chunks, "0" * 32 + "-" + "0" * 32 + "-w1r0", 1 << 128)


def test_a_namespace_dir_gone_or_replaced_by_a_file_holds_nothing(tmp_path):
    ns_dir = tmp_path / ("0" * 32 + "-" + "0" * 32 + "-w1r0")
    assert chunk_hashes(ns_dir) == set()
    ns_dir.write_bytes(b"")
    assert chunk_hashes(ns_dir) == set()
    ns_dir.unlink()
    ns_dir.mkdir()
    (ns_dir / f"{5:032x}.chunk").write_bytes(b"x")
    (ns_dir / f"{6:032x}.chunk.bak").write_bytes(b"x")
    assert chunk_hashes(ns_dir) == {5}


@pytest.mark.parametrize("kind", ["L2", "L3"])
def test_a_linked_rank_directory_is_not_contained(kind, tmp_path):
    """`contains` answers by the listing's rules: a record reached through a linked rank
    directory is not held (every load of it would fail with ELOOP), and probing it
    neither adopts it nor quarantines the real record the link points at."""
    engine = Engine(1, LAYOUT.chunk_bytes)
    written, extras = _store_with_extras(tmp_path, engine)
    tier = SSDTier(tmp_path, None, engine) if kind == "L2" else LowerTier(tmp_path)
    ours = sorted(tier.keys(), key=lambda k: k.chunk_hash)
    linked = [replace(k, rank=1) for k in ours]
    assert tier.path_of(linked[0]).parent == extras["linked rank dir"]
    assert tier.path_of(linked[0]).exists()  # through the link
    for k in linked:
        assert not tier.contains(k)
    assert tier.probe(linked) == 0
    assert tier.problems == [] and written.problems == []
    assert all(tier.contains(k) for k in ours)  # the real records are left alone
    assert sorted(written.keys(), key=lambda k: k.chunk_hash) == ours
    engine.close()
