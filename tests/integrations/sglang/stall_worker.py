"""The kernel-stall case of test_kernel_stall.py, in a process of its own.

    THP_MEM_ALLOC_ENABLE=1 python stall_worker.py STORE_DIR OUT_JSON

torch reads THP_MEM_ALLOC_ENABLE once, at its first allocation: with it, SGLang's host
pool (pin_memory off on the CPU) is page-aligned, as a GPU machine's pinned pool is, so
the backend reads straight into its pages with O_DIRECT even through FUSE (whose files
ask for 4096-byte memory alignment). Everything else is as a user would run it: SGLang's
`MHATokenToKVPoolHost`, the backend built by SGLang's storage factory with default
settings but a 1 s `timeout_s`, and one record file whose payload read FUSE answers late.

Page STALL's read is held by the kernel past the deadline. Meanwhile the worker notes
whether `batch_get_v1` has returned, what `batch_exists` answers, and what a load
through a NEW page view over the same pages does. Then, as SGLang does once a batch
answers, the host reuses the batch's failed tail pages for another prefix (writes its
bytes and backs them up); the stall ends; the worker notes what the reused pages hold
and what a fresh reader of the other prefix gets.
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
from pools import fill, keys, make_backend, mha_pool, page_bytes  # noqa: E402

from bsr_io._core import Engine  # noqa: E402
from bsr_io.integrations.sglang.pages import HostPages  # noqa: E402
from bsr_io.load import memory  # noqa: E402
from bsr_io.load.discovery import sources_of  # noqa: E402
from bsr_io.load.records import LoadOptions, windowed_install  # noqa: E402

N, STALL = 4, 1  # pages per batch, the page whose read the kernel holds


def main() -> None:
    store_dir, out = Path(sys.argv[1]), Path(sys.argv[2])
    src = mha_pool("page_first")
    at = torch.arange(src.page_size, (N + 1) * src.page_size)
    fill(src, at, seed=11)
    ks, other = keys(N, "ours"), keys(N, "another prefix")
    writer = make_backend(store_dir, src)
    assert writer.batch_set_v1(ks, at) == [True] * N
    saved = page_bytes(src, at)
    writer.close()

    pool = mha_pool("page_first")
    reader = make_backend(store_dir, pool, timeout_s=1.0)
    assert reader.store is not None and reader.pages is not None
    path = reader.store.tiers[0].path_of(reader._key(ks[STALL]))  # type: ignore[attr-defined]
    facts: dict[str, object] = {"aligned": pool.kv_buffer.data_ptr() % 4096 == 0}
    got: list[list[bool]] = []
    with late_file(path, delay_s=120.0) as stall:
        get = threading.Thread(target=lambda: got.append(reader.batch_get_v1(ks, at)))
        get.start()
        exists = N
        for _ in range(400):  # until the call returned, or the backend says it is unhealthy
            exists = reader.batch_exists(ks)
            if got or exists == 0:
                break
            time.sleep(0.05)
        facts["held_by_backend"] = not got
        facts["exists_while_held"] = exists
        # The pool's memory has one owner: the one its registration made holds the range.
        owner = reader.groups["kv"].memory
        facts["one_owner"] = (
            owner is not None
            and bool(owner.owned())
            and all(memory.owner_of(v) is owner for v in reader.pages.views)
        )
        # The next load into the same pages through a NEW view object.
        view = HostPages(reader.pages, reader.pages.page_runs(at), direct_reads=True)
        tiers = list(reader.store.tiers)
        ckeys = [reader._key(k) for k in ks]
        with Engine(2, reader.pages.layout.chunk_bytes, backend="pread") as other_engine:
            report, error = windowed_install(
                other_engine,
                tiers,
                ckeys,
                sources_of(tiers, ckeys),
                view,
                LoadOptions(deadline=time.monotonic() + 1.0),
                other_engine.slot_bytes,
                2,
            )
        facts["new_view_error"] = error
        facts["new_view_read"] = report.bytes_read if report is not None else {}
        if not got:
            stall.release()  # the backend holds the pages until the kernel returns them
        get.join(60)
        facts["got"] = got[0] if got else None
        ok = sum(1 for g in (got[0] if got else []) if g) or 0
        facts["direct_pages"] = reader.stats["direct_pages"]
        # SGLang frees the failed tail and reuses it: another prefix's pages land there.
        tail = at[ok * pool.page_size :]
        fill(pool, tail, seed=99)
        reused = page_bytes(pool, tail)
        stall.release()
        facts["returned"] = memory.wait_returned(None, 60.0)
    facts["reused_intact"] = page_bytes(pool, tail) == reused
    facts["late_bytes_in_reused"] = [b in saved for b in page_bytes(pool, tail)]
    # ... and backs them up under the other prefix's keys; a fresh reader gets them.
    m = tail.numel() // pool.page_size
    facts["backed_up"] = reader.batch_set_v1(other[:m], tail)
    reader.close()
    fresh_pool = mha_pool("page_first")
    fresh = make_backend(store_dir, fresh_pool)
    into = torch.arange(40 * pool.page_size, (40 + m) * pool.page_size)
    facts["fresh_got"] = fresh.batch_get_v1(other[:m], into)
    facts["fresh_right"] = [
        a == b for a, b in zip(page_bytes(fresh_pool, into), reused, strict=True)
    ]
    fresh.close()
    out.write_text(json.dumps(facts))


if __name__ == "__main__":
    main()
