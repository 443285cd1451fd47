"""The connector refuses configurations it cannot honour, with a message saying why.

Real vLLM config objects (KVTransferConfig, CacheConfig, ParallelConfig). Real engines
that refuse, and what their caller sees, are in test_early_refusal.py.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
from vllm.config import CacheConfig, KVTransferConfig, ParallelConfig

from bsr_io.integrations.vllm.config import ConfigError, ConnectorConfig
from bsr_io.integrations.vllm.deadlines import LIMIT_ENV


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


def test_the_deadlines_derive_from_vllms_step_limit(monkeypatch):
    """Every deadline comes from VLLM_EXECUTE_MODEL_TIMEOUT_SECONDS as vLLM reads it:
    the same values as vLLM's own reading, its default when unset."""
    from vllm import envs

    def vllms() -> int:  # vLLM's own reader (not its cache, which engines may have set)
        return int(envs.environment_variables[LIMIT_ENV]())

    monkeypatch.delenv(LIMIT_ENV, raising=False)
    d = ConnectorConfig.from_vllm(_vllm_config(store_dir="/s")).deadlines
    assert d.limit_s == vllms() == 300
    assert (d.step_s, d.write_s, d.hold_s, d.load_s, d.save_s) == (30, 10, 20, 30, 120)
    monkeypatch.setenv(LIMIT_ENV, "40")
    d = ConnectorConfig.from_vllm(_vllm_config(store_dir="/s")).deadlines
    assert d.limit_s == vllms() == 40
    assert (d.step_s, d.write_s, d.hold_s, d.load_s, d.save_s) == (4, 4, 8, 4, 16)
    # A deadline the user set stays theirs.
    cfg = _vllm_config(store_dir="/s", load_timeout_s=7.0, save_timeout_s=9.0)
    d = ConnectorConfig.from_vllm(cfg).deadlines
    assert (d.load_s, d.save_s) == (7.0, 9.0)


@pytest.mark.parametrize(
    ("limit", "extra", "message"),
    [
        (
            "1",
            {"step_save_budget_s": 0.1},
            "step_save_budget_s 0.1 lets one step wait 0.2 s (release, then the window "
            "cuts), more than 0.1 of vLLM's step limit VLLM_EXECUTE_MODEL_TIMEOUT_SECONDS=1 s: "
            "set step_save_budget_s to at most 0.05",
        ),
        ("soon", {}, "VLLM_EXECUTE_MODEL_TIMEOUT_SECONDS='soon' is not a whole number"),
        ("0", {}, "VLLM_EXECUTE_MODEL_TIMEOUT_SECONDS='0': vLLM's step limit must be > 0"),
    ],
)
def test_refuses_waits_that_could_outlast_vllms_step_limit(monkeypatch, limit, extra, message):
    monkeypatch.setenv(LIMIT_ENV, limit)
    with pytest.raises(ConfigError) as err:
        ConnectorConfig.from_vllm(_vllm_config(store_dir="/s", **extra))
    assert message in str(err.value)


def test_the_default_step_budget_fits_a_low_limit(monkeypatch):
    """The control: the same low limit with the default budget starts."""
    monkeypatch.setenv(LIMIT_ENV, "1")
    assert ConnectorConfig.from_vllm(_vllm_config(store_dir="/s")).deadlines.step_s == 0.1
