"""One TP rank of the two-rank test (test_ranks.py), in a process of its own.

    python rank_worker.py RANK WORLD STORE_DIR PORT BAD_PAGE OUT_JSON

Stores N pages of its own shard, waits for its peer, damages its own record of
BAD_PAGE when it is rank 1, reads the prefix back, and takes the minimum of the
leading hits over the gloo group, as SGLang's controller does for a prefetch.
"""

from __future__ import annotations

import json
import sys
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).parent))
from pools import fill, keys, make_backend, mha_pool, page_bytes  # noqa: E402

from bsr_io.model.record import HEADER_BYTES  # noqa: E402

N = 6


def main() -> None:
    rank, world, store_dir, port, bad, out = sys.argv[1:7]
    r, w, bad_page = int(rank), int(world), int(bad)
    dist.init_process_group(
        "gloo",
        init_method=f"tcp://127.0.0.1:{port}",
        rank=r,
        world_size=w,
        timeout=timedelta(seconds=60),
    )
    pool = mha_pool("page_first")
    at = torch.arange(pool.page_size, (N + 1) * pool.page_size)
    fill(pool, at, seed=100 + r)  # each rank's own shard of the heads
    ks = keys(N)
    b = make_backend(store_dir, pool, tp_rank=r, tp_size=w)
    assert b.batch_set_v1(ks, at) == [True] * N
    expected = page_bytes(pool, at)
    dist.barrier()
    if r == 1:
        path = b.store.tiers[0].path_of(b._key(ks[bad_page]))
        with open(path, "r+b") as f:
            f.seek(HEADER_BYTES + 7)
            byte = f.read(1)
            f.seek(HEADER_BYTES + 7)
            f.write(bytes([byte[0] ^ 1]))
    dist.barrier()
    exists = b.batch_exists(ks)
    into = torch.arange(20 * pool.page_size, (20 + N) * pool.page_size)
    got = b.batch_get_v1(ks, into)
    lead = got.index(False) if False in got else len(got)
    agreed = torch.tensor(lead)
    dist.all_reduce(agreed, op=dist.ReduceOp.MIN)
    same = page_bytes(b.mem_pool_host, into)[:lead] == expected[:lead]
    Path(out).write_text(
        json.dumps(
            {
                "rank": r,
                "exists": exists,
                "got": got,
                "lead": lead,
                "agreed": int(agreed),
                "same": same,
            }
        )
    )
    b.close()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
