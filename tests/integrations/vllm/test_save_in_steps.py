"""Full-attention records cut in the step that completes them (`save_in_steps`): a
finished request then has nothing left to save, and vLLM frees its blocks at once.

Measured with `bsr-lab bench serve` before this: the finish save kept a finished
request's blocks a step longer, and at saturation the request queued for them waited
that step (TTFT p50 of misses +24%). The real scheduler side, fed as vLLM feeds it (the
scheduler output's block state, `request_finished`); the groups are the tiny Gemma 3's
from vLLM's own planner.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from bsr_io.integrations.vllm import kv_shapes
from bsr_io.integrations.vllm.config import ConnectorConfig
from bsr_io.integrations.vllm.layout import FULL, group_layouts
from bsr_io.integrations.vllm.scheduler import SchedulerSide
from bsr_lab.vllm.harness import scheduler_request, tokens

CHUNK = 256


def prefill_step(rid: str, n: int, block_ids: tuple[list[int], ...]) -> SimpleNamespace:
    """A step that computes a new request's first `n` tokens."""
    return SimpleNamespace(
        scheduled_new_reqs=[SimpleNamespace(req_id=rid, num_computed_tokens=0)],
        scheduled_cached_reqs=SimpleNamespace(req_ids=[], num_computed_tokens=[]),
        num_scheduled_tokens={rid: n},
        kv_connector_block_state=SimpleNamespace(get_block_ids=lambda r: block_ids),
    )


@pytest.mark.parametrize("in_steps", [True, False])
def test_full_records_saved_in_the_step_free_the_blocks_at_finish(tmp_path, in_steps):
    groups = group_layouts(kv_shapes.gemma3(), CHUNK)
    full = next(g for g in groups if g.kind == FULL)
    cfg = ConnectorConfig(store_dir=str(tmp_path), chunk_tokens=CHUNK, save_in_steps=in_steps)
    side = SchedulerSide(cfg, groups, "m", 1)
    toks = tokens(3, 3 * CHUNK + 10)
    req = scheduler_request("a", toks)
    assert side.get_num_new_matched_tokens(req, 0) == (0, False)  # an empty store
    blocks = tuple(list(range(100 * (g.index + 1), 100 * (g.index + 1) + 8)) for g in groups)

    meta = side.build_connector_meta(prefill_step("a", len(toks), blocks))
    cut = {(r.group, r.chunk) for t in meta.step_saves for r in t.records}
    req.num_computed_tokens = len(toks)
    delay, _ = side.request_finished(req, blocks)
    finish = side.build_connector_meta(prefill_step("b", 0, blocks)).finish_saves

    full_chunks = {(full.index, c) for c in range(3)}
    if in_steps:
        assert full_chunks <= cut  # every whole chunk, in the step that computed it
        assert not delay and not finish  # nothing left: the blocks go back at once
    else:  # the control: read at finish, vLLM keeping the blocks until it is done
        assert not full_chunks & cut
        assert delay
        assert {(r.group, r.chunk) for t in finish for r in t.records} == full_chunks


def test_finished_and_preempted_requests_are_named_to_the_workers(tmp_path):
    """The workers stop cutting from blocks vLLM freed (cuts.py): the scheduler side
    names both kinds of release, as vLLM's scheduler output lists them."""
    groups = group_layouts(kv_shapes.gemma3(), CHUNK)
    cfg = ConnectorConfig(store_dir=str(tmp_path), chunk_tokens=CHUNK, save_in_steps=True)
    side = SchedulerSide(cfg, groups, "m", 1)
    step = prefill_step("c", 0, tuple([] for _ in groups))
    step.finished_req_ids, step.preempted_req_ids = {"a"}, {"b"}
    assert side.build_connector_meta(step).released == {"a", "b"}
    step.finished_req_ids, step.preempted_req_ids = set(), None  # vLLM's default
    assert side.build_connector_meta(step).released == set()
