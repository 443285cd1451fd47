"""Step cuts: records copied out of vLLM's blocks in the step that completed them.

Each cut is one record and one job of the worker's job table (jobs.py), due
`Deadlines.cut_s` from its order (a slot within `hold_s`, then one write's deadline), run
by one of W writer threads (the table's `cut` lane), which copy it out of its blocks and
write it crash-safe and checksummed through the save tier. Two kinds, by how long their
blocks stay theirs:
- Window-group records: vLLM frees and reuses a window's blocks from the next step on,
  so they are copied here, on the forward thread in `wait_for_save`, waiting at most
  `step_save_budget_s` per step for save slots (past it a record is skipped: a future
  miss, counted); the job, past its copy from the start, only writes.
- Full-group records (`save_in_steps`): their blocks stay the request's until it
  finishes or is preempted, so the forward only queues them and a writer copies them.
  What happens to those blocks is the table's: a request vLLM released has its cuts'
  guards closed once they copied or the step budget ran out (`release`), a finished one
  is held until they copied or the hold's bound passed (`hold`); a cut closed out ends
  skipped, never read from blocks another request now owns.

On a CPU worker the writers copy and write while a forward runs (gate.py). On a GPU
worker `wait_for_save` runs once the step's kernels are enqueued, not done: every cut's
copy waits for an event recorded there on the forward's stream (save/fence.py).

Every cut ends counted, through the table's `on_end`: written, skipped (no slot, its
blocks released, never started) or failed; each unwritten one is a lost cut the
scheduler side hears of. A request vLLM finished with no finish save gets one
`step_saves_done` event per rank once each of its cuts has ended, with their counts: the
request-level end of its saves that a finish save's own event gives otherwise.

Cuts see their worker only through a `CutContext`: no import of the worker.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

from bsr_io._core import Engine, Slot
from bsr_io.engine import give_back, lease
from bsr_io.errors import EngineBusy
from bsr_io.integrations.vllm.blocks import Abandoned, Guard, RequestPages
from bsr_io.integrations.vllm.deadlines import Deadlines
from bsr_io.integrations.vllm.gate import ForwardGate
from bsr_io.integrations.vllm.jobs import Details, Job, JobTable
from bsr_io.integrations.vllm.layout import FULL, GroupLayout
from bsr_io.integrations.vllm.metadata import BsrMetadata, Cut, RecordOrder, Transfer, cut_of
from bsr_io.integrations.vllm.metrics import FAILED, SAVED, SKIPPED, SaveMetrics
from bsr_io.load.records import COMPLETE, ZERO
from bsr_io.model.keys import ChunkKey
from bsr_io.save.fence import StepFence, extract_after
from bsr_io.save.records import PhaseClock

log = logging.getLogger("bsr_io.vllm")


@dataclass(frozen=True)
class CutContext:
    """What a cut needs of its worker, and nothing more."""

    rank: int
    groups: Mapping[int, GroupLayout]
    destination: Callable[[Transfer, list[RecordOrder], Guard], RequestPages]
    key: Callable[[Transfer, RecordOrder], ChunkKey]
    tier: Any  # the save tier: write(key, slot, record layout)
    saved: Callable[[ChunkKey], None]  # a record written (the inventory hears of it)
    engine: Engine  # the save engine: its slots
    gate: ForwardGate
    event: Callable[[dict[str, Any]], None]  # the event log
    metrics: SaveMetrics
    deadlines: Deadlines
    budget_s: float  # step_save_budget_s: a window cut's wait for a slot, per step

    def mine(self, r: RecordOrder) -> bool:
        """Whether this rank writes record `r` (a replicated group: rank 0 only)."""
        return not self.groups[r.group].replicated or self.rank == 0


@dataclass
class _Order:
    """A cut job's payload: the step's fence, and its slot once the record is copied."""

    fence: StepFence
    slot_by: float  # time.monotonic(): the wait for a slot ends here (`hold_s`)
    slot: Slot | None = None
    clock: PhaseClock = field(default_factory=lambda: PhaseClock({}))


@dataclass
class _Tally:
    """One request's cuts on this rank, until its `step_saves_done` event."""

    pending: int = 0  # cuts not yet ended
    written: int = 0
    skipped: int = 0
    failed: int = 0
    finished: bool = False  # vLLM finished the request: report once nothing is pending

    def count(self, outcome: str) -> None:
        if outcome == SAVED:
            self.written += 1
        elif outcome == SKIPPED:
            self.skipped += 1
        else:
            self.failed += 1


class StepCuts:
    def __init__(self, ctx: CutContext, jobs: JobTable, writers: int) -> None:
        self.ctx = ctx
        self.jobs = jobs
        self._lock = threading.Lock()
        self._skipped = 0  # cuts that ended before a write (no slot, released, an error)
        self._lost_cuts: list[Cut] = []  # cuts ended with no record
        self._tallies: dict[str, _Tally] = {}  # request -> its cuts' outcomes so far
        jobs.add_lane("cut", self._run, width=writers, on_end=self._ended)

    # -- on the forward thread ---------------------------------------------------------
    def cut(self, meta: BsrMetadata, fence: StepFence) -> None:
        """This step's records (wait_for_save): window records copied now, full ones
        queued. Every copy is ordered after the step's writes to its blocks (`fence`)."""
        budget_end = time.monotonic() + self.ctx.budget_s
        for t in meta.step_saves:
            with self._lock:  # every rank tallies the request, records of its own or not
                self._tallies.setdefault(t.request_id, _Tally())
            for r in t.records:
                if not self.ctx.mine(r):
                    continue
                one = Transfer(t.request_id, t.key_model, (r,))
                with self._lock:
                    self._tallies[t.request_id].pending += 1
                try:
                    if self.ctx.groups[r.group].kind == FULL:
                        self._submit(one, _Order(fence, time.monotonic() + self.hold_s))
                    else:
                        self._cut_now(one, budget_end, fence)
                except Exception as exc:  # noqa: BLE001 - saves are best effort
                    # A save that fails here must not fail vLLM's forward: the record
                    # is a future miss, counted and logged.
                    log.warning("bsr-io: rank %d: step save failed: %s", self.ctx.rank, exc)
                    self.jobs.end_at_once("cut", one, str(exc), {"outcome": FAILED})

    @property
    def hold_s(self) -> float:
        return self.ctx.deadlines.hold_s

    def _submit(self, t: Transfer, order: _Order, copied: bool = False) -> None:
        self.jobs.submit("cut", t, self.ctx.deadlines.cut_s, payload=order, copied=copied)

    def _cut_now(self, t: Transfer, budget_end: float, fence: StepFence) -> None:
        order = _Order(fence, budget_end)
        try:
            with order.clock("slot"):
                order.slot = lease(self.ctx.engine, budget_end)
        except EngineBusy:
            reason = "no save slot within the step budget"
            self.jobs.end_at_once("cut", t, reason, {"outcome": SKIPPED})
            return
        with order.clock("copy"):
            self._extract(t, order.slot, Guard(), fence)
        self._submit(t, order, copied=True)

    # -- on a writer thread ------------------------------------------------------------
    def _run(self, job: Job) -> tuple[bool, str, Details]:
        order: _Order | None = job.take()
        if order is None:  # given up on as it started: its end counted it
            return False, "given up", {}
        if order.slot is None:
            failed = self._copy(job, order)
            if failed is not None:
                return failed  # its end (the table's) puts it past its copy
            self.jobs.copied(job)  # its blocks may go: the record is in the slot
        return self._write(job, order)

    def _copy(self, job: Job, order: _Order) -> tuple[bool, str, Details] | None:
        """Lease a slot and copy the record into it; None when it is there."""
        try:
            with order.clock("pace"):
                self.ctx.gate.wait()  # the copy, while a forward runs (gate.py)
            with order.clock("slot"):
                slot = lease(self.ctx.engine, order.slot_by)
        except EngineBusy:
            return False, "no save slot within the hold's bound", {"outcome": SKIPPED}
        except Exception as exc:  # noqa: BLE001 - counted: a cut never vanishes
            log.warning("bsr-io: rank %d: step save got no slot: %s", self.ctx.rank, exc)
            return False, f"leasing a save slot failed: {exc}", {"outcome": FAILED}
        try:
            with order.clock("copy"):
                self._extract(job.transfer, slot, job.guard, order.fence)
        except Abandoned:
            return False, "its blocks were released before its cut", {"outcome": SKIPPED}
        except Exception as exc:  # noqa: BLE001 - a failed cut is a future miss
            log.warning("bsr-io: rank %d: step save failed: %s", self.ctx.rank, exc)
            return False, str(exc), {"outcome": FAILED}
        order.slot = slot
        return None

    def _extract(self, t: Transfer, slot: Slot, guard: Guard, fence: StepFence) -> None:
        """Copy the record out of its blocks into `slot` (given back on failure), after
        the step that wrote them (`fence`)."""
        r = t.records[0]
        try:
            dest = self.ctx.destination(t, [r], guard)
            extract_after(fence, dest, 0, slot, self.ctx.groups[r.group].record_bytes)
        except BaseException:
            give_back(slot)
            raise

    def _write(self, job: Job, order: _Order) -> tuple[bool, str, Details]:
        assert order.slot is not None
        t, r, clock = job.transfer, job.transfer.records[0], order.clock
        t0 = time.monotonic()
        error: Exception | None = None
        key = None
        try:
            key, g = self.ctx.key(t, r), self.ctx.groups[r.group]
            with clock("pace"):
                self.ctx.gate.wait()  # the write too
            t0 = time.monotonic()
            with clock("write"):
                self.ctx.tier.write(key, order.slot, g.record)
            self.ctx.saved(key)
        except Exception as exc:  # noqa: BLE001 - a failed save is a future miss
            error = exc
        finally:
            give_back(order.slot)  # before the outcome: a save counted holds no slot
        details = {"seconds": time.monotonic() - t0, "phases": clock.phases, "wrote": True}
        if error is None:
            return True, "", details | {"outcome": SAVED}
        log.warning("bsr-io: save of %s failed: %s", key.short() if key else r, error)
        return False, str(error), details | {"outcome": FAILED}

    # -- bookkeeping (the table's on_end for cuts: any thread) ------------------------
    def _ended(self, job: Job, details: Details) -> None:
        """A cut ended: written, skipped or failed (counted, logged). A written or failed
        write says where its time went (`phases`, seconds): waits for a forward
        (`pace`), for a slot, the copy out of its blocks, the tier's write."""
        order: _Order | None = job.take()
        if order is not None and order.slot is not None:
            give_back(order.slot)  # copied on the forward thread, never written
        outcome = details.get("outcome") or (SKIPPED if job.started is None else FAILED)
        t = job.transfer
        if outcome != SAVED:
            with self._lock:
                if not details.get("wrote"):
                    self._skipped += 1
                self._lost_cuts.append(cut_of(t.key_model, t.records[0]))
        seconds = details.get("seconds")
        self.ctx.metrics.step(outcome, seconds)
        fields: dict[str, Any] = {"kind": "step_save", "request_id": job.request_id}
        fields |= {"outcome": COMPLETE if outcome == SAVED else outcome, "reason": job.reason}
        if seconds is not None:
            fields["seconds"] = seconds
        if "phases" in details:
            fields["phases"] = details["phases"]
        self.ctx.event(fields)
        with self._lock:
            tally = self._tallies.get(job.request_id)
            if tally is None:
                return
            tally.count(outcome)
            tally.pending -= 1
            if not (tally.finished and tally.pending == 0):
                return
            del self._tallies[job.request_id]
        self._report(job.request_id, tally)

    def finished(self, request_ids: Iterable[str], with_finish_save: set[str]) -> None:
        """vLLM finished these requests (on the forward thread, after the step). One
        with a finish save has that save's event, which waits for its cuts; another's
        `step_saves_done` comes when its last cut ends."""
        done = []
        with self._lock:
            for rid in request_ids:
                tally = self._tallies.get(rid)
                if tally is None:
                    continue
                if rid in with_finish_save:
                    del self._tallies[rid]
                    continue
                tally.finished = True
                if tally.pending == 0:
                    done.append((rid, self._tallies.pop(rid)))
        for rid, tally in done:
            self._report(rid, tally)

    def _report(self, request_id: str, t: _Tally) -> None:
        lost = t.skipped + t.failed
        self.ctx.event(
            {
                "kind": "step_saves_done",
                "request_id": request_id,
                "outcome": ZERO if lost else COMPLETE,
                "reason": f"{t.skipped} skipped, {t.failed} failed" if lost else "",
                "records": t.written + lost,
                "written": t.written,
                "skipped": t.skipped,
                "failed": t.failed,
            }
        )

    def take_lost(self) -> tuple[int, list[Cut]]:
        """Records skipped since the last report, and the cuts that ended unwritten."""
        with self._lock:
            skipped, self._skipped = self._skipped, 0
            lost, self._lost_cuts = self._lost_cuts, []
        return skipped, lost
