"""The vLLM worker's saves into a Mooncake pool (a real pool on loopback, no engine):
its save slots are registered with the pool once, at start, so a put registers nothing.

Registering a payload per put costs two round trips to Mooncake's metadata server
(register, unregister); in a TP=2 engine run on this loaded 2-core machine one of them
timed out ("curl: Timeout was reached" on the segment descriptor PUT) and rank 1's save
failed with "cannot register the payload with the pool: INVALID_PARAMS".
"""

from __future__ import annotations

import sys
from pathlib import Path

import mooncake.store  # noqa: F401  - like vLLM, Mooncake must fail loudly here, never skip

from bsr_io.integrations.vllm import kv_shapes
from bsr_io.integrations.vllm.config import ConnectorConfig
from bsr_io.integrations.vllm.layout import group_layouts
from bsr_io.integrations.vllm.worker import WorkerSide
from bsr_io.model.keys import ChunkKey

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
import mooncake_fixtures as mf  # noqa: E402
from mooncake_fixtures import _loopback_ns, netns  # noqa: E402, F401


class CountingClient:
    """A spy on the real Mooncake client: counts buffer registrations, forwards every call."""

    def __init__(self, client) -> None:
        self._client = client
        self.registered = 0

    def register_buffer(self, addr: int, n: int) -> int:
        self.registered += 1
        return self._client.register_buffer(addr, n)

    def __getattr__(self, name: str):
        return getattr(self._client, name)


def test_saves_into_the_pool_register_no_buffer_per_put(tmp_path, netns):  # noqa: F811
    mf.require_mooncake()
    pool = mf.start_pool(tmp_path / "pool")
    worker = None
    try:
        cfg = ConnectorConfig(
            store_dir=str(tmp_path / "store"), chunk_tokens=256, mooncake=pool.config()
        )
        groups = group_layouts(kv_shapes.gemma3(), 256)
        worker = WorkerSide(cfg, groups, 24, rank=0, world_size=1, model="tiny")
        spy = CountingClient(worker.pool.client)
        worker.pool.client = spy
        g = groups[-1]
        layout = g.record
        keys = [ChunkKey("tiny", 1, 0, g.fingerprint(), 1000 + i) for i in range(6)]
        for i, key in enumerate(keys):
            with worker.save_engine.lease() as slot:  # a save slot, as the save lane's
                slot.fill_from(bytes([i + 1]) * layout.chunk_bytes)
                slot.set_length(layout.chunk_bytes)
                assert worker.save_tier.write(key, slot, layout)
        assert worker.pool.probe(keys) == len(keys)  # written through to the pool...
        assert spy.registered == 0  # ...without registering a buffer for any put
    finally:
        if worker is not None:
            worker.close()
        pool.stop()
