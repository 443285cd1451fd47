"""Full-attention records cut in the step that completes them (`save_in_steps`): a
finished request then has nothing left to save, and vLLM frees its blocks at once.

Measured with `bsr-lab bench serve` before this: the finish save kept a finished
request's blocks a step longer, and at saturation the request queued for them waited
that step (TTFT p50 of misses +24%). The real scheduler side, fed as vLLM feeds it (the
scheduler output's block state, `request_finished`); the groups are the tiny Gemma 3's
from vLLM's own planner.
"""

from __future__ import annotations

import time
from types import SimpleNamespace
from typing import Any

import pytest

from bsr_io.integrations.vllm import kv_shapes, scheduler
from bsr_io.integrations.vllm.config import ConnectorConfig
from bsr_io.integrations.vllm.identity import key_model
from bsr_io.integrations.vllm.layout import FULL, group_layouts
from bsr_io.integrations.vllm.metadata import BsrHandshake, BsrWorkerMeta, Inventory
from bsr_io.integrations.vllm.scheduler import SchedulerSide
from bsr_io.model.keys import prefix_hashes
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
    # The workers report the cuts written (the step after, as a rule) before it finishes.
    _report(side, added=[(r.group, r.chunk_hash) for t in meta.step_saves for r in t.records])
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


def test_a_request_finished_before_its_cuts_are_reported_keeps_its_blocks(tmp_path):
    """A cut is known to have its bytes only from the workers' report; a request vLLM
    finishes before that (one token long, or a writer held up behind a stalled write:
    a CI run lost 5 of 24 records so, 0.64 s into one write) is held: vLLM keeps its
    blocks until the workers name it in finished_sending (cuts.py). The control: the
    same request with its cuts reported frees them at once."""
    groups = group_layouts(kv_shapes.gemma3(), CHUNK)
    cfg = ConnectorConfig(store_dir=str(tmp_path), chunk_tokens=CHUNK, save_in_steps=True)
    side = SchedulerSide(cfg, groups, "m", 1)
    blocks = tuple(list(range(100 * (g.index + 1), 100 * (g.index + 1) + 8)) for g in groups)
    full = next(g for g in groups if g.kind == FULL)

    def prefill(rid: str, seed: int, report: str) -> Any:
        toks = tokens(seed, 3 * CHUNK + 10)
        req = scheduler_request(rid, toks)
        side.get_num_new_matched_tokens(req, 0)
        meta = side.build_connector_meta(prefill_step(rid, len(toks), blocks))
        cuts = [(r.group, r.chunk_hash) for t in meta.step_saves for r in t.records]
        if report == "written":
            _report(side, added=cuts)
        elif report == "lost":  # a cut that ended unwritten needs no blocks either
            kept = [c for c in cuts if c[0] != full.index]
            lost = [(key_model("m"), gi, h) for gi, h in cuts if gi == full.index]
            _report(side, added=kept, lost=lost)
        elif report == "some":  # chunk 2's full record still in flight
            _report(side, added=[c for c in cuts if c != (full.index, cuts[-1][1])])
        req.num_computed_tokens = len(toks)
        return req

    reqs = [prefill(*a) for a in [("a", 3, "none"), ("b", 4, "some"), ("c", 5, "written")]]
    reqs.append(prefill("d", 6, "lost"))
    finished = [side.request_finished(r, blocks) for r in reqs]
    assert finished == [(True, None), (True, None), (False, None), (False, None)]
    step = prefill_step("e", 0, tuple([] for _ in groups))
    step.finished_req_ids = {"a", "b", "c", "d"}
    meta = side.build_connector_meta(step)
    assert meta.held == {"a", "b"}
    assert meta.released == {"c", "d"}  # the held ones' cuts are not cut short
    assert not meta.finish_saves  # nothing left to save: the hold waits for copies only
    step.finished_req_ids = set()
    assert side.build_connector_meta(step).held == set()  # named once


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


def _report(side: SchedulerSide, added=(), lost=()) -> None:
    """One step's worker report, as vLLM hands it over: records written (group, chunk
    hash) and cuts that ended unwritten (key model, group, chunk hash)."""
    km = key_model("m")
    inv = Inventory(1)
    for gi, h in added:
        for ns in side.dirs(km, side.groups_by_index[gi]):
            inv.added.setdefault(ns, []).append(h)
    meta = BsrWorkerMeta({0: inv}, ranks={0}, lost_cuts=list(lost))
    side.update_connector_output(
        SimpleNamespace(kv_connector_worker_meta=meta, finished_recving=None, failed_recving=set())
    )


def test_a_lookup_waits_for_cuts_in_flight_not_for_their_next_step(tmp_path, monkeypatch):
    """A record cut in a step is known here only from the workers' report after its write,
    which on an idle engine comes with the next request's first step: that request waits
    ("ask again", vLLM steps meanwhile) rather than restore a prefix cut short. Found by
    the two-node test: a repeat right after the saves restored 8 of its 10 chunks."""
    groups = group_layouts(kv_shapes.gemma3(), CHUNK)
    cfg = ConnectorConfig(store_dir=str(tmp_path), chunk_tokens=CHUNK, save_in_steps=True)
    side = SchedulerSide(cfg, groups, "m", 1)
    toks = tokens(3, 3 * CHUNK + 10)
    hashes = prefix_hashes(toks, CHUNK)
    blocks = tuple(list(range(100 * (g.index + 1), 100 * (g.index + 1) + 8)) for g in groups)
    assert side.get_num_new_matched_tokens(scheduler_request("a", toks), 0) == (0, False)
    side.build_connector_meta(prefill_step("a", len(toks), blocks))  # cuts chunks 0-2

    # The control: a prompt that shares nothing with the cuts does not wait.
    other = scheduler_request("c", tokens(4, 3 * CHUNK + 10))
    assert side.get_num_new_matched_tokens(other, 0) == (0, False)
    # The repeat waits while the cuts are in flight...
    repeat = scheduler_request("b", toks)
    assert side.get_num_new_matched_tokens(repeat, 0) == (None, False)
    _report(side, added=[(g.index, h) for g in groups for h in hashes[:2]])
    assert side.get_num_new_matched_tokens(repeat, 0) == (None, False)  # chunk 2 still cut
    # ...and is served all three chunks once the last one is reported.
    _report(side, added=[(g.index, hashes[2]) for g in groups])
    assert side.get_num_new_matched_tokens(repeat, 0) == (3 * CHUNK, True)

    # A cut reported lost ends the wait at once: the hit stops before it.
    toks = tokens(5, 3 * CHUNK + 10)
    hashes = prefix_hashes(toks, CHUNK)
    side.get_num_new_matched_tokens(scheduler_request("d", toks), 0)
    side.build_connector_meta(prefill_step("d", len(toks), blocks))
    full = next(g for g in groups if g.kind == FULL)
    _report(
        side,
        added=[(g.index, hashes[0]) for g in groups],
        lost=[(key_model("m"), full.index, hashes[1])],
    )
    repeat = scheduler_request("e", toks)
    assert side.get_num_new_matched_tokens(repeat, 0) == (CHUNK, True)

    # A cut whose report never comes (a worker gone): the wait is bounded.
    monkeypatch.setattr(scheduler, "_CUT_WAIT_S", 0.05)
    toks = tokens(6, 3 * CHUNK + 10)
    side.get_num_new_matched_tokens(scheduler_request("f", toks), 0)
    side.build_connector_meta(prefill_step("f", len(toks), blocks))
    repeat = scheduler_request("g", toks)
    assert side.get_num_new_matched_tokens(repeat, 0) == (None, False)
    time.sleep(0.06)
    assert side.get_num_new_matched_tokens(repeat, 0) == (0, False)


def _step_output(side: SchedulerSide, added=(), sending=(), synced=True) -> None:
    """One idle step's output, as vLLM hands it over: rank 0's report of records written
    (group, chunk hash), and the requests every worker named in finished_sending."""
    km = key_model("m")
    inv = Inventory(1, synced=synced)
    for gi, h in added:
        for ns in side.dirs(km, side.groups_by_index[gi]):
            inv.added.setdefault(ns, []).append(h)
    side.update_connector_output(
        SimpleNamespace(
            kv_connector_worker_meta=BsrWorkerMeta({0: inv}, ranks={0}),
            finished_sending=set(sending),
            finished_recving=None,
            failed_recving=set(),
        )
    )


def test_an_idle_engine_steps_until_the_hold_and_its_cuts_are_reported(tmp_path):
    """The last request finishes with a cut in flight: vLLM keeps its blocks (a hold), and
    the scheduler side asks vLLM to keep stepping (`has_pending_push_work`) until the
    workers named it in finished_sending and reported its cuts written, so the next
    request finds them in the catalog; then no more. While held, its blocks come back
    without a preemption (`has_pending_block_frees`). A start listing still being
    reported keeps it stepping too."""
    groups = group_layouts(kv_shapes.gemma3(), CHUNK)
    cfg = ConnectorConfig(store_dir=str(tmp_path), chunk_tokens=CHUNK, save_in_steps=True)
    side = SchedulerSide(cfg, groups, "m", 1)
    side.handshake({0: BsrHandshake(0, Inventory(1, synced=False))})
    assert side.has_pending_push_work()  # rank 0's start listing is still coming
    _step_output(side)
    assert not side.has_pending_push_work()  # the control: an idle engine may sleep

    toks = tokens(3, 3 * CHUNK + 10)
    req = scheduler_request("a", toks)
    side.get_num_new_matched_tokens(req, 0)
    blocks = tuple(list(range(100 * (g.index + 1), 100 * (g.index + 1) + 8)) for g in groups)
    meta = side.build_connector_meta(prefill_step("a", len(toks), blocks))
    cuts = [(r.group, r.chunk_hash) for t in meta.step_saves for r in t.records]
    req.num_computed_tokens = len(toks)
    assert side.request_finished(req, blocks) == (True, None)  # held
    step = prefill_step("b", 0, tuple([] for _ in groups))
    step.finished_req_ids = {"a"}
    assert side.build_connector_meta(step).held == {"a"}
    assert side.has_pending_push_work() and side.has_pending_block_frees()

    _step_output(side)  # an idle step: nothing reported yet
    assert side.has_pending_push_work() and side.has_pending_block_frees()
    _step_output(side, sending={"a"})  # its cuts copied: vLLM frees the blocks...
    assert not side.has_pending_block_frees()
    assert side.has_pending_push_work()  # ...but their records are not reported yet
    _step_output(side, added=cuts)
    assert not side.has_pending_push_work()


def test_an_unreported_hold_stops_the_stepping_at_its_bound(tmp_path):
    """A hold whose report never comes (a worker gone) keeps the engine stepping no
    longer than twice its bound (two writes' deadlines of a 0.5 s step limit here)."""
    groups = group_layouts(kv_shapes.gemma3(), CHUNK)
    cfg = ConnectorConfig(
        store_dir=str(tmp_path), chunk_tokens=CHUNK, save_in_steps=True, vllm_limit_s=0.5
    )
    side = SchedulerSide(cfg, groups, "m", 1)
    toks = tokens(3, 3 * CHUNK + 10)
    req = scheduler_request("a", toks)
    side.get_num_new_matched_tokens(req, 0)
    blocks = tuple(list(range(100 * (g.index + 1), 100 * (g.index + 1) + 8)) for g in groups)
    side.build_connector_meta(prefill_step("a", len(toks), blocks))
    req.num_computed_tokens = len(toks)
    assert side.request_finished(req, blocks) == (True, None)
    assert side.has_pending_block_frees()
    time.sleep(2 * cfg.deadlines.cut_s + 0.05)  # past the hold's and the cuts' bounds
    assert not side.has_pending_block_frees()
    assert not side.has_pending_push_work()
