"""The whole-plan baseline: what LMCache 0.5.6's synchronous retrieve does.

Every hit chunk of every tier is staged in L1 host memory first, and only then
installed, so peak staging equals the restored state. It exists to be measured
against BSR. Where LMCache would busy-wait for L1 room forever, this fails
cleanly with outcome "zero" and says how much L1 the hit needed.
"""

from __future__ import annotations

import time

import torch

from bsr_io._core import Engine
from bsr_io.discovery import Plan
from bsr_io.errors import ChunkError
from bsr_io.kvcache import Destination
from bsr_io.restore import COMPLETE, ZERO, RestoreResult


class L1Exhausted(Exception):
    """The hit does not fit in the L1 budget."""


class WholePlanRestorer:
    """Stages the whole hit in L1 (bounded by `l1_bytes`), then installs it."""

    def __init__(
        self, store, layout, *, l1_bytes: int, engine: Engine | None = None, reader=None
    ) -> None:
        if l1_bytes < 0:
            raise ValueError(f"l1_bytes must be >= 0, got {l1_bytes}")
        self.store = store
        self.layout = layout
        self.l1_bytes = l1_bytes
        # One slot is enough: each chunk is copied out of it into its own L1 buffer.
        self.engine = engine or Engine(1, layout.chunk_bytes)
        # reader(tier, key, out_uint8_tensor) -> None; default: through the engine.
        self.reader = reader or self._read_via_engine
        self.l1_peak_bytes = 0

    def _read_via_engine(self, tier, key, out: torch.Tensor) -> None:
        slot = tier.read_into(key, self.engine)
        try:
            out.copy_(torch.frombuffer(slot, dtype=torch.uint8, count=out.numel()))
        finally:
            del slot

    def restore(self, plan: Plan, dest: Destination) -> RestoreResult:
        t0 = time.perf_counter()
        n = plan.hit_chunks
        chunk = self.layout.chunk_bytes
        need = n * chunk
        result = RestoreResult(ZERO, 0, 0, n, l1_required_bytes=need)
        if n == 0:
            result.reason = plan.reason or "no reusable prefix"
            return result
        if need > self.l1_bytes:
            result.reason = (
                f"whole-plan needs {need} bytes of L1 to stage the hit, the budget is "
                f"{self.l1_bytes}"
            )
            return result
        tiers = list(self.store.tiers)
        staged: list[torch.Tensor] = []
        live = 0
        self.l1_peak_bytes = 0
        try:
            for i in range(n):
                buf = torch.empty(chunk, dtype=torch.uint8)
                live += chunk
                self.l1_peak_bytes = max(self.l1_peak_bytes, live)
                tier = tiers[plan.sources[i]]
                self.reader(tier, plan.keys[i], buf)
                staged.append(buf)
                result.source_tiers.append(tier.name)
                result.bytes_read[tier.name] = result.bytes_read.get(tier.name, 0) + chunk
            t_staged = time.perf_counter()
            for i, buf in enumerate(staged):
                dest.install(i, buf)
            dest.synchronize()
        except (ChunkError, OSError) as exc:
            result.reason = f"chunk {len(staged)} failed: {exc}"
            return result
        finally:
            staged.clear()
        t1 = time.perf_counter()
        result.outcome = COMPLETE
        result.committed_chunks = n
        result.committed_tokens = plan.hit_tokens
        result.rws_peak_bytes = self.l1_peak_bytes
        result.timings.update(
            {"stage_s": t_staged - t0, "install_s": t1 - t_staged, "total_s": t1 - t0}
        )
        return result
