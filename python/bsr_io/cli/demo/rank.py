"""The demo's work on one rank (a process of its own, started by
`bsr_io.cli.ranks.launch`): save a prefix, restore it with BSR and with the
whole-plan baseline, then the fault round. Returns every figure it measured."""

from __future__ import annotations

import time
from collections import Counter
from pathlib import Path
from typing import Any

import torch

from bsr_io._core import Engine, xxh3_64
from bsr_io.cli.host import vmhwm_bytes, vmhwm_reset
from bsr_io.cli.progress import RankProgress
from bsr_io.cli.synthetic import fill_destination, synthetic_tokens
from bsr_io.cli.whole_plan import WholePlanRestorer
from bsr_io.commit import Agreement
from bsr_io.faults import Fault, FaultPlan
from bsr_io.load.kvcache import Fence, PagedKVCache
from bsr_io.metrics import RestoreMetrics
from bsr_io.model.layout import preset
from bsr_io.model.sizes import GiB
from bsr_io.restore import Restorer
from bsr_io.store import Store
from bsr_io.tiers import LowerTier, SSDTier


class _Counting:
    """A destination that reports each installed chunk to the progress file."""

    def __init__(self, inner: PagedKVCache, progress: RankProgress, chunk_bytes: int) -> None:
        self.inner, self.progress, self.chunk_bytes = inner, progress, chunk_bytes
        self.capacity_chunks = inner.capacity_chunks

    def install(self, chunk_index: int, payload: torch.Tensor) -> Fence | None:
        fence = self.inner.install(chunk_index, payload)
        self.progress.advance(self.chunk_bytes)
        return fence

    def extract(self, chunk_index: int, out: torch.Tensor) -> None:
        self.inner.extract(chunk_index, out)

    def synchronize(self) -> None:
        self.inner.synchronize()


def _chunk_sums(cache: PagedKVCache, chunks: int) -> list[tuple[int, ...]]:
    """xxh3 of each chunk's blocks, per group, read in place. `PagedKVCache.allocate` gives
    a request consecutive blocks, so a chunk is one contiguous slice of each group tensor."""
    lay = cache.layout
    out = []
    for i in range(chunks):
        sums = []
        for g, t in zip(lay.groups, cache.tensors, strict=True):
            per = lay.chunk_tokens // g.block_tokens
            chunk = t[i * per : (i + 1) * per].reshape(-1).view(torch.uint8).numpy()
            sums.append(xxh3_64(chunk.data))
        out.append(tuple(sums))
    return out


def _barrier(world_size: int) -> None:
    if world_size > 1:
        import torch.distributed as dist

        dist.barrier()


def demo_rank(
    rank: int,
    world_size: int,
    *,
    root: str,
    layout: str,
    chunks: int,
    window: int,
    seed: int,
    fault_chunk: int,
    fault_rank: int,
    progress_dir: str | None = None,
    model: str = "bsr-io-demo",
    timeout_s: float = 60.0,
) -> dict[str, Any]:
    """One rank of the demo (run by `bsr_io.cli.ranks.launch`); returns its figures."""
    lay = preset(layout)
    cb = lay.chunk_bytes
    tokens = chunks * lay.chunk_tokens
    half_chunks = chunks // 2
    state = chunks * cb
    prog = RankProgress(progress_dir, rank)
    base = Path(root)
    engine = Engine(window, cb)
    l2 = SSDTier(base / "l2", None, engine, layout=lay)
    l3 = LowerTier(base / "l3", layout=lay)
    l3_empty = LowerTier(base / "l3-empty", layout=lay)
    agreement = (
        Agreement.from_process_group(timeout_s=timeout_s) if world_size > 1 else Agreement.local()
    )
    token_ids = synthetic_tokens(seed, tokens)
    metrics = RestoreMetrics()  # what a serving engine would export, for every BSR restore

    def restorer(store: Store) -> Restorer:
        # One Agreement for every request, so the ranks' request numbers stay in step.
        return Restorer(store, lay, window=window, engine=engine, model=model, agreement=agreement)

    out: dict[str, Any] = {
        "rank": rank,
        "layout": lay.name,
        "chunk_bytes": cb,
        "slot_bytes": engine.slot_bytes,
        "chunks": chunks,
        "tokens": tokens,
        "state_bytes": state,
        "backend": engine.backend,
        "window": window,
        "runs": {},
    }

    # The prefix: random KV in a paged cache, saved through the W slots.
    src = PagedKVCache.allocate(lay, tokens, zero=False)
    prog.phase("prefill KV (random bytes)", state)
    fill_destination(src, lay, chunks, seed, rank, on_chunk=lambda _i: prog.advance(cb))
    want = _chunk_sums(src, chunks)
    bsr = restorer(Store([l2]))
    prog.phase("save prefix to L2", state)
    _barrier(world_size)
    t0 = time.perf_counter()
    engine.reset_peak()
    written = bsr.save(token_ids, src, progress=lambda n: prog.advance(n * cb))
    out["save_s"] = time.perf_counter() - t0
    out["save_staging_peak_bytes"] = engine.peak_bytes()
    out["saved_chunks"] = written
    del src

    dest = PagedKVCache.allocate(lay, tokens)

    def check(n: int) -> bool:
        return _chunk_sums(dest, n) == want[:n]

    def clear() -> None:
        # So a chunk that was not installed cannot pass the check with an earlier copy.
        for t in dest.tensors:
            t.zero_()

    def bsr_restore(name: str, r: Restorer, n_tokens: int, verify: bool = True) -> dict[str, Any]:
        if verify:
            clear()
        prog.phase(name, (n_tokens // lay.chunk_tokens) * cb)
        _barrier(world_size)
        rss0 = vmhwm_reset()
        t0 = time.perf_counter()
        plan = r.probe(token_ids[:n_tokens])
        res = r.restore(plan, _Counting(dest, prog, cb))
        wall = time.perf_counter() - t0
        growth = vmhwm_bytes() - rss0
        metrics.observe(res)
        prog.finish()
        return {
            "outcome": res.outcome,
            "committed_tokens": res.committed_tokens,
            "committed_chunks": res.committed_chunks,
            "state_bytes": plan.hit_chunks * cb,
            "rws_peak_bytes": res.rws_peak_bytes,
            "vmhwm_growth_bytes": growth,
            "time_to_commit_s": wall,
            "gib_s": plan.hit_chunks * cb / wall / GiB if res.complete else None,
            "reason": res.reason,
            "sources": dict(Counter(res.source_tiers)),
            "fallbacks": res.fallbacks,
            "data_ok": check(res.committed_chunks) if res.complete and verify else None,
        }

    runs = out["runs"]
    runs["bsr"] = bsr_restore("restore: BSR, full state", bsr, tokens)
    # The half-size restore only measures the staging peak (its bytes were just checked).
    runs["bsr_half"] = bsr_restore(
        "restore: BSR, half state", bsr, half_chunks * lay.chunk_tokens, verify=False
    )

    def whole_plan(name: str, l1_bytes: int) -> dict[str, Any]:
        if l1_bytes >= state:
            clear()
        wp = WholePlanRestorer(Store([l2]), lay, l1_bytes=l1_bytes)
        wp.on_chunk = lambda _i: prog.advance(cb)
        rss0 = vmhwm_reset()  # the pool is part of what the baseline holds for a request
        wp.prepare(state)  # LMCache's L1 pool is resident before any request
        prog.phase(name, state)
        _barrier(world_size)
        t0 = time.perf_counter()
        plan = bsr.probe(token_ids)
        res = wp.restore(plan, dest)
        wall = time.perf_counter() - t0
        growth = vmhwm_bytes() - rss0
        wp.pool = None  # give the pool back before the next run measures its own peak
        prog.finish()
        return {
            "outcome": res.outcome,
            "l1_bytes": l1_bytes,
            "l1_required_bytes": res.l1_required_bytes,
            "l1_peak_bytes": wp.l1_peak_bytes if res.complete else 0,
            "vmhwm_growth_bytes": growth,
            "committed_tokens": res.committed_tokens,
            "time_to_commit_s": wall,
            "gib_s": state / wall / GiB if res.complete else None,
            "reason": res.reason,
            "data_ok": check(res.committed_chunks) if res.complete else None,
        }

    budget = window * engine.slot_bytes  # BSR's staging bound
    runs["whole_plan_same_l1"] = whole_plan("restore: whole-plan, L1 = BSR's window", budget)
    runs["whole_plan_big_l1"] = whole_plan("restore: whole-plan, L1 = state", state)

    # The lower tier gets a copy of the chunk that will fail (as demotion from L2 would
    # leave it), before the first fault round, which restores without it.
    prog.phase("copy the chunk to L3", cb)
    fault_key = bsr.keys(token_ids)[fault_chunk]
    l3.adopt(fault_key, l2.path_of(fault_key))
    prog.finish()

    # Fault round: one rank cannot read one chunk from L2.
    faults = FaultPlan(
        [Fault("error", "L2", chunks=frozenset({fault_chunk}), ranks=frozenset({fault_rank}))]
    )
    keys = bsr.keys(token_ids)  # the request whose chunk positions the fault names
    runs["fault_no_l3_copy"] = bsr_restore(
        "fault round: no L3 copy",
        restorer(Store(faults.wrap_all([l2, l3_empty], rank, keys))),
        tokens,
        verify=False,
    )
    runs["fault_l3_copy"] = bsr_restore(
        "fault round: L3 holds a copy",
        restorer(Store(faults.wrap_all([l2, l3], rank, keys))),
        tokens,
    )
    out["l3_records"] = l3.stats()["records"]
    prog.phase("done", 0)
    out["phase_s"] = prog.durations
    out["metrics"] = metrics.snapshot()
    engine.close()
    return out
