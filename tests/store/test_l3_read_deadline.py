"""L3's read of a record has the read's deadline (`tiers.base.read_deadline`).

L3 reads buffered: the open, the header's pread (a record the tier has not indexed:
written by another process) and the payload's preadv. Before, they ran on the reading
thread with no limit, so a stalled mount held the restore for as long as it liked. Now
they run on a thread of their own and the read is a read error at the deadline (nothing
withdrawn, a lower source or recompute serves the chunk); the stalled call goes on
alone, and the slot it reads into goes back to the ring when it returns.

The stall is a fault double: `os.pread` or `os.preadv` blocks, as on a stalled mount,
for the descriptors of the tier's record files only (found through /proc/self/fd),
until the test releases it. The tier, engine and window are the real ones; the read runs
on a thread of the test's, so that a read with no deadline fails the test instead of
hanging it.
"""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest

from bsr_io import Engine
from bsr_io.cli.synthetic import fill_state, synthetic_chunk
from bsr_io.errors import ChunkReadError
from bsr_io.load.kvcache import PagedKVCache
from bsr_io.load.window import Window
from bsr_io.model.layout import preset
from bsr_io.tiers import LowerTier

LAYOUT = preset("tiny")
CHUNKS = 2
DEADLINE_S = 1.0
SLACK_S = 1.5


class _Stall:
    """Fault double of `os.<name>`: blocks on a record file under `root` until released."""

    def __init__(self, name: str, root: Path) -> None:
        self.real = getattr(os, name)
        self.root = str(root)
        self.released = threading.Event()
        self.hits = 0

    def __call__(self, fd: int, *args: Any) -> Any:
        try:
            target = os.readlink(f"/proc/self/fd/{fd}")
        except OSError:
            target = ""
        if target.startswith(self.root) and target.endswith(".chunk"):
            self.hits += 1
            self.released.wait(60)
        return self.real(fd, *args)


@contextmanager
def _stalled(monkeypatch: pytest.MonkeyPatch, name: str, root: Path) -> Iterator[_Stall]:
    stall = _Stall(name, root)
    monkeypatch.setattr(os, name, stall)
    try:
        yield stall
    finally:
        stall.released.set()
        time.sleep(0.3)  # the stalled call returns on its own thread
        monkeypatch.undo()


def _in_time(work: Any) -> tuple[float, Any]:
    """Run `work` on a thread; (seconds it took, what it returned or raised). Fails the
    test when it is still blocked well past the deadline (a wait with no limit)."""
    got: list[Any] = []

    def body() -> None:
        try:
            got.append(work())
        except BaseException as exc:  # noqa: BLE001 - checked by the caller
            got.append(exc)

    t0 = time.monotonic()
    worker = threading.Thread(target=body, daemon=True)
    worker.start()
    worker.join(DEADLINE_S + SLACK_S)
    took = time.monotonic() - t0
    assert not worker.is_alive(), f"the read still waits {took:.1f} s in (no deadline)"
    return took, got[0]


def _tier(root: Path, call: str) -> tuple[LowerTier, list]:  # type: ignore[type-arg]
    """L3 over `root`; for the header's pread, records it has not indexed (written by
    another tier instance after it scanned the directory, as another process's)."""
    if call == "pread":
        reader = LowerTier(root, layout=LAYOUT)
        _, keys = fill_state(LowerTier(root, layout=LAYOUT), LAYOUT, LAYOUT.chunk_tokens * CHUNKS)
        return reader, keys
    _, keys = fill_state(LowerTier(root, layout=LAYOUT), LAYOUT, LAYOUT.chunk_tokens * CHUNKS)
    return LowerTier(root, layout=LAYOUT), keys


@pytest.mark.parametrize("call", ["pread", "preadv"], ids=["header", "payload"])
def test_a_stalled_l3_read_is_a_read_error_at_the_deadline(tmp_path, monkeypatch, call):
    root = tmp_path / "l3"
    l3, keys = _tier(root, call)
    with Engine(2, LAYOUT.chunk_bytes) as engine:
        window = Window(engine, [l3], LAYOUT.chunk_bytes)
        dest = PagedKVCache.allocate(LAYOUT, LAYOUT.chunk_tokens * CHUNKS)
        with _stalled(monkeypatch, call, root) as stall:
            took, report = _in_time(
                lambda: window.run(
                    keys, [0] * CHUNKS, dest, read_deadline=time.monotonic() + DEADLINE_S
                )
            )
            assert not isinstance(report, BaseException), report
            assert stall.hits >= 1 and took < DEADLINE_S + SLACK_S
            # The chunk is a read error (not a corrupt record): nothing installed from
            # it, nothing withdrawn.
            assert report.installed == 0 and report.failed_chunks[:1] == [0], report
            assert "did not end by the read's deadline" in report.error, report
            assert l3.stats()["quarantined"] == 0
            assert len(list(root.rglob("*.chunk"))) == CHUNKS
        # The late read returned its slot to the ring.
        assert engine.free_slots() == 2
        # Control: the call free, the same run reads every chunk from L3.
        report = window.run(keys, [0] * CHUNKS, dest, read_deadline=time.monotonic() + 10)
        assert report.installed == CHUNKS, report
        assert all(
            dest.chunk_bytes(i) == synthetic_chunk(LAYOUT, 0, i).tobytes() for i in range(CHUNKS)
        )


def test_a_tier_read_ends_at_its_threads_read_deadline(tmp_path, monkeypatch):
    """The tier's own call (as a store's read outside a window uses it) has the deadline
    set for its thread (`reads_by`; without one, READ_TIMEOUT_S from now). A read started
    past it gets READ_FLOOR_S (L3 serving what a stalled tier above could not: see
    test_header_read_deadline.py), unless one of the tier's reads is still stuck."""
    from bsr_io.tiers.base import reads_by, reads_end

    root = tmp_path / "l3"
    l3, keys = _tier(root, "preadv")
    with Engine(2, LAYOUT.chunk_bytes) as engine, _stalled(monkeypatch, "preadv", root):

        def read() -> Any:
            token = reads_by(time.monotonic() + DEADLINE_S)
            try:
                out: list[Any] = []
                for key in keys:  # the second starts past the deadline
                    t0 = time.monotonic()
                    try:
                        out.append(l3.submit_read(key, engine))
                    except ChunkReadError as exc:
                        out.append((exc, time.monotonic() - t0))
                return out
            finally:
                reads_end(token)

        took, got = _in_time(read)
        assert all(isinstance(g, tuple) for g in got), got
        assert took < DEADLINE_S + SLACK_S
        # Past the deadline, with the first read still stuck, the next fails at once
        # (no READ_FLOOR_S for a tier whose mount is stalled).
        assert got[1][1] < 0.3, got
