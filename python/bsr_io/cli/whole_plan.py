"""The whole-plan baseline: what LMCache 0.5.6's synchronous retrieve does.

Every hit chunk is staged in L1 host memory first, and only then installed, so peak
staging equals the restored state. It exists to be measured against BSR, and is the
one baseline the demo, `bench sweep` and `bench ttft` use.

As LMCache runs it:
- the L1 pool is allocated and faulted in up front (LMCache pre-allocates its pinned
  CPU pool at start-up), `min(l1_bytes, hit)` bytes, before the restore is timed;
- reads (`reads="lmcache"`, the default) are what `LocalDiskBackend` does: one
  buffered Python `readinto` per chunk file on `threads` reader threads (its
  `disk_io_threads`, default 4), no checksum (LMCache computes none);
- `reads="engine"` is the control: the same whole-plan staging, but every chunk read
  through the given engine (O_DIRECT, its W slots and queue depth, verified by the
  tier) and copied into the pool. BSR against this control is the effect of bounded
  staging alone; this control against `lmcache` is the I/O path's.

Where LMCache would busy-wait for L1 room forever, this fails cleanly with outcome
"zero" and says how much L1 the hit needed.
"""

from __future__ import annotations

import os
import time
from collections import deque
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import TypeGuard

import torch

from bsr_io._core import Engine, Slot
from bsr_io.errors import ChunkError
from bsr_io.load.discovery import Plan
from bsr_io.load.kvcache import Destination
from bsr_io.load.records import COMPLETE, ZERO, RestoreResult
from bsr_io.model.layout import KVLayout
from bsr_io.model.record import HEADER_BYTES
from bsr_io.store import Store
from bsr_io.tiers.base import PendingChunk, Tier, read_waiting
from bsr_io.tiers.files import FileTier

READS = ("lmcache", "engine")
SLOT_WAIT_S = 30.0  # how long a reader waits for a free slot of a full ring


class L1Exhausted(Exception):
    """The hit does not fit in the L1 budget."""


def _buffered_read(path: str | os.PathLike[str], out: torch.Tensor) -> None:
    """One buffered Python read of a record's payload into the L1 buffer `out`."""
    with open(path, "rb") as f:
        f.seek(HEADER_BYTES)
        got = f.readinto(out.numpy().data)
    if got != out.numel():
        raise OSError(f"short read of {path}: {got} of {out.numel()} bytes")


class WholePlanRestorer:
    """Stages the whole hit in a resident L1 pool (at most `l1_bytes`), then installs it."""

    def __init__(
        self,
        store: Store,
        layout: KVLayout,
        *,
        l1_bytes: int,
        engine: Engine | None = None,
        reads: str = "lmcache",
        threads: int = 4,
        pool: torch.Tensor | None = None,
    ) -> None:
        if l1_bytes < 0:
            raise ValueError(f"l1_bytes must be >= 0, got {l1_bytes}")
        if reads not in READS:
            raise ValueError(f"reads must be one of {READS}, got {reads!r}")
        if threads < 1:
            raise ValueError(f"reader threads must be at least 1, got {threads}")
        self.store = store
        self.layout = layout
        self.l1_bytes = l1_bytes
        self.reads = reads
        self.threads = threads
        # The control reads through the caller's engine (BSR's: same W, same queue depth).
        self.engine = engine or Engine(1, layout.chunk_bytes)
        self.pool = pool  # a resident uint8 pool shared between restorers, if given
        self.l1_peak_bytes = 0
        self.on_chunk: Callable[[int], None] | None = None  # progress, once per staged chunk

    def prepare(self, nbytes: int) -> torch.Tensor:
        """The resident L1 pool, at least `min(nbytes, l1_bytes)` bytes, faulted in."""
        want = min(nbytes, self.l1_bytes)
        if self.pool is None or self.pool.numel() < want:
            self.pool = torch.ones(want, dtype=torch.uint8)  # ones: every page touched
        return self.pool

    def _file_tier(self, tier: Tier) -> TypeGuard[FileTier]:
        # A wrapped tier (fault injection) must be read through its own interface.
        return self.reads == "lmcache" and isinstance(tier, FileTier)

    def _stage_lmcache(self, tiers: Sequence[Tier], plan: Plan, bufs: list[torch.Tensor]) -> None:
        # Tiers without files read through the engine, whose ring may hold fewer slots
        # than there are readers: a reader then waits for a slot (back-pressure).
        deadline = time.monotonic() + SLOT_WAIT_S

        def one(i: int) -> None:
            tier = tiers[plan.sources[i]]
            if self._file_tier(tier):
                _buffered_read(tier.path_of(plan.keys[i]), bufs[i])
            else:
                # Handed straight on: no frame but _copy_from_slot's holds the slot.
                key = plan.keys[i]
                self._copy_from_slot(read_waiting(tier, key, self.engine, deadline), bufs[i])

        with ThreadPoolExecutor(self.threads, thread_name_prefix="whole-plan-read") as ex:
            for i, _ in enumerate(ex.map(one, range(len(bufs)))):
                if self.on_chunk:
                    self.on_chunk(i)

    @staticmethod
    def _copy_from_slot(slot: Slot, out: torch.Tensor) -> None:
        try:
            out.numpy()[:] = memoryview(slot)[: out.numel()]
        finally:
            del slot

    def _stage_engine(self, tiers: Sequence[Tier], plan: Plan, bufs: list[torch.Tensor]) -> None:
        """Reads through the engine, as many in flight as it has slots (its W)."""
        inflight: deque[PendingChunk] = deque()
        n = len(bufs)
        nxt = 0
        try:
            for i in range(n):
                while nxt < n and len(inflight) < self.engine.window:
                    tier = tiers[plan.sources[nxt]]
                    inflight.append(tier.submit_read(plan.keys[nxt], self.engine))
                    nxt += 1
                self._copy_from_slot(inflight.popleft().wait(), bufs[i])
                if self.on_chunk:
                    self.on_chunk(i)
        finally:
            while inflight:  # reads already started own their slots until they complete
                try:
                    inflight.popleft().wait()
                except (ChunkError, OSError):
                    pass

    def restore(self, plan: Plan, dest: Destination) -> RestoreResult:
        n = plan.hit_chunks
        chunk = self.layout.chunk_bytes
        need = n * chunk
        result = RestoreResult(ZERO, 0, 0, n, l1_required_bytes=need)
        if n == 0:
            result.reason = plan.reason or "no reusable prefix"
            return result
        pool = self.prepare(need)  # LMCache's pool exists before any request
        t0 = time.perf_counter()
        if need > self.l1_bytes:
            result.reason = (
                f"whole-plan needs {need} bytes of L1 to stage the hit, the budget is "
                f"{self.l1_bytes}"
            )
            return result
        tiers = list(self.store.tiers)
        bufs = [pool[i * chunk : (i + 1) * chunk] for i in range(n)]
        self.l1_peak_bytes = need
        try:
            if self.reads == "engine":
                self._stage_engine(tiers, plan, bufs)
            else:
                self._stage_lmcache(tiers, plan, bufs)
            t_staged = time.perf_counter()
            for i, buf in enumerate(bufs):
                dest.install(i, buf)
            dest.synchronize()
        except (ChunkError, OSError) as exc:
            result.reason = f"staging failed: {exc}"
            return result
        t1 = time.perf_counter()
        for i in range(n):
            tier = tiers[plan.sources[i]]
            result.source_tiers.append(tier.name)
            result.bytes_read[tier.name] = result.bytes_read.get(tier.name, 0) + chunk
        result.outcome = COMPLETE
        result.committed_chunks = n
        result.committed_tokens = plan.hit_tokens
        result.rws_peak_bytes = need
        result.timings.update(
            {"stage_s": t_staged - t0, "install_s": t1 - t_staged, "total_s": t1 - t0}
        )
        return result
