"""Layout derivation, the cache Destination and chunk-aligned prefill on real models."""

import os

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")
torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from bsr_io.errors import LayoutError  # noqa: E402
from bsr_io.integrations.hf_compat import forward, kv_tensors, new_cache  # noqa: E402
from bsr_io.integrations.transformers import (  # noqa: E402
    CacheDestination,
    head_shard,
    kv_layout,
    prefill,
)
from bsr_lab.tiny_models import tiny_model  # noqa: E402

FAMILIES = ["llama", "qwen3", "mistral"]


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("world_size", [1, 2, 4])
def test_layout_follows_config_and_rank_shard(family, world_size):
    model = tiny_model(family, layers=3, hidden=64, heads=8, kv_heads=4)
    cfg = model.config
    for rank in range(world_size):
        layout = kv_layout(
            cfg, chunk_tokens=16, dtype=torch.bfloat16, rank=rank, world_size=world_size
        )
        assert layout.group_names() == [f"layer{i}.{kv}" for i in range(3) for kv in "kv"]
        per_rank = cfg.num_key_value_heads // world_size
        assert all(g.token_shape == (per_rank, cfg.head_dim) for g in layout.groups)
        assert all(g.dtype == torch.bfloat16 for g in layout.groups)
        # token-major bytes: layers x (K, V) x heads on this rank x head_dim x 2 bytes
        assert layout.token_bytes == 3 * 2 * per_rank * cfg.head_dim * 2
    fps = {
        kv_layout(cfg, chunk_tokens=16, dtype=torch.bfloat16, world_size=ws).fingerprint()
        for ws in (1, 2, 4)
    }
    assert len(fps) == 3  # a record of one sharding is never read as another's


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_layout_from_a_cache_takes_its_dtype_and_checks_its_shape(dtype):
    model = tiny_model("qwen3", dtype=dtype)
    cache = _cache_of(model, 16)
    layout = kv_layout(model.config, chunk_tokens=16, cache=cache)
    assert {g.dtype for g in layout.groups} == {dtype}
    assert layout == kv_layout(model.config, chunk_tokens=16, dtype=dtype)
    other = tiny_model("qwen3", layers=3).config
    with pytest.raises(ValueError, match="layers, kv heads"):
        kv_layout(other, chunk_tokens=16, cache=cache)
    with pytest.raises(ValueError, match="holds"):
        kv_layout(model.config, chunk_tokens=16, cache=cache, dtype=torch.float32)


def test_head_shards_partition_the_heads():
    shards = [head_shard(8, r, 4) for r in range(4)]
    assert [list(range(8))[s] for s in shards] == [[0, 1], [2, 3], [4, 5], [6, 7]]
    with pytest.raises(ValueError, match="evenly"):
        head_shard(6, 0, 4)


def test_sliding_window_models_are_refused():
    cfg = transformers.MistralConfig(
        num_hidden_layers=2, hidden_size=64, num_attention_heads=4, num_key_value_heads=2
    )
    assert cfg.sliding_window  # the library default: a rolling cache, not one row per token
    with pytest.raises(ValueError, match="sliding"):
        kv_layout(cfg, chunk_tokens=16, dtype=torch.float32)


def _cache_of(model, n):
    ids = torch.randint(
        0, model.config.vocab_size, (n,), generator=torch.Generator().manual_seed(3)
    )
    cache, _ = prefill(model, ids, chunk_tokens=16)
    return cache


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_extract_is_token_major_and_install_touches_only_the_shard(dtype):
    model = tiny_model("llama", heads=8, kv_heads=4, dtype=dtype)
    cache = _cache_of(model, 40)  # 2 whole chunks and a tail
    heads = head_shard(4, 1, 2)
    layout = kv_layout(model.config, chunk_tokens=16, dtype=dtype, rank=1, world_size=2)
    src = CacheDestination.from_cache(layout, cache, heads)
    assert src.capacity_chunks == 2

    empty = [torch.zeros_like(t) for kv in kv_tensors(cache) for t in kv]
    dst = CacheDestination(layout, empty, heads)
    for c in range(2):
        payload = torch.empty(layout.chunk_bytes, dtype=torch.uint8)
        src.extract(c, payload)
        expect = torch.cat(
            [
                t[0, heads, c * 16 : (c + 1) * 16]
                .transpose(0, 1)
                .contiguous()
                .view(-1)
                .view(torch.uint8)
                for kv in kv_tensors(cache)
                for t in kv
            ]
        )
        assert torch.equal(payload, expect)
        assert dst.install(c, payload) is None  # CPU copies are synchronous
    originals = [t for kv in kv_tensors(cache) for t in kv]
    for orig, got in zip(originals, empty, strict=True):
        assert torch.equal(got[:, heads, :32], orig[:, heads, :32])
        assert not got[:, :2].any() and not got[:, heads, 32:].any()  # other ranks, tail


def test_destination_rejects_a_cache_of_another_dtype():
    model = tiny_model("llama")
    cache = _cache_of(model, 16)
    layout = kv_layout(model.config, chunk_tokens=16, dtype=torch.bfloat16)
    with pytest.raises((ValueError, LayoutError), match="bfloat16"):
        CacheDestination.from_cache(layout, cache, head_shard(2, 0, 1))


def test_install_past_the_cache_is_refused():
    model = tiny_model("llama")
    layout = kv_layout(model.config, chunk_tokens=16, dtype=torch.float32)
    dest = CacheDestination.from_cache(layout, _cache_of(model, 20), head_shard(2, 0, 1))
    with pytest.raises(IndexError):
        dest.install(1, torch.zeros(layout.chunk_bytes, dtype=torch.uint8))


@pytest.mark.parametrize("family", FAMILIES)
def test_chunked_prefill_matches_one_pass(family):
    model = tiny_model(family)
    ids = torch.randint(0, 256, (53,), generator=torch.Generator().manual_seed(5))
    chunked, last = prefill(model, ids, chunk_tokens=16)
    with torch.no_grad():
        logits, one_pass = forward(model, ids[None], new_cache(model))
    assert chunked.get_seq_length() == 53
    torch.testing.assert_close(last, logits[:, -1], rtol=1e-4, atol=1e-5)
    for (k1, v1), (k2, v2) in zip(kv_tensors(chunked), kv_tensors(one_pass), strict=True):
        torch.testing.assert_close(k1, k2, rtol=1e-4, atol=1e-5)
        torch.testing.assert_close(v1, v2, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("family", ["DeepseekV3", "DeepseekV2"])
def test_mla_layout_is_the_cached_latent_whole_on_every_rank(family):
    """MLA caches one latent (kv_lora_rank) and one rotary key (qk_rope_head_dim) per
    token per layer, not heads x head_dim: the layout follows the real model's cache."""
    model = tiny_model("deepseek_v3") if family == "DeepseekV3" else None
    cfg = getattr(transformers, f"{family}Config")(
        vocab_size=256,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=3,
        num_attention_heads=4,
        num_key_value_heads=4,
        kv_lora_rank=32,
        q_lora_rank=None,
        qk_rope_head_dim=8,
        qk_nope_head_dim=16,
        v_head_dim=16,
        head_dim=8,
    )
    layouts = [
        kv_layout(cfg, chunk_tokens=16, dtype=torch.bfloat16, rank=r, world_size=2)
        for r in range(2)
    ]
    for layout in layouts:
        assert layout.group_names() == [
            f"layer{i}.{g}" for i in range(3) for g in ("latent", "rope")
        ]
        assert [g.token_shape for g in layout.groups] == [(1, 32), (1, 8)] * 3
        assert layout.token_bytes == 3 * (32 + 8) * 2
    assert layouts[0] == layouts[1]
    if model is not None:  # the real model's cache has exactly this shape
        cache = _cache_of(model, 16)
        layout = kv_layout(model.config, chunk_tokens=16, cache=cache)
        assert [g.token_shape for g in layout.groups] == [(1, 32), (1, 8)] * 2


def test_mla_without_a_rotary_width_is_refused_by_name():
    cfg = transformers.DeepseekV3Config(num_hidden_layers=2, kv_lora_rank=32)
    cfg.qk_rope_head_dim = 0
    with pytest.raises(ValueError, match="deepseek_v3.*qk_rope_head_dim"):
        kv_layout(cfg, chunk_tokens=16, dtype=torch.float32)
