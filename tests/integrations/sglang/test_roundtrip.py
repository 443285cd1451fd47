"""Pages saved from SGLang's real host pool come back byte for byte into a fresh one."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from pools import fill, keys, make_backend, mha_pool, page_bytes

from bsr_io.integrations.sglang.backend import BsrHiCacheStorage


def _indices(pool, pages: int, start_page: int = 1) -> torch.Tensor:
    # Pages out of order and apart, as SGLang's allocator hands them out.
    order = [start_page + 3 * p + (p % 2) for p in range(pages)]
    return torch.cat([torch.arange(o * pool.page_size, (o + 1) * pool.page_size) for o in order])


def test_factory_builds_the_backend_from_the_dynamic_config(backend: BsrHiCacheStorage) -> None:
    assert type(backend).__name__ == "BsrHiCacheStorage"
    assert backend.store is not None and backend.pages is not None
    assert backend.pages.layout.chunk_tokens == backend.mem_pool_host.page_size


@pytest.mark.parametrize(
    "host_layout", ["page_first", "layer_first", "page_first_direct", "page_head"]
)
def test_set_then_get_into_a_zeroed_pool(store_dir: Path, host_layout: str) -> None:
    src = mha_pool(host_layout)
    at = _indices(src, 9)
    fill(src, at, seed=1)
    ks = keys(9)
    writer = make_backend(store_dir, src)
    assert writer.batch_exists(ks) == 0
    assert writer.batch_set_v1(ks, at) == [True] * 9
    assert writer.batch_exists(ks) == 9
    writer.close()

    # A new process's view: the catalog comes from the store's own scan.
    dst = mha_pool(host_layout)
    into = _indices(dst, 9, start_page=20)
    reader = make_backend(store_dir, dst)
    assert reader.batch_exists(ks) == 9
    assert page_bytes(dst, into) != page_bytes(src, at)
    assert reader.batch_get_v1(ks, into) == [True] * 9
    assert page_bytes(dst, into) == page_bytes(src, at)
    assert reader.stats["get_ok"] == 9
    # Every page went by O_DIRECT straight into the pool's pages (its memory is page-aligned).
    assert reader.stats["direct_pages"] == 9
    reader.close()


def test_through_slots_when_direct_reads_are_off(store_dir: Path) -> None:
    src = mha_pool("layer_first")
    at = _indices(src, 4)
    fill(src, at, seed=6)
    ks = keys(4)
    w = make_backend(store_dir, src)
    assert w.batch_set_v1(ks, at) == [True] * 4
    w.close()
    dst = mha_pool("layer_first")
    r = make_backend(store_dir, dst, direct_reads=False)
    assert r.batch_get_v1(ks, at) == [True] * 4
    assert page_bytes(dst, at) == page_bytes(src, at)
    assert r.stats["direct_pages"] == 0
    r.close()


def test_leading_hits_only(backend: BsrHiCacheStorage) -> None:
    pool = backend.mem_pool_host
    at = _indices(pool, 6)
    fill(pool, at, seed=2)
    ks = keys(6)
    # Pages 0, 1, 2 and 4 stored; 3 is not: SGLang gets the leading three.
    held = [0, 1, 2, 4]
    sel = torch.cat([at[i * pool.page_size : (i + 1) * pool.page_size] for i in held])
    assert backend.batch_set_v1([ks[i] for i in held], sel) == [True] * 4
    assert backend.batch_exists(ks) == 3
    assert backend.batch_get_v1(ks, _indices(pool, 6, start_page=30)) == [True] * 3 + [False] * 3


def test_a_stored_page_is_not_written_again(backend: BsrHiCacheStorage) -> None:
    pool = backend.mem_pool_host
    at = _indices(pool, 4)
    fill(pool, at, seed=3)
    ks = keys(4)
    assert backend.batch_set_v1(ks, at) == [True] * 4
    assert backend.stats["set_written"] == 4
    assert backend.batch_set_v1(ks, at) == [True] * 4
    assert backend.stats["set_written"] == 4
