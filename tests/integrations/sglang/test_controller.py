"""SGLang's own controller code drives the backend: its backup of host pages to
storage, its storage hit query (keys hashed from token ids by SGLang), and its
prefetch page transfer into host pages.

`HiCacheController.__init__` builds device pools, CUDA streams and the storage
threads, which a CPU-only machine lacks: the controller here is made without it
(`object.__new__`) and given only the attributes these methods read, which the
constructor and `attach_storage_backend` would set (the backend, page size, the
zero-copy get/set functions it selects for `interface_v1`, and the prefetch ack queue).
"""

from __future__ import annotations

import queue
from pathlib import Path

import torch
from pools import fill, make_backend, mha_pool, page_bytes
from sglang.srt.managers.cache_controller import (
    HiCacheController,
    PrefetchOperation,
    StorageOperation,
)
from sglang.srt.mem_cache.hicache_storage import STORAGE_BATCH_SIZE
from sglang.srt.mem_cache.utils import get_storage_hash_str

from bsr_io.integrations.sglang.backend import BsrHiCacheStorage


def _controller(backend: BsrHiCacheStorage) -> HiCacheController:
    ctl = object.__new__(HiCacheController)
    ctl.storage_backend = backend
    ctl.mem_pool_host = ctl.storage_host_pool = backend.mem_pool_host
    ctl.page_size = backend.mem_pool_host.page_size
    ctl.page_get_func = ctl._page_get_zero_copy
    ctl.page_set_func = ctl._page_set_zero_copy
    ctl.prefetch_sync_queue = queue.Queue()
    return ctl


def test_backup_then_prefetch_through_sglangs_controller(store_dir: Path, host_layout: str) -> None:
    page = mha_pool(host_layout).page_size
    pages = STORAGE_BATCH_SIZE + 12  # more than one of SGLang's storage batches
    tokens = list(range(1000, 1000 + pages * page))
    hashes = get_storage_hash_str(tokens, None, page_size=page)
    assert len(hashes) == pages

    src = mha_pool(host_layout, tokens=2 * pages * page)
    at = torch.arange(page, (pages + 1) * page)
    fill(src, at, seed=3)
    writer = make_backend(store_dir, src)
    backup = StorageOperation(at, tokens, hash_value=hashes)
    _controller(writer)._page_backup(backup)
    assert backup.completed_tokens == pages * page
    writer.close()

    dst = mha_pool(host_layout, tokens=2 * pages * page)
    reader = make_backend(store_dir, dst)
    ctl = _controller(reader)
    op = PrefetchOperation("req-1", tokens)
    found, hit_tokens = ctl._storage_hit_query(op)
    assert hit_tokens == pages * page and found == hashes
    op.hash_value = found
    op.host_indices = torch.arange(pages * page, 2 * pages * page)
    assert ctl._page_transfer(op) == pages
    assert page_bytes(dst, op.host_indices) == page_bytes(src, at)
    assert ctl.prefetch_sync_queue.qsize() == 2  # one ack per storage batch
    reader.close()


def test_a_prompt_sharing_only_a_prefix_hits_that_prefix(store_dir: Path) -> None:
    src = mha_pool("page_first")
    page = src.page_size
    tokens = list(range(8 * page))
    at = torch.arange(page, 9 * page)
    fill(src, at, seed=4)
    b = make_backend(store_dir, src)
    _controller(b)._page_backup(
        StorageOperation(at, tokens, hash_value=get_storage_hash_str(tokens, None, page_size=page))
    )
    other = tokens[: 5 * page] + [7] * (3 * page)
    _found, hit = _controller(b)._storage_hit_query(PrefetchOperation("req-2", other))
    assert hit == 5 * page
    b.close()
