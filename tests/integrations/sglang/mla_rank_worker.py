"""One TP rank of an MLA model (test_catalog.py), in a process of its own.

    python mla_rank_worker.py RANK WORLD STORE_DIR PORT RESCAN_S OUT_JSON

Both ranks start their backend first; then the storage writer (rank 0) stores N pages
and the other rank backs them up too (it writes nothing: the writer holds them). Each
rank asks `batch_exists` until it holds all N, for a bounded number of listing
intervals, then the group takes the minimum of the hits and of the pages read back, as
SGLang's controller does.
"""

from __future__ import annotations

import json
import sys
import time
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).parent))
from pools import fill, keys, make_backend, mla_pool, page_bytes  # noqa: E402

N = 5
INTERVALS = 50  # how many listing intervals a rank waits for the writer's pages


def _min(value: int) -> int:
    t = torch.tensor(value)
    dist.all_reduce(t, op=dist.ReduceOp.MIN)
    return int(t)


def main() -> None:
    rank, world, store_dir, port, rescan, out = sys.argv[1:7]
    r, w, rescan_s = int(rank), int(world), float(rescan)
    dist.init_process_group(
        "gloo",
        init_method=f"tcp://127.0.0.1:{port}",
        rank=r,
        world_size=w,
        timeout=timedelta(seconds=120),
    )
    pool = mla_pool("page_first")
    at = torch.arange(pool.page_size, (N + 1) * pool.page_size)
    fill(pool, at, seed=5)  # MLA: every TP rank holds the same latent KV
    ks = keys(N)
    b = make_backend(store_dir, pool, tp_rank=r, tp_size=w, mla=True, rescan_s=rescan_s)
    dist.barrier()  # both started before any page is stored
    at_start = b.batch_exists(ks)
    assert b.batch_set_v1(ks, at) == [True] * N
    dist.barrier()
    at_once = b.batch_exists(ks)
    exists, end = at_once, time.monotonic() + INTERVALS * rescan_s
    while exists < N and time.monotonic() < end:
        time.sleep(rescan_s / 4)
        exists = b.batch_exists(ks)
    agreed_exists = _min(exists)  # SGLang's storage hit: the MIN over the TP group
    into = torch.arange(20 * pool.page_size, (20 + N) * pool.page_size)
    got = b.batch_get_v1(ks[:agreed_exists], into[: agreed_exists * pool.page_size])
    lead = got.index(False) if False in got else len(got)
    agreed = _min(lead)
    same = page_bytes(pool, into)[:lead] == page_bytes(pool, at)[:lead]
    Path(out).write_text(
        json.dumps(
            {
                "rank": r,
                "writer": b.identity.writer,
                "written": b.stats["set_written"],
                "at_start": at_start,
                "at_once": at_once,
                "exists": exists,
                "agreed_exists": agreed_exists,
                "got": got,
                "agreed": agreed,
                "same": same,
            }
        )
    )
    b.close()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
