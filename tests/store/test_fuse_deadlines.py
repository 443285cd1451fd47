"""The waits of the read and save paths that a kernel stall holds, stalled for real.

A tier's directory is served through the kernel's FUSE (`late_dir`, tests/fuse_stall.py)
from its own contents, and the server answers the chosen calls on the chosen files only
after STALL_S (or when the test releases them): the calling thread waits in the kernel,
as on a hung NFS mount or FUSE store. The calls:

- an L2 read of a record the tier has not indexed (another process's): its open, the
  fstat after it (a GETATTR), its header read, and a hung mount (every lookup held). The
  chunk is a read error by the read's deadline (nothing quarantined) and comes from L3.
- an L2 save (one native call): the write of its header and payload, its fdatasync.
- an L3 save: the same two, buffered; the temp file's fstat; and a hung mount, where
  the save's first call (the look for a stored copy) is held.

A save fails by its deadline (ChunkWriteError, the record not indexed), and once the
stalled call returns nothing of it is published: no temp file is left, the records stored
before read back verified, and a save through the same mount then succeeds (control).
The work runs on a thread of the test's, so that a wait with no deadline fails the test
instead of hanging it.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from fuse_stall import late_dir
from layouts import ALIGNED
from stalls import ends_within

from bsr_io import Engine
from bsr_io.cli.synthetic import fill_state, synthetic_chunk, synthetic_tokens
from bsr_io.errors import ChunkWriteError
from bsr_io.load.kvcache import PagedKVCache
from bsr_io.load.window import Window
from bsr_io.model.keys import chunk_keys
from bsr_io.save.records import write_staged
from bsr_io.tiers import LowerTier, SSDTier
from bsr_io.tiers.files import FileTier

pytestmark = pytest.mark.skipif(
    os.geteuid() != 0 or not os.path.exists("/dev/fuse"), reason="FUSE needs root and /dev/fuse"
)

# 4 KiB blocks: every piece of a record is page-aligned, as O_DIRECT wants.
LAYOUT = ALIGNED
CHUNKS = 2
DEADLINE_S = 1.0
SLACK_S = 1.5
STALL_S = 60.0


def _until(ok: Callable[[], bool], what: str) -> None:
    def wait() -> None:
        while not ok():
            time.sleep(0.01)

    ends_within(wait, 5.0, what)


def _holds(dest: PagedKVCache) -> bool:
    return all(
        dest.chunk_bytes(i) == synthetic_chunk(LAYOUT, 1, i).tobytes() for i in range(CHUNKS)
    )


@pytest.mark.parametrize(
    ("call", "suffix"),
    [("open", ".chunk"), ("getattr", ".chunk"), ("read", ".chunk"), ("lookup", "")],
    ids=["open", "fstat", "header", "hung-mount"],
)
def test_a_stalled_l2_open_or_header_read_falls_back_by_the_deadline(tmp_path, call, suffix):
    """`hung-mount`: every path lookup below the tier's root is held, the directory's
    too: after the open is given up, nothing on the caller's thread may touch the mount
    (the directory check a read error otherwise makes)."""
    root = tmp_path / "l2"
    with Engine(4, LAYOUT.chunk_bytes) as engine:
        l2 = SSDTier(root, None, engine, layout=LAYOUT)  # scans an empty directory
        fill_state(SSDTier(root, None, engine, layout=LAYOUT), LAYOUT, 64 * CHUNKS, seed=1)
        l3 = LowerTier(tmp_path / "l3", layout=LAYOUT)
        _, keys = fill_state(l3, LAYOUT, 64 * CHUNKS, seed=1)
        window = Window(engine, [l2, l3], LAYOUT.chunk_bytes)

        def run() -> Any:
            dest = PagedKVCache.allocate(LAYOUT, 64 * CHUNKS)
            report = window.run(keys, [0] * CHUNKS, dest, read_deadline=time.monotonic() + 1)
            return report, dest

        with late_dir(root, STALL_S, [call], suffix) as late:
            took, got = ends_within(run, DEADLINE_S + SLACK_S, "restore")
            assert not isinstance(got, BaseException), got
            report, dest = got
            # Every chunk came from L3; L2's were read errors, which prove nothing.
            assert report.installed == CHUNKS and report.sources == ["L3"] * CHUNKS, report
            assert "by the read's deadline" in report.fallbacks[0]["causes"][0], report
            assert _holds(dest) and l2.stats()["quarantined"] == 0
            late.release()
            # Control, through the same mount: answered at once, the chunks come from L2.
            report, dest = run()
            assert report.installed == CHUNKS and report.sources == ["L2"] * CHUNKS, report
            assert _holds(dest)


def _l2(root: Path, engine: Engine) -> SSDTier:
    return SSDTier(root, None, engine, layout=LAYOUT, write_timeout_s=DEADLINE_S)


def _l3(root: Path, engine: Engine) -> LowerTier:
    return LowerTier(root, layout=LAYOUT, write_timeout_s=DEADLINE_S)


@pytest.mark.parametrize(
    ("make", "call", "suffix"),
    [
        (_l2, "write", ".tmp"),
        (_l2, "fsync", ".tmp"),
        (_l3, "write", ".tmp"),
        (_l3, "fsync", ".tmp"),
        (_l3, "getattr", ".tmp"),
        (_l3, "lookup", ""),
    ],
    ids=["L2-write", "L2-fsync", "L3-write", "L3-fsync", "L3-fstat", "L3-hung-mount"],
)
def test_a_stalled_save_fails_by_its_deadline_and_publishes_nothing(tmp_path, make, call, suffix):
    """`L3-fstat`: the temp file's fstat after its write (the record's identity for the
    index) is held. `L3-hung-mount`: every path lookup is held, so the save's first call,
    the look for a copy already stored, is."""
    root = tmp_path / "tier"
    window = 2
    with Engine(window, LAYOUT.chunk_bytes) as engine:
        tier: FileTier = make(root, engine)
        _, first = fill_state(tier, LAYOUT, 64, seed=1)
        with late_dir(root, STALL_S, [call], suffix) as late:
            took, exc = ends_within(
                lambda: fill_state(tier, LAYOUT, 64, seed=2) and None, DEADLINE_S + SLACK_S, "save"
            )
            assert isinstance(exc, ChunkWriteError), exc
            says = {
                "write": "the write of",
                "fsync": "the write of",
                "getattr": "the fstat of",
                "lookup": "the look for a stored copy of",
            }
            if make is _l2:
                says["fsync"] = "the fdatasync of"
            assert says[call] in str(exc) and "did not end within" in str(exc), exc
            assert tier.keys() == first  # never reported stored
            late.release()
            # The stalled call returns: its temp file is removed, nothing published, and
            # the slot the L2 save leased is back in the ring.
            _until(lambda: not list(root.rglob("*.tmp")), "temp file's removal")
            _until(lambda: engine.free_slots() == window, "slot's return")
            assert len(list(root.rglob("*.chunk"))) == 1
            # Control, through the same mount: answered at once, a save is stored.
            _, third = fill_state(tier, LAYOUT, 64, seed=3)
            assert set(tier.keys()) == {first[0], third[0]}
        fresh = make(root, engine)  # as another process: the records on disk, verified
        assert set(fresh.keys()) == {first[0], third[0]}
        for seed, key in ((1, first[0]), (3, third[0])):
            slot = fresh.submit_read(key, engine).wait()
            try:
                assert bytes(memoryview(slot)) == synthetic_chunk(LAYOUT, seed, 0).tobytes()
            finally:
                slot.release()
        assert fresh.stats()["quarantined"] == 0


def test_a_caller_slot_given_back_at_a_stalled_write_returns_only_when_the_write_ends(tmp_path):
    """A save from a slot its caller leased (a vLLM step cut, `write_staged`), whose
    write the kernel still holds at the tier's deadline. The caller gives the slot back
    at once (`give_back`): the save fails with its own error, not a refused release (the
    engine counts the write in flight against the slot); the slot stays out of the ring
    while the kernel may still read it and comes back when the write ends; nothing is
    published."""
    root = tmp_path / "l2"
    window = 2
    with Engine(window, LAYOUT.chunk_bytes) as engine:
        tier = _l2(root, engine)
        _, first = fill_state(tier, LAYOUT, 64, seed=1)
        key = chunk_keys(synthetic_tokens(2, 64), LAYOUT, "synthetic", 0, 1)[0]
        slot = engine.lease()
        slot.fill_from(synthetic_chunk(LAYOUT, 2, 0))
        slot.set_length(LAYOUT.chunk_bytes)
        errors: list[BaseException | None] = []
        with late_dir(root, STALL_S, ["write"], ".tmp") as late:
            took, got = ends_within(
                lambda: write_staged(
                    tier, [key], [LAYOUT], [slot], width=1, on_done=lambda i, e: errors.append(e)
                ),
                DEADLINE_S + SLACK_S,
                "save",
            )
            assert got == 0, got
            (exc,) = errors
            assert isinstance(exc, ChunkWriteError), exc
            assert "the write of" in str(exc) and "did not end within" in str(exc), exc
            # Given back by its caller, but the write from it is still the kernel's.
            assert slot.released and len(list(root.rglob("*.tmp"))) == 1
            assert engine.free_slots() == window - 1
            late.release()
            _until(lambda: engine.free_slots() == window, "slot's return")
            _until(lambda: not list(root.rglob("*.tmp")), "temp file's removal")
            assert tier.keys() == first and len(list(root.rglob("*.chunk"))) == 1
        assert _l2(root, engine).keys() == first  # as another process sees the drive
