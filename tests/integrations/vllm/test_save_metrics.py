"""Every window record a worker cuts in a step is counted, saved or skipped, with its
duration and an event line (issue 31, item 4). No engine: the real worker side over
vLLM's own planner and allocator (the tiny Gemma 3's groups), real files; the finish
saves and the failed-load log line are checked on a running server by
test_serve_soak.py.
"""

from __future__ import annotations

import json
import time

from step_records import STEP, gemma_worker, group_of

from bsr_io._core import NoFreeSlot
from bsr_io.integrations.vllm.config import ConnectorConfig
from bsr_io.integrations.vllm.layout import WINDOW
from bsr_io.integrations.vllm.metadata import BsrMetadata, RecordOrder, Transfer


def step_saves(group: int, request: str, hashes: range) -> BsrMetadata:
    """Window records of `group` at chunk boundaries 0.., two blocks each (blocks 1..)."""
    records = tuple(RecordOrder(group, c, h, (1 + 2 * c, 2 + 2 * c)) for c, h in enumerate(hashes))
    return BsrMetadata(step_saves=[Transfer(request, "tiny", records)])


def test_step_saves_are_counted_timed_and_logged_saved_or_skipped(tmp_path):
    events = tmp_path / "events.jsonl"
    cfg = ConnectorConfig(
        store_dir=str(tmp_path / "store"),
        chunk_tokens=256,
        events_path=str(events),
        step_save_budget_s=0.05,
    )
    worker = gemma_worker(cfg)
    window = group_of(worker, WINDOW)
    held = []
    try:
        worker.save_step(step_saves(window.index, "saved-1", range(100, 103)))
        deadline = time.monotonic() + 30
        while worker.metrics.snapshot().get(STEP % "saved", 0) < 3:
            assert time.monotonic() < deadline, worker.metrics.snapshot()
            time.sleep(0.05)
        # Every save slot held (a busy save lane): the next step's records are skipped.
        while True:
            try:
                held.append(worker.save_engine.lease())
            except NoFreeSlot:
                break
        worker.save_step(step_saves(window.index, "skipped-1", range(200, 202)))
        m = worker.metrics.snapshot()
        assert m[STEP % "saved"] == 3 and m[STEP % "skipped"] == 2, m
        assert m["bsr_io_vllm_save_seconds_count{kind=step}"] == 3, m
        assert worker.events.flush()  # written by the log's own thread
        lines = [json.loads(x) for x in events.read_text().splitlines()]
        steps = [(e["request_id"], e["outcome"]) for e in lines if e["kind"] == "step_save"]
        assert sorted(steps) == [("saved-1", "complete")] * 3 + [("skipped-1", "skipped")] * 2
        done = [e for e in lines if e["kind"] == "step_save" and e["outcome"] == "complete"]
        assert all(e["seconds"] >= 0 for e in done)
        # Each written cut says where its time went; the tier's write is within its
        # `seconds`, the slot and the copy outside it. A skipped cut has no phases.
        for e in done:
            assert set(e["phases"]) - {"pace"} == {"slot", "copy", "write"}, e
            assert 0 < e["phases"]["write"] <= e["seconds"], e
        assert not any("phases" in e for e in lines if e.get("outcome") == "skipped")
    finally:
        for slot in held:
            slot.release()
        worker.close()
