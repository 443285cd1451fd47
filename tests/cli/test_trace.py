"""Request traces: the engine's I/O thread stamps each request; `bench ssd --trace`
summarises the engine's and fio's runs the same way (bsr_lab/trace.py)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from bsr_io._core import Engine
from bsr_io.cli.fio import fio_available, fio_read
from bsr_lab.cli import main
from bsr_lab.trace import engine_summary, fio_summary

KiB = 1 << 10


def _read_all(eng: Engine, path: Path, size: int) -> None:
    f = eng.open(path)
    pending = []
    for off in range(0, size, eng.slot_bytes):
        if len(pending) == eng.window:
            pending.pop(0).wait().release()
        pending.append(eng.submit_read(f, off, eng.slot_bytes))
    for p in pending:
        p.wait().release()
    f.close()


def _traced(tmp_path: Path, window: int) -> dict:
    size = 4 << 20
    path = tmp_path / "data"
    path.write_bytes(bytes(range(256)) * (size // 256))
    try:
        eng = Engine(window, 256 * KiB, queue_depth=8, request_bytes=64 * KiB, backend="io_uring")
    except OSError as exc:
        pytest.skip(f"io_uring refused here: {exc}")
    with eng:
        eng.trace_start()
        _read_all(eng, path, size)
        events = eng.trace_take()
        assert eng.trace_take() == [], "taking the trace stops it"
    assert len(events) == size // (64 * KiB)
    assert sorted(e[0] for e in events) == list(range(0, size, 64 * KiB))
    return engine_summary(events, queue_depth=8)


def test_a_window_smaller_than_the_queue_shows_as_a_short_queue(tmp_path: Path) -> None:
    # W=1 slot of 4 requests under a queue depth of 8: never more than 4 in flight, and
    # every moment short of the depth has nothing queued (the consumer's slot is all).
    narrow = _traced(tmp_path, window=1)
    assert narrow["depth_at_submit"]["max"] <= 4
    assert narrow["time_full"] == 0.0
    assert narrow["time_short_nothing_queued"] > 0.5
    # Control, same file and queue: 8 slots of 4 requests fill the queue.
    wide = _traced(tmp_path, window=8)
    assert wide["depth_at_submit"]["max"] == 8
    assert wide["time_full"] > 0.0
    for s in (narrow, wide):
        total = s["time_full"] + s["time_short_nothing_queued"] + s["time_short_requests_queued"]
        assert total == pytest.approx(1.0, abs=1e-6)


def test_the_pread_pool_refuses_to_trace() -> None:
    with Engine(1, 4096, backend="pread") as eng, pytest.raises(ValueError, match="io_uring"):
        eng.trace_start()


@pytest.mark.skipif(not fio_available(), reason="fio not installed")
def test_fio_trace_counts_every_io(tmp_path: Path) -> None:
    (tmp_path / "f").write_bytes(b"\1" * (8 << 20))
    r = fio_read(tmp_path / "f", block_bytes=1 << 20, iodepth=4, lat_log=fio_summary)
    assert r.trace is not None and r.trace["requests"] == 8
    assert 0 < r.trace["mean_depth"] <= 4 + 1  # +-1 ms of fio's log resolution
    assert not list(tmp_path.glob("*.log")), "the latency logs are removed"


def test_bench_ssd_trace_and_random_order(tmp_path: Path) -> None:
    out = tmp_path / "ssd.json"
    argv = ["bench", "ssd", "--size", "8MiB", "--window", "2", "--slot", "1MiB", "--trace"]
    argv += ["--dir", str(tmp_path), "--json", str(out), "--rounds", "3", "--seed", "3"]
    assert main(argv) == 0
    rep = json.loads(out.read_text())
    assert rep["seed"] == 3 and len(rep["orders"]) == 3
    assert all(sorted(o) == sorted(rep["orders"][0]) for o in rep["orders"])
    assert len(rep["load_snapshots"]) == 4  # before the first round and after each
    assert rep["load"]["loadavg_1m_max"] >= rep["load"]["loadavg_1m_min"]
    if rep["backend"] == "io_uring":
        assert [t["requests"] for t in rep["trace"]["bsr_io"]] == [8, 8, 8]
