"""Publishing a saved record has the record's deadline (`write_timeout_s`) too.

The directory calls of a save (creating the temp file, the rename over the final name,
the directory's fsync) ran on the saving thread with no limit, after the bounded write
and fdatasync: a stalled drive held the save for good. Now they run on a thread of their
own (tiers/files/publish.py) and the save fails (ChunkWriteError) at the deadline.

What a call given up on does when it returns late: a temp file created late is removed;
a rename that completes late publishes the record, which was written whole and
fdatasynced before the rename began, and which a reader then verifies like any record
another process wrote (checked below: it reads back equal); a late directory fsync
follows a rename already done (the same). No temp file is left either way.

The stall is a fault double: for L3, `os.open` (the temp file's creation), `os.rename`
or `os.fsync` (of the record's directory) blocks, as on a stalled drive, for the tier's
paths only, until the test releases it; for L2, whose records are published in one
native call, the engine's `stall_publish` holds a step just before its system call. The
tiers are the real ones; the save runs on a thread of the test's, so that a save with no
deadline fails the test instead of hanging it.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from stalls import ends_within, fd_path, stalled

from bsr_io import Engine
from bsr_io._core import stall_publish
from bsr_io.cli.synthetic import fill_state, synthetic_chunk
from bsr_io.errors import ChunkWriteError
from bsr_io.model.layout import preset
from bsr_io.tiers import LowerTier, SSDTier

LAYOUT = preset("tiny")
DEADLINE_S = 1.0
SLACK_S = 1.5


def _stalled(monkeypatch: pytest.MonkeyPatch, name: str, root: Path):  # type: ignore[no-untyped-def]
    """`os.<name>` blocked on the tier's temp file (`open`, `rename`) or record
    directory (`fsync` of a descriptor) under `root` (fault double)."""

    def ours(first: Any) -> bool:
        if name == "fsync":
            target = fd_path(first)
            return target.startswith(str(root)) and os.path.isdir(target)
        path = os.fspath(first)
        return isinstance(path, str) and path.startswith(str(root)) and path.endswith(".tmp")

    return stalled(monkeypatch, name, ours)


def _save_in_time(save: Callable[[], object]) -> tuple[float, BaseException | None]:
    """(seconds, what it raised or None); fails the test past the deadline's slack."""
    return ends_within(lambda: (save(), None)[1], DEADLINE_S + SLACK_S, "save")


def _reads_back(root: Path, scratch: Path, seed: int) -> bool:
    """A fresh L3 over `root` (as another process) reads the record of `seed` verified."""
    key = fill_state(LowerTier(scratch / str(seed)), LAYOUT, LAYOUT.chunk_tokens, seed=seed)[1][0]
    tier = LowerTier(root, layout=LAYOUT)
    with Engine(2, LAYOUT.chunk_bytes) as engine:
        slot = tier.submit_read(key, engine).wait()
        try:
            return bytes(memoryview(slot)) == synthetic_chunk(LAYOUT, seed, 0).tobytes()
        finally:
            slot.release()


@pytest.mark.parametrize("call", ["open", "rename", "fsync"])
def test_a_stalled_publish_fails_the_save_at_its_deadline(tmp_path, monkeypatch, call):
    root = tmp_path / "l3"
    tier = LowerTier(root, layout=LAYOUT, write_timeout_s=DEADLINE_S)
    _, first = fill_state(tier, LAYOUT, LAYOUT.chunk_tokens, seed=1)
    with _stalled(monkeypatch, call, root) as stall:
        took, exc = _save_in_time(lambda: fill_state(tier, LAYOUT, LAYOUT.chunk_tokens, seed=2))
        assert isinstance(exc, ChunkWriteError), exc
        assert "did not end within" in str(exc), exc
        assert stall.hits == 1 and took < DEADLINE_S + SLACK_S
        assert tier.keys() == first  # not indexed: the caller was told it failed
    # Released: no temp file left; a late rename (or fsync after it) published the whole
    # record, verified on read; a temp file created late was removed.
    assert not list(root.rglob("*.tmp"))
    chunks = len(list(root.rglob("*.chunk")))
    assert chunks == (1 if call == "open" else 2)
    if call != "open":
        assert _reads_back(root, tmp_path / "scratch", 2)
    assert _reads_back(root, tmp_path / "scratch", 1)
    # Control: with the calls free the next save is published and indexed.
    _, third = fill_state(tier, LAYOUT, LAYOUT.chunk_tokens, seed=3)
    assert third[0] in tier.keys()


@pytest.mark.parametrize(
    ("step", "says", "publishes"),
    [
        ("create", "temp file's creation", False),
        ("write", "write", False),
        ("fdatasync", "fdatasync", False),
        ("rename", "rename", True),
        ("dirsync", "directory's fsync", True),
    ],
)
def test_a_stalled_l2_publication_fails_the_save_at_its_deadline(tmp_path, step, says, publishes):
    """L2 publishes a record in one native call; each of its steps held (the engine's
    stall double, `stall_publish`: the step's system call does not return) fails the
    save at the deadline, naming the step. The slot the tier leased stays out of the
    ring until its bytes are written, and is back as soon as they are."""
    root = tmp_path / "l2"
    window = 2
    with Engine(window, LAYOUT.chunk_bytes) as engine:
        tier = SSDTier(root, None, engine, layout=LAYOUT, write_timeout_s=DEADLINE_S)
        _, first = fill_state(tier, LAYOUT, LAYOUT.chunk_tokens, seed=1)
        stall = stall_publish(step, str(root))
        try:
            took, exc = _save_in_time(lambda: fill_state(tier, LAYOUT, LAYOUT.chunk_tokens, seed=2))
            assert isinstance(exc, ChunkWriteError), exc
            assert f"the {says} of " in str(exc) and "did not end within" in str(exc), exc
            assert stall.hits == 1 and took < DEADLINE_S + SLACK_S
            assert tier.keys() == first  # not indexed: the caller was told it failed
            written = step not in ("create", "write")
            assert engine.free_slots() == (window if written else window - 1)
        finally:
            stall.release()
        # Released: the slot comes back; a chain given up on before its rename removes
        # its temp file; a rename already under way publishes the whole record.
        ends_within(lambda: _until(lambda: engine.free_slots() == window), 5.0, "slot")
        ends_within(lambda: _until(lambda: not list(root.rglob("*.tmp"))), 5.0, "cleanup")
        assert len(list(root.rglob("*.chunk"))) == (2 if publishes else 1)
        fresh = SSDTier(root, None, engine, layout=LAYOUT)
        for key in fresh.keys():
            fresh.submit_read(key, engine).wait().release()
        assert fresh.stats()["quarantined"] == 0
        # Control: unheld, the next save is published and indexed at once.
        _, third = fill_state(tier, LAYOUT, LAYOUT.chunk_tokens, seed=3)
        assert third[0] in tier.keys()


def _until(ok: Callable[[], bool]) -> None:
    while not ok():
        time.sleep(0.01)
