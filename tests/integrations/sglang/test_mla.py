"""MLA: one record per page, written by SGLang's storage writer, read by every TP rank."""

from __future__ import annotations

from pathlib import Path

import torch
from pools import fill, keys, make_backend, mla_pool, page_bytes


def test_mla_pages_round_trip_and_are_shared_by_tp_ranks(store_dir: Path, host_layout: str) -> None:
    n = 5
    src = mla_pool(host_layout)
    at = torch.arange(2 * src.page_size, (2 + n) * src.page_size)
    fill(src, at, seed=11)
    ks = keys(n)
    # TP rank 1 is not the storage writer: it reports success and writes nothing.
    follower = make_backend(store_dir, src, tp_rank=1, tp_size=2, mla=True)
    assert follower.batch_set_v1(ks, at) == [True] * n
    assert follower.batch_exists(ks) == 0
    writer = make_backend(store_dir, src, tp_rank=0, tp_size=2, mla=True)
    assert writer.batch_set_v1(ks, at) == [True] * n
    assert writer.stats["set_written"] == n
    writer.close()
    follower.close()
    for rank in (0, 1):
        dst = mla_pool(host_layout)
        into = torch.arange(40 * dst.page_size, (40 + n) * dst.page_size)
        reader = make_backend(store_dir, dst, tp_rank=rank, tp_size=2, mla=True)
        assert reader.batch_exists(ks) == n
        assert reader.batch_get_v1(ks, into) == [True] * n
        assert page_bytes(dst, into) == page_bytes(src, at)
        reader.close()


def test_an_mha_record_is_a_miss_to_an_mla_pool(store_dir: Path) -> None:
    from pools import mha_pool

    src = mha_pool("page_first")
    at = torch.arange(src.page_size, 3 * src.page_size)
    fill(src, at, seed=1)
    w = make_backend(store_dir, src)
    assert w.batch_set_v1(keys(2), at) == [True, True]
    w.close()
    r = make_backend(store_dir, mla_pool("page_first"))
    assert r.batch_exists(keys(2)) == 0
    assert r.batch_get_v1(keys(2), at) == [False, False]
    r.close()
