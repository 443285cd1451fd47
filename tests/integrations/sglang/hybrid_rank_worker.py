"""One TP rank of the two-rank hybrid test (test_hybrid_ranks.py), in a process of its own.

    python hybrid_rank_worker.py RANK WORLD STORE_DIR PORT OUT_JSON

Each rank holds its own DeepSeek-V4-shaped host pools (`hybrid_pools.build("dsv4")`: a
logical KV anchor, the C4, C4-indexer and C128 pools (all pages), the SWA pool and the
C4 state pools (trailing)) and its own records of them (an MHA-style identity: per TP rank). The
agreement is SGLang's own code: `HybridCacheController._sync_prefetch_hit_query` (one
MIN over a flag per prefix length, since a trailing pool is queried) and
`_reduce_prefetch_ack` (the MIN of completed tokens and of every pool's hits), run on
a controller object that carries only the fields those two methods read, over this
gloo group.

- Prefix A: every all-pages pool holds every page; the trailing pools' windows held end
  at 3 and 6 pages on rank 0, at 2 and 6 on rank 1.
- Prefix B: every pool holds every page; rank 1 flips a byte of its C4-indexer record
  of page BAD, then both ranks load the prefix as SGLang's prefetch thread does (the
  KV-derived pools in one `batch_get_v2`, clamped; the trailing windows only once they are
  complete) and agree.
"""

from __future__ import annotations

import json
import sys
from datetime import timedelta
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).parent))
from hybrid_pools import ALL, TRAILING, build, fill, page_bytes, slots, transfer  # noqa: E402
from pools import keys, make_backend  # noqa: E402
from sglang.srt.managers.cache_controller import PrefetchAck  # noqa: E402
from sglang.srt.mem_cache.hicache_storage import (  # noqa: E402
    PoolName,
    PoolTransfer,
    count_pool_hits,
)
from sglang.srt.mem_cache.hybrid_cache.hybrid_cache_controller import (  # noqa: E402
    HybridCacheController,
)

from bsr_io.model.record import HEADER_BYTES  # noqa: E402

N, PAGE, BAD = 6, 64, 2
AT = [7, 2, 9, 4, 11, 5]  # where this rank's pages sit
INTO = [13, 17, 14, 19, 15, 21]  # where the load puts them


def controller() -> Any:
    """SGLang's hybrid controller with only what its two agreement methods read."""
    c = HybridCacheController.__new__(HybridCacheController)
    c.page_size = PAGE
    c.prefetch_hits_sync_groups = [dist.group.WORLD]
    c.prefetch_completion_sync_groups = [dist.group.WORLD]
    return c


def query(s: Any, ks: list[str]) -> list[PoolTransfer]:
    return [
        PoolTransfer(
            name=c.name, keys=ks[-c.window :] if c.policy == TRAILING else None, hit_policy=c.policy
        )
        for c in s.sidecars
    ]


def agree_hits(ctrl: Any, b: Any, s: Any, ks: list[str]) -> dict[str, Any]:
    """This rank's `batch_exists_v2`, then SGLang's agreement over the group."""
    q = query(s, ks)
    hit = b.batch_exists_v2(ks, q)
    op = SimpleNamespace(
        pool_transfers=q,
        token_ids=list(range(len(ks) * PAGE)),
        pool_storage_result=SimpleNamespace(restorable_prefix_pages=hit.restorable_prefix_pages),
        query_pool_hit_pages={
            PoolName.KV: hit.kv_hit_pages,
            **{PoolName(n): p for n, p in hit.extra_pool_hit_pages.items() if n != "kv"},
        },
    )
    agreed = ctrl._sync_prefetch_hit_query(op, hit.kv_hit_pages * PAGE)
    return {
        "kv_hit_pages": hit.kv_hit_pages,
        "restorable": hit.restorable_prefix_pages,
        "agreed_pages": agreed // PAGE,
    }


def main() -> None:
    rank, world, store_dir, port, out = sys.argv[1:6]
    r = int(rank)
    dist.init_process_group(
        "gloo",
        init_method=f"tcp://127.0.0.1:{port}",
        rank=r,
        world_size=int(world),
        timeout=timedelta(seconds=120),
    )
    ctrl = controller()
    s = build("dsv4", PAGE)
    b = make_backend(store_dir, s.kv, tp_rank=r, tp_size=int(world))
    for c in s.sidecars:
        b.register_mem_host_pool_v2(c.pool, c.name)
    b.on_host_pools_registered()
    full = [c for c in s.sidecars if c.policy == ALL]
    trailing = [c for c in s.sidecars if c.policy == TRAILING]  # SWA and the C4 states
    facts: dict[str, Any] = {"rank": r}

    # -- prefix A: the ranks hold different trailing windows -----------------------
    ka = keys(N, "prefix A")
    for i, c in enumerate(s.sidecars):
        fill(c.pool, AT, seed=100 * r + i)
    assert b.batch_set_v2([transfer(c, ka, AT) for c in full]) == {c.name: [True] * N for c in full}
    for end in (3, 6) if r == 0 else (2, 6):
        for c in trailing:
            lo = end - c.window
            got = b.batch_set_v2([transfer(c, ka[lo:end], AT[lo:end])])
            assert got == {c.name: [True] * c.window}, got
    dist.barrier()
    facts["a6"] = agree_hits(ctrl, b, s, ka)
    facts["a5"] = agree_hits(ctrl, b, s, ka[:5])

    # -- prefix B: rank 1's indexer record of page BAD is damaged ------------------
    kb = keys(N, "prefix B")
    for i, c in enumerate(s.sidecars):
        fill(c.pool, AT, seed=1000 + 100 * r + i)
    saved = {c.name: page_bytes(c.pool, AT) for c in s.sidecars}
    got = b.batch_set_v2([transfer(c, kb, AT) for c in s.sidecars])
    assert got == {c.name: [True] * N for c in s.sidecars}, got
    dist.barrier()
    if r == 1:
        g = b.groups["deepseek_v4_c4_indexer"]
        path = g.store.tiers[0].path_of(g.key(kb[BAD]))  # type: ignore[attr-defined]
        with open(path, "r+b") as f:
            f.seek(HEADER_BYTES + 5)
            byte = f.read(1)
            f.seek(HEADER_BYTES + 5)
            f.write(bytes([byte[0] ^ 1]))
    dist.barrier()
    facts["b_before"] = agree_hits(ctrl, b, s, kb)
    # SGLang's prefetch: the logical KV through v1, the KV-derived pools in one v2
    # call, clamped to the least of them; the trailing windows only once they are complete.
    kv = b.batch_get_v1(kb, slots(s.kv, INTO))
    kv_hits = kv.index(False) if False in kv else N
    derived = b.batch_get_v2([transfer(c, kb, INTO) for c in full])
    completed = min([kv_hits, *count_pool_hits(derived).values()])
    window: dict[str, list[bool]] = {}
    if completed == N:
        window = b.batch_get_v2(
            [transfer(c, kb[N - c.window :], INTO[N - c.window :]) for c in trailing]
        )
    ack = PrefetchAck(
        rid="b",
        operation=None,
        completed_tokens=completed * PAGE,
        pool_hits={**count_pool_hits(derived), **count_pool_hits(window)},
    )
    ctrl._reduce_prefetch_ack(ack)
    facts["derived"] = derived
    facts["window"] = window
    facts["completed"] = completed
    facts["agreed_completed"] = int(ack.completed_tokens) // PAGE
    facts["agreed_pool_hits"] = {
        c.name: int(ack.pool_hits[c.name]) for c in s.sidecars if c.name in ack.pool_hits
    }
    n = facts["agreed_completed"]
    facts["same"] = {
        c.name: page_bytes(c.pool, INTO[:n]) == saved[c.name][:n] for c in s.sidecars if c in full
    }
    facts["b_after"] = agree_hits(ctrl, b, s, kb)
    Path(out).write_text(json.dumps(facts))
    b.close()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
