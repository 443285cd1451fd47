"""bsr-io's storage plugin loaded by the real LMCache 0.5.6 from its config.

Only the GPU is stood in for (`CPUPagedConnector`, LMCache's connector interface over
CPU tensors). Faults are real: record files are corrupted on disk, L1 is really filled.
"""

from __future__ import annotations

import os
import time

import pytest

pytest.importorskip("lmcache")

import torch  # noqa: E402

from bsr_io.integrations.lmcache import retrieve as r  # noqa: E402
from bsr_io.integrations.lmcache.config import Settings, lmcache_settings  # noqa: E402
from bsr_io.integrations.lmcache.plugin import BsrStoragePlugin  # noqa: E402
from bsr_io.model.record import HEADER_BYTES  # noqa: E402
from bsr_lab.lmcache import harness as h  # noqa: E402

SHAPE = h.Shape()
CB = SHAPE.chunk_bytes


def bsr_engine(engines, path, l1_chunks, window, **bsr):
    eng = engines(l1_chunks=l1_chunks, settings=lmcache_settings(path, window=window, **bsr))
    plugin = eng.storage_manager.storage_backends.get("bsr")
    # LMCache only logs plugin load errors: insist the plugin is really there.
    assert isinstance(plugin, BsrStoragePlugin), list(eng.storage_manager.storage_backends)
    return eng, plugin


def corrupt_payload(plugin, key, offset=1000):
    path = plugin.tier.path_of(plugin.chunk_key(key))
    with open(path, "r+b") as f:
        f.seek(HEADER_BYTES + offset)
        b = f.read(1)
        f.seek(HEADER_BYTES + offset)
        f.write(bytes([b[0] ^ 0xFF]))


def test_plugin_loads_from_config_and_installs_bounded_retrieve(engines, tmp_path):
    eng, plugin = bsr_engine(engines, tmp_path, 8, 3)
    assert list(eng.storage_manager.storage_backends) == ["LocalCPUBackend", "bsr"]
    assert plugin.settings.window == 3 and plugin.settings.path == str(tmp_path)
    assert r.installed(eng) is plugin.retriever and plugin.retriever.window == 3
    assert plugin.read_engine.window == 3
    assert plugin.layout.chunk_bytes == CB
    assert plugin.get_allocator_backend() is eng.storage_manager.local_cpu_backend


def test_bad_plugin_config_is_only_logged_by_lmcache(engines, tmp_path):
    cfg = lmcache_settings(tmp_path)
    del cfg["extra_config"]["bsr.path"]
    eng = engines(l1_chunks=8, settings=cfg)  # LMCache swallows the plugin's ValueError
    assert "bsr" not in eng.storage_manager.storage_backends
    assert r.installed(eng) is None
    with pytest.raises(ValueError, match="bsr.path"):
        Settings.from_extra_config(cfg["extra_config"])


def test_settings_parse_sizes_and_reject_bad_values():
    s = Settings.from_extra_config(
        {
            "bsr.path": "/x",
            "bsr.capacity": "2MiB",
            "bsr.window": "4",
            "bsr.bounded_retrieve": "false",
        }
    )
    assert (s.capacity, s.window, s.bounded_retrieve) == (2 << 20, 4, False)
    for bad in ({"bsr.window": 0}, {"bsr.agreement": "some"}, {"bsr.timeout_s": -1}):
        with pytest.raises(ValueError):
            Settings.from_extra_config({"bsr.path": "/x", **bad})


def test_stores_and_restores_through_lmcache_and_after_restart(engines, tmp_path):
    n = 10
    eng, plugin = bsr_engine(engines, tmp_path, 8, 2)
    src = h.make_state(SHAPE, n, seed=5)
    h.store_windowed(eng, src, 4)
    assert plugin.tier.stats()["records"] == n
    h.drop_l1(eng)
    dst = h.empty_like(src)
    assert bool(eng.retrieve(src.tokens, **dst.kwargs()).all())
    assert h.restored_equal(src, dst, len(src.tokens))
    assert plugin.tier.stats()["reads"] == n  # every chunk came from the SSD tier
    assert plugin.retriever.last.locations == {"bsr": n}

    # A new LMCache engine over the same directory finds the records (LocalDiskBackend
    # keeps its index in memory only and would not).
    eng2, plugin2 = bsr_engine(engines, tmp_path, 8, 2)
    dst2 = h.empty_like(src)
    assert bool(eng2.retrieve(src.tokens, **dst2.kwargs()).all())
    assert h.restored_equal(src, dst2, len(src.tokens))


def test_state_8x_l1_restores_with_bsr_where_stock_hangs(engines, tmp_path):
    n, l1, w = 32, 4, 2
    stock = h.run_stock_case(SHAPE, n, l1 * CB, str(tmp_path / "stock"), timeout_s=6.0)
    assert stock["result"] == "hang"

    eng, plugin = bsr_engine(engines, tmp_path / "bsr", l1, w)
    src = h.make_state(SHAPE, n, seed=0)
    h.store_windowed(eng, src, w)
    h.drop_l1(eng)
    eng.gpu_connector.reset_stats()
    dst = h.empty_like(src)
    mask = eng.retrieve(src.tokens, **dst.kwargs())
    assert bool(mask.all())
    assert h.restored_equal(src, dst, len(src.tokens))
    rep = plugin.retriever.last
    assert rep.outcome == "complete" and rep.windows == n // w
    # The window fills and no batch is larger (L1's own peak is capped by its pool in
    # either path, so it measures nothing here).
    assert rep.staging_peak_bytes == w * CB
    assert eng.gpu_connector.max_batch_bytes == w * CB
    assert plugin.read_engine.peak_bytes() == w * plugin.read_engine.slot_bytes


def test_get_returns_filled_prefix_then_none_and_restore_gives_zero(engines, tmp_path):
    n = 6
    eng, plugin = bsr_engine(engines, tmp_path, 12, 4)
    src = h.make_state(SHAPE, n, seed=7)
    h.store_windowed(eng, src, 3)
    keys = h._keys(eng, src.tokens, 0, n)
    corrupt_payload(plugin, keys[3])
    h.drop_l1(eng)

    objs = plugin.batched_get_blocking(keys)
    assert [o is not None for o in objs] == [True] * 3 + [False] * 3
    # What came back was read and filled: equal to what LMCache stored.
    for i, obj in enumerate(objs[:3]):
        ref = torch.empty_like(obj.tensor)
        ct = SHAPE.chunk_tokens
        slots = src.slot_mapping[i * ct : (i + 1) * ct]
        for layer, cache in enumerate(src.kvcaches):
            ref[:, layer] = cache.view(2, -1, ref.shape[-1])[:, slots]
        assert torch.equal(obj.tensor.view(torch.uint8), ref.view(torch.uint8))
        obj.ref_count_down()
    assert plugin.tier.stats()["quarantined"] == 1

    h.drop_l1(eng)
    mask = eng.retrieve(src.tokens, **h.empty_like(src).kwargs())
    assert not bool(mask.any())  # stock would have kept chunks 0-2
    assert plugin.retriever.last.outcome == "zero"
    h.drop_l1(eng)
    assert h.l1_allocated_bytes(eng) == 0


def test_full_l1_gives_none_quickly_instead_of_busy_waiting(engines, tmp_path):
    eng, plugin = bsr_engine(engines, tmp_path, 4, 2)
    src = h.make_state(SHAPE, 2, seed=1)
    h.store_windowed(eng, src, 2)
    h.drop_l1(eng)
    cpu = eng.storage_manager.local_cpu_backend
    held = []
    while (o := cpu.allocate(plugin._shapes, plugin._dtypes, busy_loop=False)) is not None:
        held.append(o)  # L1 full of objects nobody can evict
    t0 = time.monotonic()
    objs = plugin.batched_get_blocking(h._keys(eng, src.tokens, 0, 2))
    assert objs == [None, None]
    assert time.monotonic() - t0 < 5
    assert plugin.read_engine.live_bytes() == 0  # no staging slot left leased
    for o in held:
        o.ref_count_down()
    objs = plugin.batched_get_blocking(h._keys(eng, src.tokens, 0, 2))
    assert all(o is not None for o in objs)
    for o in objs:
        o.ref_count_down()


def test_put_keeps_objects_until_written_and_skips_duplicates(engines, tmp_path):
    eng, plugin = bsr_engine(engines, tmp_path, 8, 2)
    src = h.make_state(SHAPE, 3, seed=2)
    h.store_windowed(eng, src, 3)
    h.store_windowed(eng, src, 3)  # same chunks again: nothing rewritten
    plugin.flush()
    st = plugin.tier.stats()
    assert st["records"] == 3 and st["writes"] == 3
    assert not any(plugin.exists_in_put_tasks(k) for k in h._keys(eng, src.tokens, 0, 3))
    assert os.path.isdir(tmp_path / "chunks")
