"""Full-attention records cut in steps (`save_in_steps`) are copied out by the writers,
not by vLLM's forward thread, and never from blocks vLLM has handed to another request.

Measured before this (`bsr-lab bench serve --save-in-steps`): cutting on the forward
thread, one torch copy per page, cost each miss about 25 ms of TTFT; the copies and
their GIL handoffs to the writers were the cost. No engine: the real worker side over
vLLM's own planner and allocator (the tiny Gemma 3's groups), real files.
"""

from __future__ import annotations

import time

from step_records import STEP, expected, fill, stored, wait_for

from bsr_io._core import NoFreeSlot
from bsr_io.integrations.vllm import kv_shapes
from bsr_io.integrations.vllm.config import ConnectorConfig
from bsr_io.integrations.vllm.layout import FULL, group_layouts
from bsr_io.integrations.vllm.metadata import BsrMetadata, RecordOrder, Transfer
from bsr_io.integrations.vllm.worker import WorkerSide

BUDGET_S = 0.2


def test_a_released_request_is_never_cut_from_its_reused_blocks(tmp_path):
    store = tmp_path / "store"
    cfg = ConnectorConfig(store_dir=str(store), chunk_tokens=256, step_save_budget_s=BUDGET_S)
    groups = group_layouts(kv_shapes.gemma3(), 256)
    full = next(g for g in groups if g.kind == FULL)
    worker = WorkerSide(cfg, groups, 24, rank=0, world_size=1, model="tiny")
    held = []
    try:
        worker.register(kv_shapes.allocate(kv_shapes.gemma3()))
        fill(worker, 1)

        # The control: a running request's record, cut by a writer, holds its blocks'
        # bytes (gathered in one call; compared with the per-page copy).
        kept = Transfer("kept", "tiny", (RecordOrder(full.index, 0, 100, (1, 2)),))
        want = expected(worker, kept)
        worker.save_step(BsrMetadata(step_saves=[kept]))
        wait_for(worker, "saved", 1)
        assert stored(store) == [want]

        # Every save slot busy: the forward queues the cut and goes on; it does not wait.
        while True:
            try:
                held.append(worker.save_engine.lease())
            except NoFreeSlot:
                break
        gone = Transfer("gone", "tiny", (RecordOrder(full.index, 1, 101, (3, 4)),))
        t0 = time.monotonic()
        worker.save_step(BsrMetadata(step_saves=[gone]))
        assert time.monotonic() - t0 < BUDGET_S / 2
        # vLLM finished it: before the next forward, the cut waits at most the budget.
        t0 = time.monotonic()
        worker.submit(BsrMetadata(released={"gone"}))
        assert time.monotonic() - t0 < BUDGET_S + 0.5
        fill(worker, 2)  # another request's forward writes those blocks now
        for slot in held:
            slot.release()
        held.clear()
        wait_for(worker, "skipped", 1)
        worker.cuts.close()  # every queued cut has ended
        assert worker.metrics.snapshot().get(STEP % "saved") == 1
        assert stored(store) == [want]  # nothing of "gone", from old blocks or new
    finally:
        for slot in held:
            slot.release()
        worker.close()
