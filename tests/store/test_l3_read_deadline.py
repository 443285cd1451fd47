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

import time
from pathlib import Path
from typing import Any

import pytest
from stalls import ends_within, fd_path, stalled

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


def _stalled(monkeypatch: pytest.MonkeyPatch, name: str, root: Path):  # type: ignore[no-untyped-def]
    """`os.<name>` blocked on L3's record files under `root` (fault double)."""

    def ours(fd: int) -> bool:
        path = fd_path(fd)
        return path.startswith(str(root)) and path.endswith(".chunk")

    return stalled(monkeypatch, name, ours)


def _in_time(work: Any) -> tuple[float, Any]:
    return ends_within(work, DEADLINE_S + SLACK_S, "read")


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
