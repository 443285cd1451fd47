"""The connector refuses configurations it cannot honour, with a message saying why.

Real vLLM config objects (KVTransferConfig, CacheConfig, ParallelConfig). Real engines
that refuse, and what their caller sees, are in test_early_refusal.py.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
from vllm.config import CacheConfig, KVTransferConfig, ParallelConfig

from bsr_io.integrations.vllm.config import ConfigError, ConnectorConfig


def _vllm_config(policy="recompute", prefix=True, block=32, parallel=None, **extra):
    return SimpleNamespace(
        kv_transfer_config=KVTransferConfig(
            kv_connector="BsrIoConnector",
            kv_role="kv_both",
            kv_load_failure_policy=policy,
            kv_connector_extra_config=extra,
        ),
        cache_config=CacheConfig(block_size=block, enable_prefix_caching=prefix),
        parallel_config=parallel or ParallelConfig(),
    )


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"policy": "fail", "store_dir": "/s"}, '"kv_load_failure_policy": "recompute"'),
        ({"prefix": False, "store_dir": "/s"}, "--enable-prefix-caching"),
        ({"store_dir": "/s", "chunk_tokens": 48}, "not a whole number of vLLM blocks"),
        ({}, "store_dir"),
        ({"store_dir": "/s", "windw": 3}, "unknown kv_connector_extra_config keys ['windw']"),
        ({"store_dir": "/s", "window": 0}, "window must be an int >= 1"),
        ({"store_dir": "/s", "window": None}, "window must be an int >= 1, got None"),
        ({"store_dir": "/s", "chunk_tokens": None}, "chunk_tokens must be an int >= 1"),
        ({"store_dir": "/s", "io_cpus": "3-1"}, 'io_cpus must be "auto", "inherit" or a CPU'),
        (
            {
                "store_dir": "/s",
                "parallel": ParallelConfig(tensor_parallel_size=2, decode_context_parallel_size=2),
            },
            "decode_context_parallel_size must be 1",
        ),
    ],
)
def test_refuses_with_a_clear_message(kwargs, message):
    with pytest.raises(ConfigError) as err:
        ConnectorConfig.from_vllm(_vllm_config(**kwargs))
    assert message in str(err.value)


def test_accepts_errors_only_when_asked():
    cfg = ConnectorConfig.from_vllm(
        _vllm_config(policy="fail", store_dir="/s", accept_load_errors=True, chunk_tokens=64)
    )
    assert (cfg.store_dir, cfg.chunk_tokens) == ("/s", 64)
