"""The connector's identity, capacity and eviction parts on their own, with real
vLLM config objects, real SSD tiers on disk and real adapter files (no engine).

- Identity: quantization, the KV-cache dtype and overrides such as rope scaling change
  the model identity, which is the same under every hash seed (a set in the config)
  and refused, naming the setting, for a value with no canonical form; a LoRA adapter
  is known by its files' bytes, so one retrained in place gets new keys.
- Capacity: two TP workers' tiers sharing one store directory, each capped, never evict
  each other's records (control: a tier that indexes the whole directory does); a
  touched record (vLLM's local hit, a restore) outlives an untouched one.
- Configuration: Mooncake keys as the LMCache plugin takes them; no `faults` key.
"""

from __future__ import annotations

import os
import subprocess
import sys
import threading
from types import SimpleNamespace

import numpy as np
import pytest
from vllm.config import CacheConfig, KVTransferConfig, ParallelConfig

from bsr_io import Engine
from bsr_io.cli.synthetic import synthetic_chunk
from bsr_io.integrations.vllm.config import ConfigError, ConnectorConfig
from bsr_io.integrations.vllm.identity import key_model, model_identity, request_key_model
from bsr_io.integrations.vllm.ranktier import RankTier
from bsr_io.model.identity import NotCanonical
from bsr_io.model.keys import chunk_keys
from bsr_io.model.layout import preset
from bsr_io.model.record import HEADER_BYTES
from bsr_io.tiers import SSDTier

LAYOUT = preset("tiny")
REC = HEADER_BYTES + LAYOUT.chunk_bytes


# -- identity ------------------------------------------------------------------------------
def _config(quantization=None, cache_dtype="auto", hf_overrides=None, rope=None):
    hf = SimpleNamespace(rope_scaling=rope, rope_theta=10000.0)
    mc = SimpleNamespace(
        model="/m/llama",
        revision=None,
        dtype="torch.bfloat16",
        quantization=quantization,
        quantization_config=None,
        hf_overrides=hf_overrides or {},
        hf_config=hf,
        hf_text_config=hf,
        model_weights="",
        disable_sliding_window=False,
    )
    return SimpleNamespace(model_config=mc, cache_config=CacheConfig(cache_dtype=cache_dtype))


def test_model_identity_covers_what_changes_the_kv():
    base = model_identity(_config())
    assert base == model_identity(_config())  # deterministic (keys survive restarts)
    assert base.startswith("vllm:/m/llama@main:torch.bfloat16;kv=")
    others = {
        "quantization": model_identity(_config(quantization="fp8")),
        "kv dtype": model_identity(_config(cache_dtype="fp8_e4m3")),
        "hf_overrides": model_identity(
            _config(hf_overrides={"rope_scaling": {"rope_type": "yarn", "factor": 4.0}})
        ),
        "rope in config": model_identity(_config(rope={"rope_type": "linear", "factor": 2.0})),
        "user's name": model_identity(_config(), "my-llama-v2"),
    }
    for what, ident in others.items():
        assert ident != base, what
    assert len(set(others.values())) == len(others)
    # The user's name replaces the weights' name, never the KV settings' digest.
    assert model_identity(_config(cache_dtype="fp8_e4m3"), "x") != model_identity(_config(), "x")


_SEEDED = """
from types import SimpleNamespace
from bsr_io.integrations.vllm.identity import model_identity
hf = SimpleNamespace(rope_scaling=None, rope_theta=10000.0)
mc = SimpleNamespace(model="/m/llama", revision=None, dtype="torch.bfloat16", hf_config=hf,
    hf_overrides={"no_rope_layers": {"q_proj", "k_proj", "v_proj", "o_proj", "gate", "up"}})
print(model_identity(SimpleNamespace(model_config=mc, cache_config=SimpleNamespace())))
"""


def test_a_set_in_the_config_gives_one_identity_under_every_hash_seed():
    # The scheduler and each worker are processes with their own hash seeds.
    idents = set()
    for seed in (1, 2, 3):
        env = {**os.environ, "PYTHONHASHSEED": str(seed)}
        run = subprocess.run(
            [sys.executable, "-c", _SEEDED], env=env, capture_output=True, text=True, check=True
        )
        idents.add(run.stdout.strip().splitlines()[-1])
    assert len(idents) == 1, idents


def test_a_config_value_with_no_canonical_form_is_refused_naming_its_key():
    with pytest.raises(NotCanonical, match=r"hf_overrides\.hook\.guard: a lock has no"):
        model_identity(_config(hf_overrides={"hook": {"guard": threading.Lock()}}))


def _adapter(path, weights: bytes) -> str:
    os.makedirs(path, exist_ok=True)
    with open(os.path.join(path, "adapter_config.json"), "w") as f:
        f.write('{"r": 8, "lora_alpha": 16}')
    with open(os.path.join(path, "adapter_model.safetensors"), "wb") as f:
        f.write(weights)
    return str(path)


def _req(lora=None, salt=None, mm=None):
    return SimpleNamespace(cache_salt=salt, lora_request=lora, mm_features=mm, prompt_embeds=None)


def _lora(name, path, int_id=1):
    return SimpleNamespace(lora_name=name, lora_int_id=int_id, lora_path=path)


def test_lora_adapter_known_by_its_weights(tmp_path):
    m = "vllm:/m@main:bf16;kv=0"
    a = _adapter(tmp_path / "a", b"\x01" * 4096)
    b = _adapter(tmp_path / "b", b"\x02" * 4096)
    ka = request_key_model(m, _req(_lora("a", a)))
    kb = request_key_model(m, _req(_lora("b", b, 2)))
    plain = request_key_model(m, _req())
    assert len({ka, kb, plain}) == 3  # two adapters and none: three namespaces
    # Renamed or re-numbered, the same files are the same adapter.
    assert request_key_model(m, _req(_lora("renamed", a, 7))) == ka
    # Retrained in place: same name, path and size, other bytes -> other keys.
    _adapter(tmp_path / "a", b"\x03" * 4096)
    ka2 = request_key_model(m, _req(_lora("a", a)))
    assert ka2 not in (ka, kb, plain)
    # An adapter whose weights cannot be read has no identity: a miss, never a guess.
    assert request_key_model(m, _req(_lora("gone", str(tmp_path / "nowhere")))) is None
    # Multimodal input is a miss too; the salt separates tenants.
    assert request_key_model(m, _req(mm=[object()])) is None
    assert key_model(m, "t1") != key_model(m, "t2") != key_model(m)


# -- capacity: one cap per rank ------------------------------------------------------------
def _keys(rank, n, seed):
    tokens = np.random.default_rng(seed).integers(1, 500, LAYOUT.chunk_tokens * n)
    return chunk_keys(tokens, LAYOUT, "m", rank=rank, world_size=2)


def _held(tier_root, keys):
    probe = SSDTier(tier_root, None, Engine(1, LAYOUT.chunk_bytes))
    try:
        return [probe.contains(k) for k in keys]
    finally:
        probe.engine.close()


def test_ranks_sharing_a_directory_never_evict_each_other(tmp_path):
    def run(root, tier0):
        with Engine(2, LAYOUT.chunk_bytes) as e1:
            t1 = RankTier(root, 3 * REC, e1, world_size=2, ranks={1})
            k1 = _keys(1, 3, 1)
            for i, k in enumerate(k1):
                t1.write(k, synthetic_chunk(LAYOUT, 1, i), LAYOUT)
            t0 = tier0(root)
            for i, k in enumerate(_keys(0, 6, 2)):  # rank 0 saves twice its cap
                t0.write(k, synthetic_chunk(LAYOUT, 2, i), LAYOUT)
            return k1, t0

    with Engine(2, LAYOUT.chunk_bytes) as e0:
        k1, t0 = run(tmp_path / "a", lambda r: RankTier(r, 3 * REC, e0, world_size=2, ranks={0}))
        assert _held(tmp_path / "a", k1) == [True] * 3  # rank 1's records all stayed
        assert len(t0.keys()) == 3  # rank 0 kept within its own cap
        # Control: a tier indexing the whole directory (the old worker) evicts rank 1's.
        k1c, _ = run(tmp_path / "b", lambda r: SSDTier(r, 3 * REC, e0))
        assert not all(_held(tmp_path / "b", k1c))


def test_touched_records_are_evicted_last(tmp_path):
    def run(root, touch):
        with Engine(2, LAYOUT.chunk_bytes) as eng:
            t = RankTier(root, 3 * REC, eng, world_size=2, ranks={0})
            k = _keys(0, 5, 3)
            for i in range(3):
                t.write(k[i], synthetic_chunk(LAYOUT, 3, i), LAYOUT)
            if touch:
                assert t.touch([k[0], k[4]]) == 1  # held: k[0]; k[4] not yet
            t.write(k[3], synthetic_chunk(LAYOUT, 3, 3), LAYOUT)
            return _held(root, k[:4])

    # The leading chunk, touched (as vLLM's local hit or a restore does), survives;
    # the next-oldest goes instead. Control: untouched, the leading chunk goes first.
    assert run(tmp_path / "t", True) == [True, False, True, True]
    assert run(tmp_path / "c", False) == [False, True, True, True]


# -- configuration --------------------------------------------------------------------------
def _vllm_config(**extra):
    return SimpleNamespace(
        kv_transfer_config=KVTransferConfig(
            kv_connector="BsrIoConnector",
            kv_role="kv_both",
            kv_load_failure_policy="recompute",
            kv_connector_extra_config=extra,
        ),
        cache_config=CacheConfig(block_size=32, enable_prefix_caching=True),
        parallel_config=ParallelConfig(),
    )


def test_mooncake_settings_as_the_lmcache_plugin_takes_them():
    cfg = ConnectorConfig.from_vllm(
        _vllm_config(
            store_dir="/s",
            **{
                "bsr.mooncake.master": "127.0.0.1:50051",
                "bsr.mooncake.metadata_server": "http://127.0.0.1:8080/metadata",
                "bsr.mooncake.timeout_s": 2,
            },
        )
    )
    assert cfg.mooncake is not None
    assert (cfg.mooncake.master, cfg.mooncake.timeout_s) == ("127.0.0.1:50051", 2.0)
    assert ConnectorConfig.from_vllm(_vllm_config(store_dir="/s")).mooncake is None
    with pytest.raises(ConfigError, match="mooncake setting 'metadata_server' is required"):
        ConnectorConfig.from_vllm(_vllm_config(store_dir="/s", **{"bsr.mooncake.master": "h:1"}))
    with pytest.raises(ConfigError, match="unknown mooncake setting"):
        ConnectorConfig.from_vllm(
            _vllm_config(
                store_dir="/s",
                **{
                    "bsr.mooncake.master": "h:1",
                    "bsr.mooncake.metadata_server": "x",
                    "bsr.mooncake.mastr": "h:2",
                },
            )
        )


def test_production_config_has_no_faults_key():
    with pytest.raises(ConfigError, match=r"unknown kv_connector_extra_config keys \['faults'\]"):
        ConnectorConfig.from_vllm(_vllm_config(store_dir="/s", faults=[]))
