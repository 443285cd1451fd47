"""The LMCache plugin with a Mooncake Store pool as L3 (`bsr.mooncake.*` in extra_config):
chunks are written through to the pool, and served from it when the SSD tier lost them.
Real LMCache 0.5.6, a real pool on loopback."""

from __future__ import annotations

import os
import subprocess
import sys

import mooncake_fixtures as mf
import pytest

pytest.importorskip("lmcache")
mf.require_mooncake()

from bsr_io.integrations.lmcache.config import Settings, lmcache_settings  # noqa: E402
from bsr_io.integrations.lmcache.plugin import BsrStoragePlugin  # noqa: E402
from bsr_io.tiers.mooncake import MooncakeConfig  # noqa: E402
from bsr_lab.lmcache import harness as h  # noqa: E402

_loopback_ns, netns, pool = mf._loopback_ns, mf.netns, mf.pool
SHAPE = h.Shape()
INNER = "BSR_IO_TEST_INNER"


def test_settings_read_the_pool_keys():
    extra = {
        "bsr.path": "/x",
        "bsr.mooncake.master": "127.0.0.1:5",
        "bsr.mooncake.metadata_server": "http://127.0.0.1:6/metadata",
        "bsr.mooncake.timeout_s": "3",
    }
    s = Settings.from_extra_config(extra)
    assert s.mooncake == MooncakeConfig("127.0.0.1:5", "http://127.0.0.1:6/metadata", timeout_s=3)
    assert Settings.from_extra_config({"bsr.path": "/x"}).mooncake is None
    with pytest.raises(ValueError, match="metadata_server"):
        Settings.from_extra_config({"bsr.path": "/x", "bsr.mooncake.master": "h:1"})


def test_plugin_with_a_pool_in_its_own_interpreter():
    """LMCache's plugin could not join a pool from a process whose earlier Mooncake client
    belonged to another (already stopped) pool: setup hung for 90 s. Serving engines
    have one pool per process; the test gets a fresh interpreter to match."""
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "pytest",
            "-q",
            "-p",
            "no:cacheprovider",
            f"{__file__}::test_plugin_writes_through_to_the_pool_and_reads_it_when_l2_lost_chunks",
        ],
        env={**os.environ, INNER: "1"},
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0 and "1 passed" in proc.stdout, proc.stdout[-3000:]


def test_plugin_writes_through_to_the_pool_and_reads_it_when_l2_lost_chunks(
    engines, pool, tmp_path
):
    if not os.environ.get(INNER):
        pytest.skip("runs in its own interpreter (test_plugin_with_a_pool_in_its_own_interpreter)")
    n = 6
    mc = {k.removeprefix("bsr."): v for k, v in pool.config().to_extra_config().items()}
    eng = engines(l1_chunks=8, settings=lmcache_settings(tmp_path, window=2, **mc))
    plugin = eng.storage_manager.storage_backends.get("bsr")
    assert isinstance(plugin, BsrStoragePlugin), list(eng.storage_manager.storage_backends)
    l2, l3 = plugin.tier.tiers
    src = h.make_state(SHAPE, n, seed=9)
    h.store_windowed(eng, src, 4)
    assert l3.stats()["writes"] == n and l2.stats()["records"] == n
    for key in l2.keys():
        l2.remove(key)  # the SSD tier lost every record; the pool still has them
    h.drop_l1(eng)
    dst = h.empty_like(src)
    assert bool(eng.retrieve(src.tokens, **dst.kwargs()).all())
    assert h.restored_equal(src, dst, len(src.tokens))
    assert l3.stats()["reads"] == n and l2.stats()["reads"] == 0
