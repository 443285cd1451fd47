"""An idle engine with a write pending steps at a pace, not without pause (idle.py).

While a cut, a finish save or a hold is pending, the scheduler side keeps vLLM stepping
(`has_pending_push_work`) so that their reports arrive; unpaced, each empty step was
vLLM's 1 ms sleep plus a round trip to the workers, hundreds a second for the whole
write. The worker side is the real one (its job table, cut lane, save engine, SSD tier,
vLLM's own KV cache planner and allocation); the store is served through the kernel's
FUSE with each record's first write answered STALL_S late (tests/fuse_stall.py
`late_dir`): a real held write. The steps are driven as vLLM 0.32 drives an empty one
(`kv_connector_no_forward`: bind, `wait_for_save`, `get_finished`, the worker's
metadata; then the engine core's 1 ms sleep), with no engine.
"""

from __future__ import annotations

import os
import time
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch
from fuse_stall import late_dir

from bsr_io.integrations.vllm import kv_shapes
from bsr_io.integrations.vllm.config import ConnectorConfig
from bsr_io.integrations.vllm.idle import PACE_S, IdleReports
from bsr_io.integrations.vllm.layout import group_layouts
from bsr_io.integrations.vllm.metadata import (
    BsrMetadata,
    BsrWorkerMeta,
    Inventory,
    RecordOrder,
    Transfer,
)
from bsr_io.integrations.vllm.scheduler import SchedulerSide
from bsr_io.integrations.vllm.worker import WorkerSide
from bsr_lab.vllm.harness import scheduler_request, tokens

needs_fuse = pytest.mark.skipif(
    os.geteuid() != 0 or not os.path.exists("/dev/fuse"), reason="FUSE needs root and /dev/fuse"
)
CHUNK, BLOCK = 256, 16
STALL_S = 1.5  # each record's first write is answered this late
VLLM_SLEEP_S = 0.001  # vLLM's engine core between steps that computed nothing
ASKS = 200  # has_pending_push_work asks: three a step, for about 67 idle steps


def _worker(store: Path) -> tuple[WorkerSide, Any]:
    from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheGroupSpec

    spec = FullAttentionSpec(block_size=BLOCK, num_kv_heads=1, head_size=64, dtype=torch.bfloat16)
    layers = [f"model.layers.{i}.self_attn.attn" for i in range(2)]
    plan = kv_shapes.plan([KVCacheGroupSpec(layers, spec)], 4 * CHUNK // BLOCK + 1, "LBHNC")
    (g,) = groups = group_layouts(plan, CHUNK)
    cfg = ConnectorConfig(store_dir=str(store), chunk_tokens=CHUNK, window=1)
    w = WorkerSide(cfg, groups, 4 * CHUNK // BLOCK + 1, 0, 1, model="m")
    w.register(kv_shapes.allocate(plan))
    return w, g


def _cut(w: WorkerSide, g: Any, rid: str, chunk_hash: int) -> None:
    """A step with a forward that completes one record: the worker cuts it (its write
    is then held in the kernel)."""
    ids = tuple(range(1, 1 + g.record_blocks))
    meta = BsrMetadata(step_saves=[Transfer(rid, "m", (RecordOrder(g.index, 0, chunk_hash, ids),))])
    w.submit(meta)
    w.save_step(meta)


def _reported(w: WorkerSide, chunk_hash: int) -> bool:
    inv = w.worker_meta().inventory[0]
    return any(chunk_hash in hashes for hashes in inv.added.values())


def _idle_steps(w: WorkerSide, idle: IdleReports, rid: str, chunk_hash: int) -> dict[str, int]:
    """Empty steps, as vLLM takes them while the cut's report is owed, until it comes:
    how many, and how many began after its job ended and still did not report it."""
    (job,) = w.jobs.jobs_of(rid)
    steps = late = 0
    while True:
        ended_before = job.over.is_set()
        meta = BsrMetadata(idle=True)
        w.submit(meta)  # bind_connector_metadata
        idle.submitted(meta)
        w.save_step(meta)  # wait_for_save
        idle.results(w, set())  # get_finished
        steps += 1
        if _reported(w, chunk_hash):  # build_connector_worker_meta
            return {"steps": steps, "late": late}
        late += ended_before
        assert steps < 100_000, "the cut's record was never reported"
        time.sleep(VLLM_SLEEP_S)


@needs_fuse
def test_an_idle_engine_paces_its_steps_while_a_write_is_held(tmp_path: Path) -> None:
    """During a write held STALL_S, the paced idle steps are far fewer than the unpaced
    ones counted beside them (the control: the same worker, store and stall, `pace_s`
    0), at most one per PACE_S and one per job change; and the record's report still
    rides the step in which its write ended (no step that began after it lacked it).
    Fails with the pacing removed (the counts match: 1286 against 1259)."""
    store = tmp_path / "store"
    store.mkdir()
    with late_dir(store, STALL_S, ["write"], ".tmp", per_file=True, log=tmp_path / "held") as late:
        w, g = _worker(store)
        try:
            _cut(w, g, "control", 101)
            unpaced = _idle_steps(w, IdleReports(pace_s=0.0), "control", 101)
            _cut(w, g, "paced", 102)
            paced = _idle_steps(w, IdleReports(), "paced", 102)
        finally:
            w.close()
        held = late.held()
    assert len(held) == 2 and all(s > 0 for *_, s in held), held  # both writes were held
    print("idle steps during a held write:", {"paced": paced, "unpaced": unpaced})
    assert paced["late"] == 0 and unpaced["late"] == 0, (paced, unpaced)
    # The paced count's bound is the stall's length in PACE_S steps; the control's is set
    # by how fast this machine steps: at 1 ms sleeps it is several times that.
    assert paced["steps"] * 4 < unpaced["steps"], (paced, unpaced, STALL_S / PACE_S)


@needs_fuse
def test_a_step_waits_for_the_next_job_change_not_its_bound(tmp_path: Path) -> None:
    """Event-driven: with a pace far longer than the held write (60 s; the bound below is
    20 times the stall), each idle step returns at the cut's next change (its record
    copied into a slot, then its write's end), so its report comes in two steps (three
    if the copy came before the first step began), within the stall. A step with
    nothing pending never waits. Fails with a wait not woken by the job table."""
    store = tmp_path / "store"
    store.mkdir()
    with late_dir(store, STALL_S, ["write"], ".tmp", per_file=True):
        w, g = _worker(store)
        try:
            idle = IdleReports(pace_s=60.0)
            meta = BsrMetadata(idle=True)
            w.submit(meta)
            idle.submitted(meta)
            idle.results(w, set())  # nothing pending: no wait (else 60 s here)
            _cut(w, g, "r", 7)
            t0 = time.monotonic()
            got = _idle_steps(w, idle, "r", 7)
            took = time.monotonic() - t0
        finally:
            w.close()
    assert took < 20 * STALL_S, f"the idle steps sat out their pace ({took:.1f} s, {got})"
    assert got["steps"] <= 3 and got["late"] == 0, got


def test_asking_for_pending_work_does_not_settle_every_cut_each_time(tmp_path: Path) -> None:
    """vLLM asks `has_pending_push_work` about three times a step, and an idle engine
    steps up to 1 / PACE_S times a second: the real scheduler side with a prompt's cuts
    in flight looks its catalog up for them at most once in `_SETTLE_S` there, while
    each step's output (where their reports arrive) still settles them every time.
    Counted on the real catalog's `holds` (a counting wrapper, no double). Fails with
    the settling back in every call (ASKS times the cuts)."""
    groups = group_layouts(kv_shapes.gemma3(), CHUNK)
    cfg = ConnectorConfig(store_dir=str(tmp_path), chunk_tokens=CHUNK, save_in_steps=True)
    side = SchedulerSide(cfg, groups, "m", 1)
    toks = tokens(3, 8 * CHUNK + 10)
    side.get_num_new_matched_tokens(scheduler_request("a", toks), 0)
    blocks = tuple(list(range(100 * (g.index + 1), 100 * (g.index + 1) + 40)) for g in groups)
    meta = side.build_connector_meta(
        SimpleNamespace(
            scheduled_new_reqs=[SimpleNamespace(req_id="a", num_computed_tokens=0)],
            scheduled_cached_reqs=SimpleNamespace(req_ids=[], num_computed_tokens=[]),
            num_scheduled_tokens={"a": len(toks)},
            kv_connector_block_state=SimpleNamespace(get_block_ids=lambda r: blocks),
        )
    )
    cuts = sum(len(t.records) for t in meta.step_saves)
    assert cuts >= 8, meta.step_saves
    looks = 0
    holds = side.catalog.holds

    def counted(*a: Any) -> bool:
        nonlocal looks
        looks += 1
        return holds(*a)

    side.catalog.holds = counted  # type: ignore[method-assign,assignment]
    side.update_connector_output(
        SimpleNamespace(
            kv_connector_worker_meta=BsrWorkerMeta({0: Inventory(1, synced=True)}, ranks={0}),
            finished_recving=None,
            failed_recving=set(),
        )
    )
    assert looks == cuts  # a step's output settles every cut in flight
    looks = 0
    for _ in range(ASKS):
        assert side.has_pending_push_work()  # the cuts are still in flight
    # Settled per ask, it looks ASKS * cuts times; throttled, once per _SETTLE_S (the
    # asks take milliseconds): a tenth of that leaves a loaded machine 2 s for them.
    assert looks * 10 <= ASKS * cuts, f"{looks} catalog looks for {cuts} cuts in {ASKS} asks"
