"""An L2 record's open and header read, when the index does not know the record
(written by another process, or replaced since it was indexed), have the read's deadline.

The header is read through the engine (io_uring), waited for until the window's run
deadline: a stalled drive makes the chunk a read error then, which proves nothing
against the record (nothing quarantined), and the chunk comes from a lower tier; the
run returns by its deadline. Before, the header was a plain pread on the window's
thread, outside the engine and with no deadline.

The open runs on a thread of its own then, waited for until that deadline (a test double
of the engine stalls it below: opening a record blocks, as a path lookup on a stalled
drive does). The header stall is real: the engine's only I/O lane is held by a read of a FIFO nobody
writes (a hung device as the engine sees one: every later request waits behind it).
The engine, tiers and window are the real ones; the records are written by a second
tier over the same directory after the reading tier scanned it (another process's
records, as the reading tier sees them).
"""

from __future__ import annotations

import threading
import time

import pytest
from layouts import ALIGNED
from stalls import lane_held

from bsr_io import Engine
from bsr_io.cli.synthetic import fill_state, synthetic_chunk
from bsr_io.load.kvcache import PagedKVCache
from bsr_io.load.window import Window
from bsr_io.tiers import LowerTier, SSDTier

# Blocks of 4 KiB: every run suits O_DIRECT, so `direct` reads straight into them.
LAYOUT = ALIGNED
CHUNKS = 3
DEADLINE_S = 1.0


def _run(engine: Engine, tiers: list, keys: list, dest: PagedKVCache, direct: bool):  # type: ignore[no-untyped-def]
    window = Window(engine, tiers, LAYOUT.chunk_bytes, direct=direct)
    t0 = time.monotonic()
    report = window.run(keys, [0] * len(keys), dest, read_deadline=t0 + DEADLINE_S)
    return report, time.monotonic() - t0


def _dest(engine: Engine) -> tuple[PagedKVCache, object]:
    """A host cache, registered with the ring by its owner up front (as a serving
    engine does for its pool): registering waits for the engine's I/O thread."""
    dest = PagedKVCache.allocate(LAYOUT, LAYOUT.chunk_tokens * CHUNKS)
    return dest, dest.register(engine)


def _holds_state(dest: PagedKVCache) -> bool:
    return all(
        dest.chunk_bytes(i) == synthetic_chunk(LAYOUT, 1, i).tobytes() for i in range(CHUNKS)
    )


@pytest.mark.parametrize("direct", [False, True], ids=["slot", "direct"])
def test_a_stalled_header_read_is_a_read_error_at_the_deadline(backend, tmp_path, direct):
    if backend == "pread":
        pytest.skip("a FIFO cannot hold the pread pool's worker (ESPIPE)")
    root = tmp_path / "l2"
    with Engine(4, LAYOUT.chunk_bytes, backend=backend, queue_depth=1) as engine:
        l2 = SSDTier(root, None, engine, layout=LAYOUT)  # scans an empty directory
        with Engine(2, LAYOUT.chunk_bytes) as other:
            _, keys = fill_state(
                SSDTier(root, None, other, layout=LAYOUT),
                LAYOUT,
                LAYOUT.chunk_tokens * CHUNKS,
                seed=1,
            )
        l3 = LowerTier(tmp_path / "l3", layout=LAYOUT)
        assert fill_state(l3, LAYOUT, LAYOUT.chunk_tokens * CHUNKS, seed=1)[1] == keys
        dest, reg = _dest(engine)
        with lane_held(engine, tmp_path):
            report, took = _run(engine, [l2, l3], keys, dest, direct)
            assert took < DEADLINE_S + 1.5, f"the run took {took:.1f} s"
            # Every chunk came from L3; L2's header reads were read errors, no timeout of
            # the run, nothing quarantined, the records still there.
            assert report.installed == CHUNKS and not report.timed_out, report
            assert report.sources == ["L3"] * CHUNKS, report
            assert "header read" in report.fallbacks[0]["causes"][0], report.fallbacks
            assert _holds_state(dest)
            assert l2.stats()["quarantined"] == 0
            assert len(list(root.rglob("*.chunk"))) == CHUNKS
        # Control: with the lane free the same read comes from L2, headers read and
        # checked through the engine.
        dest, reg = _dest(engine)
        report, _ = _run(engine, [l2, l3], keys, dest, direct)
        assert report.installed == CHUNKS and report.sources == ["L2"] * CHUNKS, report
        assert report.direct == (CHUNKS if direct else 0), report
        assert _holds_state(dest)


class _OpenStalls:
    """Fault double of the engine: the real one, except that opening a record file
    blocks (a path lookup on a stalled drive) until released."""

    def __init__(self, engine: Engine) -> None:
        self._engine = engine
        self.released = threading.Event()
        self.hits = 0

    def open(self, path, *args, **kw):  # type: ignore[no-untyped-def]
        if str(path).endswith(".chunk"):
            self.hits += 1
            self.released.wait(60)
        return self._engine.open(path, *args, **kw)

    def __getattr__(self, name):  # type: ignore[no-untyped-def]
        return getattr(self._engine, name)


def test_a_stalled_open_is_a_read_error_at_the_deadline(tmp_path):
    """Before, the open ran on the window's thread with no limit (here: 60 s a chunk)."""
    root = tmp_path / "l2"
    with Engine(4, LAYOUT.chunk_bytes) as real:
        engine = _OpenStalls(real)
        l2 = SSDTier(root, None, engine, layout=LAYOUT)  # type: ignore[arg-type]
        fill_state(
            SSDTier(root, None, real, layout=LAYOUT), LAYOUT, LAYOUT.chunk_tokens * CHUNKS, seed=1
        )
        l3 = LowerTier(tmp_path / "l3", layout=LAYOUT)
        _, keys = fill_state(l3, LAYOUT, LAYOUT.chunk_tokens * CHUNKS, seed=1)
        dest, reg = _dest(real)
        got: list = []
        worker = threading.Thread(
            target=lambda: got.append(_run(engine, [l2, l3], keys, dest, False)),
            daemon=True,  # type: ignore[arg-type]
        )
        try:
            worker.start()
            worker.join(DEADLINE_S + 1.5)
            assert not worker.is_alive(), "the run still waits for an open (no deadline)"
            report, took = got[0]
            assert report.installed == CHUNKS and report.sources == ["L3"] * CHUNKS, report
            assert "open did not end" in report.fallbacks[0]["causes"][0], report.fallbacks
            assert engine.hits >= 1 and _holds_state(dest)
            assert l2.stats()["quarantined"] == 0
        finally:
            engine.released.set()
        worker.join(5)
        # Control: opens free again, the same read comes from L2.
        dest, reg = _dest(real)
        report, _ = _run(engine, [l2, l3], keys, dest, False)  # type: ignore[arg-type]
        assert report.installed == CHUNKS and report.sources == ["L2"] * CHUNKS, report
