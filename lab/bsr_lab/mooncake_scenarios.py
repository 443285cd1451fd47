"""One rank's save and restore through L2 (local SSD) and a Mooncake L3, with pool faults.

Run on real ranks by `launch(2, "bsr_lab.mooncake_scenarios:remote_on_rank", kw)`.
Each rank saves a prefix from a paged cache through both tiers (bounded staging), then
applies `case`, probes, restores into a fresh cache and reports the outcome and whether
every committed byte equals what was saved.

Cases: "through" (half the L2 records gone: the prefix comes from L2 and L3), "l2_bad"
(one L2 record lost, one corrupted: both served from L3), "removed" (rank 0 removes a
pool object after discovery), "node_kill" / "node_stop" (rank 0 sends SIGKILL / SIGSTOP
to the storage node when it installs chunk 1, every chunk coming from the pool). After a
"node_stop" restore rank 0 resumes the node (SIGCONT); once the tier is up again both
ranks count the pool's objects and restore again: a stall proves nothing against the
objects, so all of them must still be there.
"""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path
from typing import Any

import torch

from bsr_io._core import Engine
from bsr_io.cli.synthetic import synthetic_tokens
from bsr_io.commit import Agreement
from bsr_io.load.kvcache import PagedKVCache
from bsr_io.model.layout import preset
from bsr_io.model.record import HEADER_BYTES
from bsr_io.restore import Restorer
from bsr_io.store import Store
from bsr_io.tiers import SSDTier
from bsr_io.tiers.mooncake import MooncakeConfig, MooncakeTier

CASES = ("through", "l2_bad", "removed", "node_kill", "node_stop")


class SignalAt:
    """Destination wrapper that signals a process when chunk `at` is installed (the fault
    is real: the storage node itself is killed or stopped mid-restore)."""

    def __init__(self, inner: PagedKVCache, at: int, pid: int, sig: int) -> None:
        self.inner, self.at, self.pid, self.sig = inner, at, pid, sig
        self.capacity_chunks = inner.capacity_chunks
        self.sent_at: float | None = None

    def install(self, chunk_index: int, payload: torch.Tensor):
        if chunk_index == self.at and self.sent_at is None:
            os.kill(self.pid, self.sig)
            self.sent_at = time.perf_counter()
        return self.inner.install(chunk_index, payload)

    def extract(self, chunk_index: int, out: torch.Tensor) -> None:
        self.inner.extract(chunk_index, out)

    def synchronize(self) -> None:
        self.inner.synchronize()


def _after_the_stall(
    r: Restorer,
    l3: MooncakeTier,
    engine: Engine,
    token_ids: Any,
    keys: list[Any],
    src: PagedKVCache,
    window: int,
    timeout_s: float,
) -> dict[str, Any]:
    """Once the node answers again: how many objects the pool still holds (a fresh
    existence check) and the next restore's outcome."""
    deadline = time.monotonic() + 4 * timeout_s
    # The tier stops asking the pool for `down_s`; reads abandoned at the deadline hold
    # their slots until the transfer gives up or completes.
    while (l3.down or engine.free_slots() < window) and time.monotonic() < deadline:
        time.sleep(0.05)
    objects = l3.probe(keys)
    plan = r.probe(token_ids)
    dest = PagedKVCache.allocate(r.layout, len(token_ids))
    dest.direct_reads = False  # these scenarios watch the window's slots fill
    res = r.restore(plan, dest)
    wrong = [i for i in range(res.committed_chunks) if dest.chunk_bytes(i) != src.chunk_bytes(i)]
    return {
        "objects_after": objects,
        "withdrawn_after": l3.stats()["withdrawn"],
        "next_outcome": res.outcome,
        "next_sources": res.source_tiers,
        "next_reason": res.reason,
        "next_wrong_chunks": wrong,
    }


def _source_cache(lay, tokens: int, seed: int, rank: int) -> PagedKVCache:
    src = PagedKVCache.allocate(lay, tokens)
    gen = torch.Generator().manual_seed(seed * 1000 + rank)
    for t in src.tensors:
        b = t.view(torch.uint8)
        b.copy_(torch.randint(0, 256, b.shape, dtype=torch.uint8, generator=gen))
    return src


def remote_on_rank(
    rank: int,
    world_size: int,
    *,
    root: str,
    pool: dict[str, Any],
    case: str,
    chunks: int = 8,
    window: int = 2,
    timeout_s: float = 10.0,
    seed: int = 5,
    node_pid: int | None = None,
) -> dict[str, Any]:
    if case not in CASES:
        raise ValueError(f"case must be one of {CASES}, got {case!r}")
    lay = preset("tiny", chunk_tokens=256)
    tokens = chunks * lay.chunk_tokens
    token_ids = synthetic_tokens(seed, tokens)
    model = f"remote-{case}"
    engine = Engine(window, lay.chunk_bytes)
    l2 = SSDTier(Path(root) / f"l2-r{rank}", None, engine, layout=lay)
    l3 = MooncakeTier(MooncakeConfig.from_dict(pool), layout=lay)
    store = Store([l2, l3])
    agreement = Agreement.from_process_group(timeout_s=timeout_s)
    r = Restorer(store, lay, window=window, engine=engine, model=model, agreement=agreement)
    src = _source_cache(lay, tokens, seed, rank)
    saved = r.save(token_ids, src)
    keys = r.keys(token_ids)
    in_l3 = l3.probe(keys)

    if case == "through":
        for k in keys[chunks // 2 :]:
            l2.remove(k)
    elif case == "l2_bad":
        l2.remove(keys[1])
        with open(l2.path_of(keys[2]), "r+b") as f:  # flip one payload byte on disk
            f.seek(HEADER_BYTES + 100)
            b = f.read(1)
            f.seek(HEADER_BYTES + 100)
            f.write(bytes([b[0] ^ 0xFF]))
    else:
        for k in keys:
            l2.remove(k)

    exist_before = l3.stats()["exist_calls"]
    plan = r.probe(token_ids)
    probe_exist_calls = l3.stats()["exist_calls"] - exist_before
    dest = PagedKVCache.allocate(lay, tokens)
    dest.direct_reads = False  # these scenarios watch the window's slots fill
    target: Any = dest
    if case == "removed" and rank == 0:
        l3.remove(keys[chunks // 2])
    if case in ("node_kill", "node_stop") and rank == 0:
        sig = signal.SIGKILL if case == "node_kill" else signal.SIGSTOP
        target = SignalAt(dest, 1, int(node_pid or 0), sig)
    t0 = time.perf_counter()
    res = r.restore(plan, target)
    restore_s = time.perf_counter() - t0
    wrong = [i for i in range(res.committed_chunks) if dest.chunk_bytes(i) != src.chunk_bytes(i)]
    after: dict[str, Any] = {}
    if case == "node_stop":
        if rank == 0:
            os.kill(int(node_pid or 0), signal.SIGCONT)
        after = _after_the_stall(r, l3, engine, token_ids, keys, src, window, timeout_s)
    out = {
        "rank": rank,
        "case": case,
        "saved": saved,
        "in_l3_after_save": in_l3,
        "hit_chunks": plan.hit_chunks,
        "plan_sources": plan.source_names(),
        "probe_exist_calls": probe_exist_calls,
        "outcome": res.outcome,
        "committed_chunks": res.committed_chunks,
        "sources": res.source_tiers,
        "fallbacks": res.fallbacks,
        "reason": res.reason,
        "wrong_chunks": wrong,
        "rws_peak_bytes": res.rws_peak_bytes,
        "slot_bytes": engine.slot_bytes,
        "restore_s": restore_s,
        "l3_stats": l3.stats(),
        **after,
    }
    l3.close()
    return out
