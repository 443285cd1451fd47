"""Pins the LMCache 0.5.6 internals bsr-io's integration relies on.

If LMCache moves one of these, the bounded retrieve or the plugin would break
silently; these tests make that loud instead.
"""

from __future__ import annotations

import inspect

import pytest

pytest.importorskip("lmcache")

from importlib.metadata import version  # noqa: E402

from lmcache.v1.cache_engine import LMCacheEngine, LMCacheEngineBuilder  # noqa: E402
from lmcache.v1.gpu_connector.gpu_connectors import GPUConnectorInterface  # noqa: E402
from lmcache.v1.memory_management import MemoryObj  # noqa: E402
from lmcache.v1.storage_backend import storage_plugin_launcher  # noqa: E402
from lmcache.v1.storage_backend.abstract_backend import (  # noqa: E402
    StorageBackendInterface,
    StoragePluginInterface,
)
from lmcache.v1.storage_backend.local_cpu_backend import LocalCPUBackend  # noqa: E402
from lmcache.v1.storage_backend.storage_manager import StorageManager  # noqa: E402
from lmcache.v1.token_database import ChunkedTokenDatabase  # noqa: E402

from bsr_io.integrations.lmcache.retrieve import unsupported_reasons  # noqa: E402
from bsr_lab.lmcache import harness as h  # noqa: E402


@pytest.fixture
def lmcache_engine():
    engines = h.Engines()
    yield engines
    engines.close()


def params(fn) -> list[str]:
    return list(inspect.signature(fn).parameters)


def test_pinned_version():
    assert version("lmcache") == "0.5.6"


def test_retrieve_signature_we_replace():
    # vLLM's adapter calls engine.retrieve(tokens, mask, **kwargs) and reads a bool mask.
    assert params(LMCacheEngine.retrieve)[:3] == ["self", "tokens", "mask"]
    assert inspect.signature(LMCacheEngine.retrieve).parameters["kwargs"].kind.name == (
        "VAR_KEYWORD"
    )


def test_calls_the_bounded_retrieve_makes():
    assert {"tokens", "mask", "request_configs"} <= set(params(ChunkedTokenDatabase.process_tokens))
    assert params(StorageManager.get_block_mapping) == ["self", "chunk_infos"]
    assert params(StorageManager.batched_get)[:3] == ["self", "keys", "location"]
    assert {"ref_count_down", "get_size"} <= set(dir(MemoryObj))
    assert "busy_loop" in params(LocalCPUBackend.allocate)
    assert isinstance(LMCacheEngineBuilder._instances, dict)


def test_connector_interface_is_what_we_implement():
    assert GPUConnectorInterface.__abstractmethods__ == {
        "to_gpu",
        "from_gpu",
        "batched_to_gpu",
        "batched_from_gpu",
        "get_shape",
    }


def test_plugin_interface_and_launcher():
    assert params(StoragePluginInterface.__init__) == [
        "self",
        "dst_device",
        "config",
        "metadata",
        "local_cpu_backend",
        "loop",
    ]
    assert StorageBackendInterface.__abstractmethods__ == {
        "contains",
        "exists_in_put_tasks",
        "batched_submit_put_task",
        "get_blocking",
        "pin",
        "unpin",
        "remove",
        "get_allocator_backend",
        "close",
    }
    src = inspect.getsource(storage_plugin_launcher)
    assert "storage_plugin.{storage_plugin}.module_path" in src
    assert "storage_plugin.{storage_plugin}.class_name" in src


def test_engine_attributes_the_retriever_reads(lmcache_engine):
    eng = lmcache_engine(l1_chunks=8)
    for name in (
        "token_database",
        "storage_manager",
        "gpu_connector",
        "stats_monitor",
        "config",
        "lookup_pins",
    ):
        assert hasattr(eng, name), name
    assert unsupported_reasons(eng) == []
    assert callable(eng.is_healthy) and eng.is_healthy()
    # The retrieve is looked up on the instance, so an instance attribute shadows it.
    assert "retrieve" not in vars(eng)


def test_stock_retrieve_still_stages_the_whole_plan(lmcache_engine, tmp_path):
    # The premise of the bounded retrieve: stock LMCache hands every hit chunk to the
    # connector in one call after fetching them all. If this ever fails, re-measure.
    shape = h.Shape()
    eng = lmcache_engine(l1_chunks=32, disk=tmp_path)
    src = h.make_state(shape, 12, seed=3)
    h.store_windowed(eng, src, 4)
    h.drop_l1(eng)
    eng.gpu_connector.reset_stats()
    dst = h.empty_like(src)
    mask = eng.retrieve(src.tokens, **dst.kwargs())
    assert int(mask.sum()) == len(src.tokens)
    assert eng.gpu_connector.to_gpu_calls == 1
    assert eng.gpu_connector.max_batch_objs == 12
    assert h.restored_equal(src, dst, len(src.tokens))
