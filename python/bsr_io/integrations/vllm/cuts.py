"""Step cuts: records copied out of vLLM's blocks in the step that completed them.

Two kinds, by how long their blocks stay theirs:
- Window-group records: vLLM frees and reuses a window's blocks from the next step on,
  so they are cut here, on the forward thread in `wait_for_save`, waiting at most
  `step_save_budget_s` per step for save slots (past it a record is skipped: a future
  miss, counted).
- Full-group records (`save_in_steps`): their blocks stay the request's until it
  finishes or is preempted, so the forward only queues them; a writer thread cuts and
  writes each one. The scheduler side names the requests whose blocks vLLM released
  since the last step (`BsrMetadata.released`), and `release` runs before that step's
  forward can reuse them: it waits, within the step budget, for the request's queued
  cuts to copy their bytes, then closes the request's `Guard`. A cut still waiting
  after that is skipped, never read from blocks another request now owns. A request
  vLLM finished while a cut of it was still unreported is `held` instead: vLLM keeps
  its blocks until this rank names it in finished_sending, once its cuts have copied
  (or the hold's own bound passed: `hold_s`, two writes' deadlines, deadlines.py; its
  cuts still waiting then are skipped and counted), so a writer held up behind a
  stalled write loses no record, and a stalled drive keeps no finished request's blocks
  longer than that. Preemption has no such hold in vLLM: a preempted request is
  released. A queued cut waits at most `hold_s` for a save slot too.

A cut record goes to one of W writers, which write it crash-safe and checksummed
through the save tier; a finished request's save waits for its cuts' writes first. On a
CPU worker the writers copy and write while a forward runs (gate.py). On a GPU worker
`wait_for_save` runs once the step's kernels are enqueued, not done: every cut's copy
waits for an event recorded there on the forward's stream (save/fence.py).

A request vLLM finished with no finish save gets one `step_saves_done` event per rank
once each of its cuts has ended (written, skipped or failed), with their counts: the
request-level end of its saves that a finish save's own event gives otherwise.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Iterable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from bsr_io._core import Slot
from bsr_io.engine import give_back, lease
from bsr_io.errors import EngineBusy
from bsr_io.integrations.vllm.blocks import Abandoned, Guard
from bsr_io.integrations.vllm.layout import FULL
from bsr_io.integrations.vllm.metadata import BsrMetadata, Cut, RecordOrder, Transfer, cut_of
from bsr_io.integrations.vllm.metrics import FAILED, SAVED, SKIPPED
from bsr_io.load.records import COMPLETE, ZERO
from bsr_io.save.fence import StepFence, extract_after
from bsr_io.save.records import PhaseClock

if TYPE_CHECKING:
    from bsr_io.integrations.vllm.worker import WorkerSide

log = logging.getLogger("bsr_io.vllm")


@dataclass
class _Tally:
    """One request's cuts on this rank, until its `step_saves_done` event."""

    pending: int = 0  # cuts queued or being written
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
    def __init__(self, worker: WorkerSide, initializer: Callable[[], None] | None) -> None:
        self.w = worker
        self.cfg = worker.cfg
        self._lock = threading.Lock()
        self._skipped = 0  # records not saved (no slot in budget, released first, an error)
        self._lost_cuts: list[Cut] = []  # cuts ended with no record
        self._writers = ThreadPoolExecutor(
            self.cfg.window, thread_name_prefix=f"bsr-w{worker.rank}", initializer=initializer
        )
        self._writing: dict[str, list[Future[None]]] = {}  # request -> its cuts' writes
        self._guards: dict[str, Guard] = {}  # request -> guard of its queued full cuts
        self._copied: dict[str, list[threading.Event]] = {}  # request -> its cuts' copies
        self._tallies: dict[str, _Tally] = {}  # request -> its cuts' outcomes so far
        self._holding: dict[str, tuple[float, float]] = {}  # held request -> (start, end)

    # -- on the forward thread ---------------------------------------------------------
    def cut(self, meta: BsrMetadata, fence: StepFence) -> None:
        """This step's records (wait_for_save): window records now, full ones queued.
        Every copy is ordered after the step's writes to its blocks (`fence`, fence.py)."""
        if not meta.step_saves or self.w.pages is None:
            return
        budget_end = time.monotonic() + self.cfg.step_save_budget_s
        for t in meta.step_saves:
            with self._lock:  # every rank tallies the request, records of its own or not
                self._tallies.setdefault(t.request_id, _Tally())
            for r in t.records:
                if not self.w.mine(r):
                    continue
                try:
                    if self.w.groups[r.group].kind == FULL:
                        self._queue(t, r, fence)
                    else:
                        self._cut_now(t, r, budget_end, fence)
                except Exception as exc:  # noqa: BLE001 - saves are best effort
                    # A save that fails here must not fail vLLM's forward: the record
                    # is a future miss, counted and logged.
                    log.warning("bsr-io: rank %d: step save failed: %s", self.w.rank, exc)
                    self._lost(t, r, FAILED, str(exc))

    def release(self, request_ids: Iterable[str]) -> None:
        """Before a step's forward (start_load_kv): vLLM may hand these requests' blocks
        to others in it. No cut of theirs reads them from now on."""
        deadline = time.monotonic() + self.cfg.step_save_budget_s
        for rid in request_ids:
            with self._lock:
                guard = self._guards.pop(rid, None)
                copied = self._copied.pop(rid, [])
            if guard is None:
                continue
            for ev in copied:
                ev.wait(max(0.0, deadline - time.monotonic()))
            guard.close()  # waits for a copy in progress; a later one is Abandoned

    def hold(self, request_ids: Iterable[str], timeout_s: float) -> None:
        """vLLM keeps these finished requests' blocks until `held_done` names them."""
        now = time.monotonic()
        with self._lock:
            for rid in request_ids:
                self._holding[rid] = (now, now + timeout_s)

    def held_done(self) -> set[str]:
        """Held requests none of whose cuts needs their blocks any more: every one has
        copied its bytes or ended, or the hold's deadline passed (the rest end skipped).
        Their guards are closed: vLLM may free the blocks."""
        now = time.monotonic()
        done: list[tuple[str, float, bool, Guard | None]] = []
        with self._lock:
            for rid, (start, end) in list(self._holding.items()):
                copied = all(e.is_set() for e in self._copied.get(rid, ()))
                if now < end and not copied:
                    continue
                del self._holding[rid]
                self._copied.pop(rid, None)
                done.append((rid, now - start, copied, self._guards.pop(rid, None)))
        for rid, seconds, copied, guard in done:
            if guard is not None:
                guard.close()  # waits for a copy in progress; a later one is Abandoned
            self.w.event(
                None,
                {
                    "kind": "hold",
                    "request_id": rid,
                    "outcome": COMPLETE if copied else ZERO,
                    "reason": "" if copied else "the hold's bound passed with cuts not copied",
                    "seconds": seconds,
                },
            )
        return {rid for rid, *_ in done}

    def _cut_now(self, t: Transfer, r: RecordOrder, budget_end: float, fence: StepFence) -> None:
        clock = PhaseClock({})
        try:
            with clock("slot"):
                slot = lease(self.w.save_engine, budget_end)
        except EngineBusy:
            self._lost(t, r, SKIPPED, "no save slot within the step budget")
            return
        with clock("copy"):
            self._extract(t, r, slot, Guard(), fence)
        try:
            fut = self._writers.submit(self._write, t, r, slot, clock)
        except BaseException:  # the writers are shut down: the caller counts it failed
            give_back(slot)
            raise
        self._track(t.request_id, fut)

    def _queue(self, t: Transfer, r: RecordOrder, fence: StepFence) -> None:
        copied = threading.Event()
        with self._lock:
            guard = self._guards.setdefault(t.request_id, Guard())
            self._copied.setdefault(t.request_id, []).append(copied)
        try:
            fut = self._writers.submit(self._cut_later, t, r, guard, copied, fence)
        except BaseException:  # the writers are shut down: the caller counts it failed
            copied.set()  # nothing will copy: a release need not wait for it
            raise
        self._track(t.request_id, fut)

    def _track(self, request_id: str, fut: Future[None]) -> None:
        with self._lock:
            self._writing.setdefault(request_id, []).append(fut)
            self._tallies.setdefault(request_id, _Tally()).pending += 1
        fut.add_done_callback(lambda _: self._settled(request_id))

    # -- on a writer thread ------------------------------------------------------------
    def _cut_later(
        self,
        t: Transfer,
        r: RecordOrder,
        guard: Guard,
        copied: threading.Event,
        fence: StepFence,
    ) -> None:
        clock = PhaseClock({})
        try:
            try:
                with clock("pace"):
                    self.w.gate.wait()  # the copy, while a forward runs (gate.py)
                with clock("slot"):
                    slot = lease(self.w.save_engine, time.monotonic() + self.w.deadlines.hold_s)
            except EngineBusy:
                self._lost(t, r, SKIPPED, "no save slot within the hold's bound")
                return
            except Exception as exc:  # noqa: BLE001 - counted: a cut never vanishes
                log.warning("bsr-io: rank %d: step save got no slot: %s", self.w.rank, exc)
                self._lost(t, r, FAILED, f"leasing a save slot failed: {exc}")
                return
            try:
                with clock("copy"):
                    self._extract(t, r, slot, guard, fence)
            except Abandoned:
                self._lost(t, r, SKIPPED, "its blocks were released before its cut")
                return
            except Exception as exc:  # noqa: BLE001 - a failed cut is a future miss
                log.warning("bsr-io: rank %d: step save failed: %s", self.w.rank, exc)
                self._lost(t, r, FAILED, str(exc))
                return
        finally:
            copied.set()
        self._write(t, r, slot, clock)

    def _extract(
        self, t: Transfer, r: RecordOrder, slot: Slot, guard: Guard, fence: StepFence
    ) -> None:
        """Copy record `r` out of its blocks into `slot` (given back on failure), after
        the step that wrote them (`fence`)."""
        try:
            dest = self.w.dest(t, [r], guard)
            extract_after(fence, dest, 0, slot, self.w.groups[r.group].record_bytes)
        except BaseException:
            give_back(slot)
            raise

    def _write(self, t: Transfer, r: RecordOrder, slot: Slot, clock: PhaseClock) -> None:
        t0 = time.monotonic()
        error: Exception | None = None
        key = None
        try:
            key, g = self.w.key(t, r), self.w.groups[r.group]
            with clock("pace"):
                self.w.gate.wait()  # the write too
            t0 = time.monotonic()
            with clock("write"):
                self.w.save_tier.write(key, slot, g.record)
            self.w.note_saved(key)
        except Exception as exc:  # noqa: BLE001 - a failed save is a future miss
            error = exc
        finally:
            give_back(slot)  # before the outcome: a save counted holds no slot any more
        seconds = time.monotonic() - t0
        if error is None:
            self._outcome(t.request_id, SAVED, seconds, "", clock.phases)
        else:
            log.warning("bsr-io: save of %s failed: %s", key.short() if key else r, error)
            with self._lock:
                self._lost_cuts.append(cut_of(t.key_model, r))
            self._outcome(t.request_id, FAILED, seconds, str(error), clock.phases)

    # -- bookkeeping ---------------------------------------------------------------------
    def _lost(self, t: Transfer, r: RecordOrder, outcome: str, why: str) -> None:
        with self._lock:
            self._skipped += 1
            self._lost_cuts.append(cut_of(t.key_model, r))
        self._outcome(t.request_id, outcome, None, why)

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

    def _settled(self, request_id: str) -> None:
        """A cut's future ended (its outcome already tallied)."""
        with self._lock:
            tally = self._tallies.get(request_id)
            if tally is None:
                return
            tally.pending -= 1
            if not (tally.finished and tally.pending == 0):
                return
            del self._tallies[request_id]
        self._report(request_id, tally)

    def _report(self, request_id: str, t: _Tally) -> None:
        lost = t.skipped + t.failed
        why = f"{t.skipped} skipped, {t.failed} failed" if lost else ""
        self.w.event(
            None,
            {
                "kind": "step_saves_done",
                "request_id": request_id,
                "outcome": ZERO if lost else COMPLETE,
                "reason": why,
                "records": t.written + lost,
                "written": t.written,
                "skipped": t.skipped,
                "failed": t.failed,
            },
        )

    def _outcome(
        self,
        request_id: str,
        outcome: str,
        seconds: float | None,
        why: str,
        phases: dict[str, float] | None = None,
    ) -> None:
        """A record cut in a step: written, skipped or failed (counted, logged). A written
        or failed one says where its time went (`phases`, seconds): waits for a forward
        (`pace`), for a slot, the copy out of its blocks, the tier's write."""
        self.w.save_metrics.step(outcome, seconds)
        with self._lock:
            tally = self._tallies.get(request_id)
            if tally is not None:
                tally.count(outcome)
        fields: dict[str, Any] = {"kind": "step_save", "request_id": request_id}
        fields |= {"outcome": COMPLETE if outcome == SAVED else outcome, "reason": why}
        if seconds is not None:
            fields["seconds"] = seconds
        if phases is not None:
            fields["phases"] = phases
        self.w.event(None, fields)

    def writes_of(self, request_id: str) -> list[Future[None]]:
        """The request's cuts still being written (its finish save waits for them)."""
        with self._lock:
            return self._writing.pop(request_id, [])

    def reap(self) -> None:
        with self._lock:
            for rid in [r for r, fs in self._writing.items() if all(f.done() for f in fs)]:
                del self._writing[rid]  # written, and no finished-request save waits on them

    def take_lost(self) -> tuple[int, list[Cut]]:
        """Records skipped since the last report, and the cuts that ended unwritten."""
        with self._lock:
            skipped, self._skipped = self._skipped, 0
            lost, self._lost_cuts = self._lost_cuts, []
        return skipped, lost

    def close(self) -> None:
        with self._lock:
            guards = list(self._guards.values())
            self._guards.clear()
            self._copied.clear()
            self._holding.clear()
        for guard in guards:
            guard.close()  # queued cuts end Abandoned: nothing reads blocks past close
        self._writers.shutdown(wait=True)
