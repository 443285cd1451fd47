"""Per-rank restore scenarios, run on real ranks by `bsr_io.cli.ranks.launch`.

`restore_on_rank` builds one rank's engine and store, writes a deterministic
synthetic state (optionally a copy in L3), applies a fault plan, probes,
restores and checks every destination byte against what was saved. The fault
matrix below is the one the tests and `bsr-lab bench faults` run.
"""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol, cast

import torch

from bsr_io._core import Engine
from bsr_io.cli.host import vmhwm_bytes
from bsr_io.cli.synthetic import fill_state, synthetic_chunk, synthetic_tokens
from bsr_io.cli.whole_plan import WholePlanRestorer
from bsr_io.commit import Agreement
from bsr_io.faults import Fault, FaultPlan
from bsr_io.load.kvcache import Destination, Fence, PagedKVCache
from bsr_io.model.keys import ChunkKey, chunk_keys
from bsr_io.model.layout import preset
from bsr_io.restore import Restorer
from bsr_io.store import Store, open_store

if TYPE_CHECKING:
    import threading

    from bsr_io.model.layout import KVLayout


class _RecordFiles(Protocol):
    """A tier whose records are files (SSDTier; a FaultyTier forwards `path_of` to it)."""

    def path_of(self, key: ChunkKey) -> Path: ...


class _KillAt:
    """Destination wrapper that kills its own process at chunk `at` (a fault double)."""

    def __init__(self, inner: PagedKVCache, at: int) -> None:
        self.inner, self.at = inner, at
        self.layout = inner.layout
        self.capacity_chunks = inner.capacity_chunks

    def install(self, chunk_index: int, payload: torch.Tensor) -> Fence | None:
        if chunk_index == self.at:
            os.kill(os.getpid(), signal.SIGKILL)
        return self.inner.install(chunk_index, payload)

    def extract(self, chunk_index: int, out: torch.Tensor) -> None:
        self.inner.extract(chunk_index, out)

    def synchronize(self) -> None:
        self.inner.synchronize()


def _destination(lay: KVLayout, tokens: int, cap_tokens: int | None) -> PagedKVCache:
    """A paged cache for `tokens`; with `cap_tokens`, block ids cycle within that many
    tokens' worth of blocks, so every byte is still installed but host memory stays
    bounded (for states larger than this machine's RAM)."""
    if cap_tokens is None or cap_tokens >= tokens:
        dest = PagedKVCache.allocate(lay, tokens, zero=False)
    else:
        small = PagedKVCache.allocate(lay, cap_tokens, zero=False)
        ids = []
        for g, t in zip(lay.groups, small.tensors, strict=True):
            n = -(-tokens // g.block_tokens)
            ids.append([i % t.shape[0] for i in range(n)])
        dest = PagedKVCache(lay, small.tensors, ids)
    for t in dest.tensors:
        t.view(torch.uint8).fill_(0xA5)  # touch every page before the VmHWM baseline
    return dest


WINDOW_GROUP = "<window>"  # in a scenario's fault: the layout's sliding-window group


def _groups_of(lay: KVLayout, fault: dict[str, Any]) -> dict[str, Any]:
    """`fault` with `WINDOW_GROUP` resolved to the layout's own window group (`window` in
    tiny, `window_kv` in deepseek-v4-flash); a group the layout lacks would never fire,
    so it is refused (a scenario that cannot fail proves nothing)."""
    groups = fault.get("groups")
    if groups is None:
        return fault
    window = next((g for g in lay.group_names() if "window" in g), WINDOW_GROUP)
    names = [window if g == WINDOW_GROUP else g for g in groups]
    unknown = sorted(set(names) - set(lay.group_names()))
    if unknown:
        raise ValueError(
            f"fault {fault['kind']!r} names groups {unknown} that layout {lay.name} lacks "
            f"(its groups: {lay.group_names()})"
        )
    return {**fault, "groups": names}


def restore_on_rank(
    rank: int,
    world_size: int,
    *,
    root: str,
    layout: str = "tiny",
    layout_kw: dict[str, Any] | None = None,
    tokens: int = 320,
    window: int = 4,
    seed: int = 11,
    model: str = "scenario",
    faults: list[dict[str, Any]] | None = None,
    l3: str = "none",  # "none": no L3; "empty": an L3 without the state; "copy": L3 holds it
    fill: bool = True,
    mode: str = "bsr",  # or "whole_plan"
    l1_bytes: int | None = None,  # whole-plan L1 budget (default: unlimited)
    whole_plan_reads: str = "lmcache",  # or "engine": the control through W engine slots
    dest_cap_tokens: int | None = None,
    kill_at_chunk: int | None = None,
    kill_rank: int | None = None,
    timeout_s: float = 10.0,
    check_data: bool = True,
    backend: str | None = None,
    late_rank: int | None = None,  # this rank reaches discovery `late_s` after the others
    late_s: float = 0.0,
    fifo_at_chunk: int | None = None,  # after discovery, a FIFO replaces this L2 record...
    fifo_rank: int | None = None,  # ...on this rank
    hold_slots: int = 0,  # slots of the engine held by the caller during the restore
    shared_save_chunks: int = 0,  # a save of other tokens through the same engine meanwhile
    direct_reads: bool = True,  # False: read through the slots even where O_DIRECT allows
) -> dict[str, Any]:
    lay = preset(layout, **(layout_kw or {}))
    base = Path(root)
    t0 = time.perf_counter()
    if fill:
        with Engine(1, lay.chunk_bytes, backend=backend) as fill_engine:
            lower = base / "l3" if l3 == "copy" else None
            fstore = open_store(fill_engine, base / "l2", layout=lay, lower_dir=lower)
            fill_state(fstore.tier("L2"), lay, tokens, seed, rank, world_size, model)
            if l3 == "copy":
                fill_state(fstore.tier("L3"), lay, tokens, seed, rank, world_size, model)
            fstore.close()
    fill_s = time.perf_counter() - t0
    token_ids = synthetic_tokens(seed, tokens)
    hit_tokens = tokens // lay.chunk_tokens * lay.chunk_tokens
    dest = _destination(lay, max(hit_tokens, lay.chunk_tokens), dest_cap_tokens)
    # Only ever turned off here: a cache whose block ids cycle refuses direct reads itself.
    dest.direct_reads = direct_reads and dest.direct_reads
    # Baseline before the engine exists: growth then includes the staging ring itself.
    hwm0 = vmhwm_bytes()
    # Whole-plan stages in an L1 pool of its own; its engine needs one slot unless it is
    # the control that reads through BSR's W slots.
    slots = window if mode == "bsr" or whole_plan_reads == "engine" else 1
    engine = Engine(slots, lay.chunk_bytes, backend=backend)
    store = open_store(
        engine, base / "l2", layout=lay, lower_dir=base / "l3" if l3 != "none" else None
    )
    plan_faults = FaultPlan([Fault(**_groups_of(lay, f)) for f in faults or []])
    keys = chunk_keys(token_ids, lay, model, rank, world_size)  # fault positions are these
    store = Store(plan_faults.wrap_all(store.tiers, rank, keys))
    agreement = (
        Agreement.from_process_group(timeout_s=timeout_s) if world_size > 1 else Agreement.local()
    )
    r = Restorer(store, lay, window=slots, engine=engine, model=model, agreement=agreement)
    if mode == "whole_plan":
        budget = l1_bytes if l1_bytes is not None else 1 << 62
        wp = WholePlanRestorer(store, lay, l1_bytes=budget, engine=engine, reads=whole_plan_reads)
        # LMCache's L1 pool is resident before any request: in the VmHWM, not in the time.
        wp.prepare(hit_tokens // lay.chunk_tokens * lay.chunk_bytes)
    if late_rank == rank:
        time.sleep(late_s)
    t1 = time.perf_counter()
    plan = r.probe(token_ids)
    if fifo_at_chunk is not None and fifo_rank == rank:
        path = cast(_RecordFiles, store.tier("L2")).path_of(keys[fifo_at_chunk])
        path.unlink()
        os.mkfifo(path)  # no writer: a blocking open would never return
    held = [engine.lease() for _ in range(hold_slots)]
    saver = _save_in_background(r, lay, shared_save_chunks, seed) if shared_save_chunks else None
    target: Destination = dest
    if kill_at_chunk is not None and kill_rank == rank:
        target = _KillAt(dest, kill_at_chunk)
    if mode == "bsr":
        res = r.restore(plan, target)
    elif mode == "whole_plan":
        res = wp.restore(plan, target)
    else:
        raise ValueError(f"mode must be 'bsr' or 'whole_plan', got {mode!r}")
    wall = time.perf_counter() - t1
    saved = None
    if saver is not None:
        saver[0].join()
        saved = saver[1][0] if saver[1] else None
    for slot in held:
        slot.release()
    growth = vmhwm_bytes() - hwm0
    data_ok = None
    if check_data and res.complete and (dest_cap_tokens or hit_tokens) >= hit_tokens:
        data_ok = all(
            dest.chunk_bytes(i) == synthetic_chunk(lay, seed, i, rank).tobytes()
            for i in range(res.committed_chunks)
        )
    return {
        "rank": rank,
        "mode": mode,
        "outcome": res.outcome,
        "committed_tokens": res.committed_tokens,
        "committed_chunks": res.committed_chunks,
        "hit_chunks": plan.hit_chunks,
        "local_hit_chunks": plan.local_hit_chunks,
        "reason": res.reason,
        "fallbacks": len(res.fallbacks),
        "fallback_tiers": sorted({f["tier"] for f in res.fallbacks}),
        "sources": sorted(set(res.source_tiers)),
        "rws_peak_bytes": res.rws_peak_bytes,
        "l1_required_bytes": plan.hit_chunks * lay.chunk_bytes,
        "vmhwm_growth_bytes": growth,
        "slot_bytes": engine.slot_bytes,
        "chunk_bytes": lay.chunk_bytes,
        "backend": engine.backend,
        "data_ok": data_ok,
        "restore_s": wall,
        "timings": res.timings,
        "fill_s": fill_s,
        "saved_chunks": saved,
    }


def _save_in_background(
    r: Restorer, lay: KVLayout, chunks: int, seed: int
) -> tuple[threading.Thread, list[int]]:
    """(thread, result list): a save of `chunks` chunks of other tokens through `r`'s
    engine, racing the restore for its slots."""
    import threading

    src = PagedKVCache.allocate(lay, chunks * lay.chunk_tokens)
    for t in src.tensors:
        t.view(torch.uint8).fill_(0x5A)
    other = synthetic_tokens(seed + 99, chunks * lay.chunk_tokens)
    out: list[int] = []
    thread = threading.Thread(target=lambda: out.append(r.save(other, src)), daemon=True)
    thread.start()
    return thread, out


def _fault(kind: str, *, tier: str = "L2", **kw: Any) -> dict[str, Any]:
    return {"kind": kind, "tier": tier, **kw}


# Each case: name, expected outcome on every (surviving) rank, optionally the expected
# committed chunks (default: the whole state), and restore_on_rank kwargs. Chunk
# positions are in the request.
FAULT_MATRIX: list[dict[str, Any]] = [
    {"name": "clean", "expected": "complete", "kw": {}},
    {
        "name": "l2-read-error-one-rank-l3-has-copy",
        "expected": "complete",
        "kw": {"l3": "copy", "faults": [_fault("error", chunks=[3], ranks=[1])]},
    },
    {
        "name": "l2-read-error-one-rank-no-l3-copy",
        "expected": "zero",
        "kw": {"l3": "empty", "faults": [_fault("error", chunks=[3], ranks=[1])]},
    },
    {
        "name": "corruption-one-rank",
        "expected": "zero",
        "kw": {"faults": [_fault("corrupt", chunks=[5], ranks=[0])]},
    },
    {
        "name": "corruption-one-rank-l3-has-copy",
        "expected": "complete",
        "kw": {"l3": "copy", "faults": [_fault("corrupt", chunks=[5], ranks=[0])]},
    },
    {
        "name": "record-deleted-after-discovery",
        "expected": "zero",
        "kw": {"faults": [_fault("missing", chunks=[7], ranks=[1])]},
    },
    {
        "name": "group-missing-one-rank",
        "expected": "complete",
        "committed_chunks": 4,  # the hit is the minimum over groups and ranks
        "kw": {"faults": [_fault("group_missing", chunks=[4], groups=[WINDOW_GROUP], ranks=[1])]},
    },
    {
        "name": "l2-down-l3-present",
        "expected": "complete",
        "kw": {"l3": "copy", "faults": [_fault("down")]},
    },
    {
        "name": "l2-down-mid-restore-l3-present",
        "expected": "complete",
        "kw": {"l3": "copy", "faults": [_fault("down", chunks=[6, 7, 8, 9], ranks=[0])]},
    },
    {
        "name": "rank-stalls-mid-restore",
        "expected": "zero",
        "kw": {"timeout_s": 3.0, "faults": [_fault("slow", chunks=[2], ranks=[1], delay_s=8.0)]},
    },
    {
        "name": "rank-late-at-discovery",  # later than the timeout: both adopt one decision
        "expected": "zero",
        "kw": {"timeout_s": 3.0, "late_rank": 1, "late_s": 4.5},
    },
    {
        "name": "fifo-at-record-path-one-rank",  # refused without blocking: a bad chunk
        "expected": "zero",
        "kw": {"fifo_at_chunk": 3, "fifo_rank": 1},
    },
    {
        "name": "fifo-at-record-path-l3-has-copy",
        "expected": "complete",
        "kw": {"l3": "copy", "fifo_at_chunk": 3, "fifo_rank": 1},
    },
    {
        "name": "shared-engine-slot-held-and-save",  # back-pressure, not a bad chunk
        "expected": "complete",
        "kw": {"hold_slots": 1, "shared_save_chunks": 6},
    },
    {
        "name": "rank-killed-mid-restore",
        "expected": "zero",
        "survivors_only": True,
        "kw": {"timeout_s": 3.0, "kill_at_chunk": 4, "kill_rank": 1},
    },
]


def fill_on_rank(
    rank: int,
    world_size: int,
    *,
    root: str,
    layout: str,
    tokens: int,
    layout_kw: dict[str, Any] | None = None,
    seed: int = 11,
    model: str = "scenario",
    window: int = 8,
) -> dict[str, Any]:
    """Write one rank's synthetic state into `root`/l2 (records already there are kept)."""
    lay = preset(layout, **(layout_kw or {}))
    t0 = time.perf_counter()
    with Engine(window, lay.chunk_bytes) as engine:
        store = open_store(engine, Path(root) / "l2", layout=lay)
        _, keys = fill_state(store.tier("L2"), lay, tokens, seed, rank, world_size, model)
        store.close()
    return {"rank": rank, "chunks": len(keys), "fill_s": time.perf_counter() - t0}
