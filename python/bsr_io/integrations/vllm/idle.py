"""An idle step reports the loads it submitted as soon as they end (for a bounded time).

vLLM 0.32 learns that a load ended from the workers' `get_finished` at the end of a
step, and schedules the request's forward only in the step after it learned. An engine
with nothing else to do steps with nothing to compute: the step that submits a load
polls it right after `start_load_kv`, before any read could end, so the load was
reported a step later, and the forward came two steps after the load was sent (an empty
step costs vLLM's 1 ms sleep plus a round trip to every worker: 2 to 4 ms on this
loaded machine). In a step that computes nothing, each worker now waits for the loads
that step submitted, at most `IDLE_WAIT_S`, before it reports: a small load ends inside
it, and its request's forward runs in the next step, the protocol's floor. A step with a
forward never waits: its loads run while it computes. The price: a request that arrives
while an idle engine waits is scheduled up to `IDLE_WAIT_S` later.
"""

from __future__ import annotations

import time
from typing import Any

from bsr_io.integrations.vllm.metadata import BsrMetadata

IDLE_WAIT_S = 0.01  # a few-chunk load's read on a busy machine, well under a forward step
POLL_S = 0.0002


class IdleReports:
    """The loads an idle step submitted, waited for in that step's `get_finished`."""

    def __init__(self, wait_s: float = IDLE_WAIT_S) -> None:
        self.wait_s = wait_s
        self._loads: set[str] = set()

    def submitted(self, meta: BsrMetadata) -> None:
        """Submitted (connector.py `_submit`): the step's loads, kept only when the step
        computes nothing."""
        self._loads = {t.request_id for t in meta.loads} if meta.idle else set()

    def results(
        self, worker: Any, finished: set[str] | None
    ) -> tuple[set[str], set[str], set[str]]:
        """The worker's (finished_sending, finished_recving, failed_recving), once the
        idle step's loads ended or `wait_s` passed."""
        sending, recving, failed = worker.results(finished)
        waiting, self._loads = self._loads - recving, set()
        end = time.monotonic() + self.wait_s
        while waiting and time.monotonic() < end:
            time.sleep(POLL_S)
            s, r, f = worker.jobs.poll()
            sending, recving, failed = sending | s, recving | r, failed | f
            waiting -= r
        return sending, recving, failed
