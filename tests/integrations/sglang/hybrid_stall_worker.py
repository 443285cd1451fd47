"""The v2 kernel-stall case of test_hybrid_stall.py, in a process of its own.

    THP_MEM_ALLOC_ENABLE=1 python hybrid_stall_worker.py STORE_DIR OUT_JSON

As stall_worker.py (v1) says: torch reads THP_MEM_ALLOC_ENABLE at its first allocation,
so SGLang's host pools (2 MiB or more each, pin_memory off on the CPU) are page-aligned
and the backend reads straight into their pages with O_DIRECT through FUSE. The pools:
DeepSeek-V4's KV-derived sidecars as `hybrid_pool_assembler` builds them (a logical KV
anchor; `DeepSeekV4PagedHostPool`s for C4, the C4 indexer and C128, rows of 4096 bytes
per layer so every page is whole 4 KiB blocks), all read in one `batch_get_v2` as
SGLang's `_page_transfer_kv_batch` does, with a 1 s `timeout_s`.

The C4 indexer's record of page STALL is served late by the kernel. Meanwhile the worker
notes whether `batch_get_v2` has returned and what `batch_exists_v2` answers. Then, as
SGLang does once a batch answers, the host reuses every pool's failed tail pages
(writes other bytes there); the stall ends; the worker notes what those pages hold.
"""

from __future__ import annotations

import json
import sys
import threading
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
sys.path.insert(0, str(Path(__file__).parents[2]))
from fuse_stall import late_file  # noqa: E402
from hybrid_pools import ALL, Sidecar, fill, page_bytes, transfer  # noqa: E402
from pools import keys, make_backend  # noqa: E402
from sglang.srt.mem_cache.hicache_storage import PoolTransfer  # noqa: E402
from sglang.srt.mem_cache.memory_pool_host import (  # noqa: E402
    DeepSeekV4PagedHostPool,
    LogicalHostPool,
)

from bsr_io.load import memory  # noqa: E402

N, STALL, PAGE, HOST_PAGES, ROW = 4, 1, 64, 256, 4096
AT, INTO = [3, 8, 5, 12], [20, 27, 22, 31]
NAMES = ["deepseek_v4_c4", "deepseek_v4_c4_indexer", "deepseek_v4_c128"]


def pools() -> tuple[LogicalHostPool, list[Sidecar]]:
    out = []
    for name in NAMES:
        device = [torch.zeros(HOST_PAGES, ROW, dtype=torch.uint8) for _ in range(2)]
        pool = DeepSeekV4PagedHostPool(
            name, device, ROW, HOST_PAGES, PAGE, layout="page_first", pin_memory=False
        )
        out.append(Sidecar(name, pool, ALL))
    return LogicalHostPool(HOST_PAGES * PAGE, PAGE, layout="page_first"), out


def main() -> None:
    store_dir, out = Path(sys.argv[1]), Path(sys.argv[2])
    ks = keys(N, "stalled v2")
    kv, src = pools()
    writer = make_backend(store_dir, kv)
    for i, c in enumerate(src):
        writer.register_mem_host_pool_v2(c.pool, c.name)
        fill(c.pool, AT, seed=20 + i)
    got_set = writer.batch_set_v2([transfer(c, ks, AT) for c in src])
    assert got_set == {c.name: [True] * N for c in src}, got_set
    saved = {c.name: page_bytes(c.pool, AT) for c in src}
    writer.close()

    kv2, dst = pools()
    reader = make_backend(store_dir, kv2, timeout_s=1.0)
    for c in dst:
        reader.register_mem_host_pool_v2(c.pool, c.name)
    g = reader.groups["deepseek_v4_c4_indexer"]
    path = g.store.tiers[0].path_of(g.key(ks[STALL]))  # type: ignore[attr-defined]
    facts: dict[str, object] = {
        "aligned": all(c.pool.kv_buffer.data_ptr() % 4096 == 0 for c in dst),
    }
    query = [PoolTransfer(name=c.name, hit_policy=ALL) for c in dst]
    got: list[dict[str, list[bool]]] = []
    with late_file(path, delay_s=120.0) as stall:
        get = threading.Thread(
            target=lambda: got.append(reader.batch_get_v2([transfer(c, ks, INTO) for c in dst]))
        )
        get.start()
        exists = N
        for _ in range(400):  # until the call returned, or the backend says it is unhealthy
            exists = reader.batch_exists_v2(ks, query).kv_hit_pages
            if got or exists == 0:
                break
            time.sleep(0.05)
        facts["held_by_backend"] = not got
        facts["exists_while_held"] = exists
        if not got:
            stall.release()  # the backend holds the pages until the kernel returns them
        get.join(60)
        facts["got"] = got[0] if got else None
        ok = min((r.count(True) for r in got[0].values()), default=0) if got else 0
        facts["direct_pages"] = reader.stats["direct_pages"]
        # SGLang frees every pool's failed tail and reuses it: other bytes land there.
        tail = INTO[ok:]
        reused = {}
        for i, c in enumerate(dst):
            fill(c.pool, tail, seed=90 + i)
            reused[c.name] = page_bytes(c.pool, tail)
        stall.release()
        facts["returned"] = memory.wait_returned(None, 60.0)
    facts["reused_intact"] = {c.name: page_bytes(c.pool, tail) == reused[c.name] for c in dst}
    facts["late_bytes_in_reused"] = {
        c.name: [b in saved[c.name] for b in page_bytes(c.pool, tail)] for c in dst
    }
    facts["head_right"] = {c.name: page_bytes(c.pool, INTO[:ok]) == saved[c.name][:ok] for c in dst}
    facts["exists_after"] = reader.batch_exists_v2(ks, query).kv_hit_pages
    reader.close()
    out.write_text(json.dumps(facts))


if __name__ == "__main__":
    main()
