"""Full-attention records cut in steps (`save_in_steps`) are copied out by the writers,
not by vLLM's forward thread, and never from blocks vLLM has handed to another request.

Measured before this (`bsr-lab bench serve --save-in-steps`): cutting on the forward
thread, one torch copy per page, cost each miss about 25 ms of TTFT; the copies and
their GIL handoffs to the writers were the cost. No engine: the real worker side over
vLLM's own planner and allocator (the tiny Gemma 3's groups), real files.
"""

from __future__ import annotations

import json
import math
import time
from pathlib import Path
from typing import Any

from fuse_stall import late_dir
from step_records import STEP, expected, fill, gemma_worker, group_of, stored, wait_for

from bsr_io._core import NoFreeSlot
from bsr_io.integrations.vllm import cuts
from bsr_io.integrations.vllm.config import ConnectorConfig
from bsr_io.integrations.vllm.deadlines import LIMIT_ENV
from bsr_io.integrations.vllm.layout import FULL
from bsr_io.integrations.vllm.metadata import BsrMetadata, RecordOrder, Transfer
from bsr_io.integrations.vllm.worker import WorkerSide

BUDGET_S = 0.2


def _logged_worker(tmp_path: Path, **settings: Any) -> WorkerSide:
    """A worker storing under tmp_path/store, its events in tmp_path/events.jsonl."""
    cfg = ConnectorConfig(
        store_dir=str(tmp_path / "store"),
        chunk_tokens=256,
        step_save_budget_s=BUDGET_S,
        events_path=str(tmp_path / "events.jsonl"),
        **settings,
    )
    return gemma_worker(cfg)


def _all_slots(worker) -> list:
    held = []
    while True:
        try:
            held.append(worker.save_engine.lease())
        except NoFreeSlot:
            return held


def test_a_released_request_is_never_cut_from_its_reused_blocks(tmp_path):
    store = tmp_path / "store"
    worker = _logged_worker(tmp_path)
    full = group_of(worker, FULL)
    held = []
    try:
        fill(worker, 1)

        # The control: a running request's record, cut by a writer, holds its blocks'
        # bytes (gathered in one call; compared with the per-page copy).
        kept = Transfer("kept", "tiny", (RecordOrder(full.index, 0, 100, (1, 2)),))
        want = expected(worker, kept)
        worker.save_step(BsrMetadata(step_saves=[kept]))
        wait_for(worker, "saved", 1)
        assert stored(store) == [want]

        # Every save slot busy: the forward queues the cut and goes on; it does not wait.
        held = _all_slots(worker)
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
        # The scheduler side hears that this cut ended unwritten (and not the written
        # one's): a lookup waiting for it stops waiting (scheduler.py).
        assert worker.worker_meta().lost_cuts == [("tiny", full.index, 101)]
        worker.jobs.close()  # every queued cut has ended
        assert worker.metrics.snapshot().get(STEP % "saved") == 1
        assert stored(store) == [want]  # nothing of "gone", from old blocks or new
    finally:
        for slot in held:
            slot.release()
        worker.close()


def _done(worker: WorkerSide, events: Path) -> dict[str, dict]:
    """request -> its `step_saves_done` line (each request at most one)."""
    assert worker.events.flush()  # lines are written by the event log's thread
    lines = [json.loads(x) for x in events.read_text().splitlines()] if events.exists() else []
    got = [e for e in lines if e["kind"] == "step_saves_done"]
    assert len({e["request_id"] for e in got}) == len(got), got
    return {e["request_id"]: e for e in got}


def test_a_finished_request_says_when_its_cuts_have_all_ended(tmp_path):
    """Records cut in steps have no finish save, so the request's save has no end of its
    own: a `step_saves_done` line per rank says when its last cut ended and how."""
    events = tmp_path / "events.jsonl"
    worker = _logged_worker(tmp_path)
    full = group_of(worker, FULL)
    held = []
    try:
        fill(worker, 1)

        def order(rid: str, chunk: int, blocks: tuple[int, int]) -> Transfer:
            return Transfer(rid, "tiny", (RecordOrder(full.index, chunk, 100 + chunk, blocks),))

        # Written, but vLLM has not finished the request: nothing to say yet.
        worker.save_step(BsrMetadata(step_saves=[order("a", 0, (1, 2)), order("b", 1, (3, 4))]))
        wait_for(worker, "saved", 2)
        worker.submit(BsrMetadata())
        worker.results(set())
        assert _done(worker, events) == {}
        # "a" finished with no finish save: its line, every cut written. "b" finished
        # with one in the same step: that save's own event is its end, not this line.
        worker.submit(BsrMetadata(released={"a", "b"}, finish_saves=[Transfer("b", "tiny", ())]))
        worker.results({"a", "b"})
        got = _done(worker, events)
        assert set(got) == {"a"}, got
        assert got["a"]["outcome"] == "complete" and got["a"]["written"] == 1, got

        # "c"'s cut waits for a slot when vLLM finishes it: its line waits for the cut.
        held = _all_slots(worker)
        worker.save_step(BsrMetadata(step_saves=[order("c", 2, (5, 6))]))
        worker.submit(BsrMetadata(released={"c"}))  # its blocks are no longer its own
        worker.results({"c"})
        assert "c" not in _done(worker, events)  # still queued: not ended
        for slot in held:
            slot.release()
        held.clear()
        wait_for(worker, "skipped", 1)
        deadline = time.monotonic() + 10
        while "c" not in _done(worker, events):
            assert time.monotonic() < deadline, events.read_text()
            time.sleep(0.02)
        c = _done(worker, events)["c"]
        assert (c["outcome"], c["written"], c["skipped"]) == ("zero", 0, 1), c
        assert "1 skipped" in c["reason"], c
    finally:
        for slot in held:
            slot.release()
        worker.close()


def _lines(worker: WorkerSide, events: Path, kind: str) -> list[dict]:
    assert worker.events.flush()
    return [e for e in map(json.loads, events.read_text().splitlines()) if e["kind"] == kind]


def _sending(worker, rid: str, within: float) -> float:
    """Seconds until a step's results name `rid` in finished_sending (vLLM frees its
    blocks then), stepping as an idle engine with a request awaiting that does."""
    t0 = time.monotonic()
    while True:
        worker.submit(BsrMetadata())
        if rid in worker.results(set())[0]:
            return time.monotonic() - t0
        assert time.monotonic() - t0 < within, f"{rid} never named"
        time.sleep(0.02)


def test_a_held_request_keeps_its_blocks_until_its_cut_has_copied(tmp_path):
    """vLLM finished the request while its cut still waited for a save slot (a writer
    held up behind a stalled write: in one CI run a 0.64 s write cost 5 of 24 records
    at TP=2). The scheduler side held its blocks (`held`), so the cut is written long
    past the step budget, and the request is named in finished_sending only once the
    cut has its bytes. The control is the first test's released request: the same wait
    ends skipped."""
    store, events = tmp_path / "store", tmp_path / "events.jsonl"
    worker = _logged_worker(tmp_path)
    # This test holds every slot itself: the rule that ends a hold whose slots are all
    # held by writes (test_jobs.py) would end it at once; here, the hold's other ends.
    worker.jobs.starved_s = math.inf
    full = group_of(worker, FULL)
    held = []
    try:
        fill(worker, 1)
        t = Transfer("h", "tiny", (RecordOrder(full.index, 0, 100, (1, 2)),))
        want = expected(worker, t)
        held = _all_slots(worker)
        worker.save_step(BsrMetadata(step_saves=[t]))
        worker.submit(BsrMetadata(held={"h"}))
        assert "h" not in worker.results({"h"})[0]  # not copied: vLLM keeps the blocks
        time.sleep(2 * BUDGET_S)  # a released request's cut would be skipped by now
        worker.submit(BsrMetadata())
        assert "h" not in worker.results(set())[0]
        for slot in held:
            slot.release()
        held.clear()
        _sending(worker, "h", 10)
        fill(worker, 2)  # only now may vLLM hand the blocks to another request
        wait_for(worker, "saved", 1)
        assert stored(store) == [want]
        h = _done(worker, events)["h"]
        assert (h["outcome"], h["written"], h["skipped"]) == ("complete", 1, 0), h
        assert worker.metrics.snapshot().get(STEP % "skipped", 0) == 0
        hold = _lines(worker, events, "hold")
        assert [(e["request_id"], e["outcome"]) for e in hold] == [("h", "complete")], hold
        assert hold[0]["seconds"] >= 2 * BUDGET_S, hold
        # A request with no cut on this rank (or all copied) is named at once.
        worker.submit(BsrMetadata(held={"none"}))
        assert "none" in worker.results({"none"})[0]
    finally:
        for slot in held:
            slot.release()
        worker.close()


def test_a_hold_ends_at_its_short_bound(tmp_path, monkeypatch):
    """No slot frees while the request is held: it is named once the hold's own bound
    passed (two writes' deadlines, from vLLM's step limit: deadlines.py), far below
    `save_timeout_s` (a stalled drive may not keep every finishing request's blocks for
    a save's deadline), not after each of its queued cuts has waited in turn (vLLM must
    get its blocks back), and its cuts end skipped, never read from them after."""
    store, events = tmp_path / "store", tmp_path / "events.jsonl"
    monkeypatch.setenv(LIMIT_ENV, "10")  # one write 1 s, a hold 2 s
    save_timeout, window = 60.0, 2
    worker = _logged_worker(tmp_path, window=window, save_timeout_s=save_timeout)
    hold = worker.deadlines.hold_s
    assert (hold, worker.ssd.write_timeout_s) == (2.0, 1.0)
    worker.jobs.starved_s = math.inf  # the hold's own bound, not the all-slots-held rule
    full = group_of(worker, FULL)
    held = []
    n = 4 * window  # four writers' turns, each waiting out a slot's bound
    try:
        fill(worker, 1)
        held = _all_slots(worker)
        records = tuple(
            RecordOrder(full.index, c, 100 + c, (2 * c + 1, 2 * c + 2)) for c in range(n)
        )
        worker.save_step(BsrMetadata(step_saves=[Transfer("h", "tiny", records)]))
        worker.submit(BsrMetadata(held={"h"}))
        assert "h" not in worker.results({"h"})[0]
        waited = _sending(worker, "h", save_timeout / 2)
        assert hold * 0.8 <= waited < 2.5 * hold, waited  # not n / window bounds
        fill(worker, 2)  # the blocks are another request's now
        for slot in held:
            slot.release()
        held.clear()
        wait_for(worker, "skipped", n)
        worker.jobs.close()
        assert stored(store) == []
        h = _done(worker, events)["h"]
        assert (h["outcome"], h["skipped"]) == ("zero", n), h
        holds = _lines(worker, events, "hold")
        assert [(e["request_id"], e["outcome"]) for e in holds] == [("h", "zero")], holds
    finally:
        for slot in held:
            slot.release()
        worker.close()


def test_a_cut_whose_lease_raises_is_counted_failed(tmp_path, monkeypatch):
    """A lease that raises anything but EngineBusy (here a fault double: an OSError, as
    a broken engine would) ends the cut failed: the request's `step_saves_done` says 1
    failed, not complete with 0 records, and the scheduler hears the cut was lost."""
    events = tmp_path / "events.jsonl"
    worker = _logged_worker(tmp_path)
    full = group_of(worker, FULL)

    def broken_lease(engine, deadline):  # fault double: the engine fails the lease
        raise OSError(5, "fault double: the save engine failed the lease")

    monkeypatch.setattr(cuts, "lease", broken_lease)
    try:
        fill(worker, 1)
        t = Transfer("f", "tiny", (RecordOrder(full.index, 0, 100, (1, 2)),))
        worker.save_step(BsrMetadata(step_saves=[t]))
        worker.submit(BsrMetadata(released={"f"}))
        worker.results({"f"})
        deadline = time.monotonic() + 10
        while "f" not in _done(worker, events):
            assert time.monotonic() < deadline, events.read_text()
            time.sleep(0.02)
        f = _done(worker, events)["f"]
        assert (f["outcome"], f["records"], f["written"], f["failed"]) == ("zero", 1, 0, 1), f
        assert "1 failed" in f["reason"], f
        assert worker.worker_meta().lost_cuts == [("tiny", full.index, 100)]
    finally:
        worker.close()


def test_a_cut_whose_write_outlasts_its_deadline_is_reported_with_that_reason(
    tmp_path, monkeypatch
):
    """A cut's write the kernel still holds at the tier's deadline (a real stall: the
    store served through FUSE, its temp files' writes answered late, tests/fuse_stall.py).
    Under load a cut ended with "the slot has a write in flight" and no phases: its
    writer's give-back of the slot, refused while the write was in flight, replaced the
    real error. Now the cut ends failed with its own reason and its phases, its slot
    comes back only once the stalled write ends, and nothing is stored."""
    store, events = tmp_path / "store", tmp_path / "events.jsonl"
    monkeypatch.setenv(LIMIT_ENV, "10")  # one write 1 s
    window = 2
    worker = _logged_worker(tmp_path, window=window)
    full = group_of(worker, FULL)
    engine = worker.save_engine
    try:
        fill(worker, 1)
        with late_dir(store, 60.0, ["write"], ".tmp") as late:
            t = Transfer("w", "tiny", (RecordOrder(full.index, 0, 100, (1, 2)),))
            worker.save_step(BsrMetadata(step_saves=[t]))
            wait_for(worker, "failed", 1)
            (cut,) = _lines(worker, events, "step_save")
            assert cut["outcome"] == "failed", cut
            assert "the write of" in cut["reason"] and "did not end within" in cut["reason"], cut
            assert cut["phases"]["write"] > 0, cut
            assert engine.free_slots() == window - 1  # the kernel may still read it
            late.release()
            deadline = time.monotonic() + 10
            while engine.free_slots() < window:
                assert time.monotonic() < deadline, "the slot never came back"
                time.sleep(0.02)
        assert stored(store) == []
        assert worker.worker_meta().lost_cuts == [("tiny", full.index, 100)]
    finally:
        worker.close()


def test_event_lines_leave_the_calling_thread_whole_and_a_late_line_still_lands(tmp_path):
    """`events_path` lines are queued by the thread that ends a job (vLLM's forward
    thread, often) and written by the log's own thread, which keeps the file open; lines
    from many threads arrive whole and each once, and a line from a lane that ends after
    `close` still lands, through a file opened for it alone (nothing left open)."""
    import os
    import threading

    events = tmp_path / "events.jsonl"
    worker = _logged_worker(tmp_path)
    caller = threading.get_ident()

    def lines(tag: str) -> None:
        for i in range(200):
            worker.event(None, {"kind": "probe", "tag": tag, "i": i, "pad": "x" * 300})

    threads = [threading.Thread(target=lines, args=(t,)) for t in "abcd"]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert worker.events.flush()
    writer = next(t for t in threading.enumerate() if t.name == "bsr-events")
    assert writer.ident != caller
    fds = len(os.listdir("/proc/self/fd"))
    worker.close()
    assert not writer.is_alive()
    worker.event(None, {"kind": "probe", "tag": "late", "i": 0})
    assert len(os.listdir("/proc/self/fd")) < fds  # the log's file closed, none reopened
    got = [json.loads(x) for x in events.read_text().splitlines()]  # no torn or mixed line
    probes = [e for e in got if e["kind"] == "probe"]
    assert sorted((e["tag"], e["i"]) for e in probes if e["tag"] != "late") == sorted(
        (t, i) for t in "abcd" for i in range(200)
    )
    assert probes[-1]["tag"] == "late"
