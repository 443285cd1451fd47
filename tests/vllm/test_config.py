"""The connector refuses configurations it cannot honour, with a message saying why.

Real vLLM config objects (KVTransferConfig, CacheConfig, ParallelConfig); one test
starts a real engine with the default failure policy and expects it to refuse.
"""

from __future__ import annotations

import subprocess
import sys
from types import SimpleNamespace

import pytest
from bsr_io.integrations.vllm.config import ConfigError, ConnectorConfig
from vllm.config import CacheConfig, KVTransferConfig, ParallelConfig


def _vllm_config(policy="recompute", prefix=True, block=32, **extra):
    return SimpleNamespace(
        kv_transfer_config=KVTransferConfig(
            kv_connector="BsrIoConnector",
            kv_role="kv_both",
            kv_load_failure_policy=policy,
            kv_connector_extra_config=extra,
        ),
        cache_config=CacheConfig(block_size=block, enable_prefix_caching=prefix),
        parallel_config=ParallelConfig(),
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


def test_real_engine_refuses_the_default_fail_policy(tmp_path):
    code = f"""
from bsr_io.testing import vllm_harness as harness
model = harness.write_tiny_llama({str(tmp_path / "model")!r})
harness.engine(model, 1, connector={{"store_dir": {str(tmp_path / "s")!r}}}, policy="fail")
"""
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=300)  # fmt: skip
    assert proc.returncode != 0
    assert 'Set "kv_load_failure_policy": "recompute"' in proc.stderr
