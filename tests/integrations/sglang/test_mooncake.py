"""A Mooncake Store pool below the SSD tier (`mooncake.*` in the extra config): pages
are written through to it, and read from it, verified, when the SSD tier lost them.
A real pool on loopback (tests/mooncake_fixtures.py), in a loopback-only namespace."""

from __future__ import annotations

from pathlib import Path

import mooncake_fixtures as mf
import torch
from pools import fill, keys, make_backend, mha_pool, page_bytes

_loopback_ns, netns, pool = mf._loopback_ns, mf.netns, mf.pool


def test_pages_come_from_the_pool_when_the_ssd_tier_lost_them(pool, store_dir: Path) -> None:
    mc = {k: v for k, v in pool.config().to_extra_config(prefix="mooncake.").items()}
    src = mha_pool("page_first")
    at = torch.arange(src.page_size, 5 * src.page_size)
    fill(src, at, seed=21)
    ks = keys(4, "pool")
    writer = make_backend(store_dir, src, **mc)
    assert writer.store is not None and len(writer.store.tiers) == 2
    assert writer.batch_set_v1(ks, at) == [True] * 4
    writer.close()

    dst = mha_pool("page_first")
    reader = make_backend(store_dir, dst, **mc)
    assert reader.store is not None
    ssd = reader.store.tiers[0]
    for k in ks:
        assert ssd.remove(reader._key(k))  # the drive lost every record; the pool has them
    assert reader.batch_get_v1(ks, at) == [True] * 4
    assert page_bytes(dst, at) == page_bytes(src, at)
    reader.close()
