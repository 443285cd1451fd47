"""KV layouts and allocator groups."""

import pytest
import torch

from bsr_io.errors import LayoutError
from bsr_io.model.layout import AllocatorGroup, KVLayout, preset


def test_deepseek_preset_matches_the_paper():
    lay = preset("deepseek-v4-flash")
    assert lay.token_bytes == 64_096
    assert lay.chunk_tokens == 256
    assert lay.chunk_bytes == 16_408_576
    sizes = {g.token_bytes for g in lay.groups}
    assert len(lay.groups) >= 2 and len(sizes) >= 2
    assert 32 * lay.chunk_bytes == 525_074_432  # W=32: 500.75 MiB


def test_llama_and_tiny_presets():
    lay = preset("llama-3.1-8b")
    assert lay.token_bytes == 131_072 and len(lay.groups) == 1
    tiny = preset("tiny")
    assert len(tiny.groups) >= 2 and tiny.chunk_bytes < 16 * 1024
    assert preset("tiny", chunk_tokens=32).chunk_bytes == 2 * tiny.chunk_bytes
    with pytest.raises(ValueError, match="unknown layout preset"):
        preset("nope")


def test_group_offsets_tile_the_payload():
    lay = preset("deepseek-v4-flash")
    offs = lay.group_offsets()
    pos = 0
    for (off, n), g in zip(offs, lay.groups, strict=True):
        assert off == pos and n == lay.chunk_tokens * g.token_bytes
        pos += n
    assert pos == lay.chunk_bytes
    assert lay.state_bytes(1000) == 3 * lay.chunk_bytes


def test_fingerprint_covers_every_field():
    base = preset("tiny")
    g = base.groups
    changed = [
        KVLayout("tiny2", g, 16),
        KVLayout("tiny", g, 32),
        KVLayout("tiny", (AllocatorGroup("full", torch.bfloat16, (2, 2, 8), 4), *g[1:]), 16),
        KVLayout("tiny", (AllocatorGroup("full", torch.float16, (2, 8, 2), 4), *g[1:]), 16),
        KVLayout("tiny", (AllocatorGroup("full", torch.float16, (2, 2, 8), 8), *g[1:]), 16),
        KVLayout("tiny", (AllocatorGroup("fool", torch.float16, (2, 2, 8), 4), *g[1:]), 16),
        KVLayout("tiny", (g[1], g[0], g[2]), 16),
    ]
    fps = {c.fingerprint() for c in changed}
    assert len(fps) == len(changed) and base.fingerprint() not in fps
    assert preset("tiny").fingerprint() == base.fingerprint()


def test_group_views_round_trip():
    lay = preset("tiny")
    payload = torch.arange(lay.chunk_bytes, dtype=torch.int32).to(torch.uint8)
    views = lay.group_views(payload)
    for g, v in zip(lay.groups, views, strict=True):
        assert v.dtype == g.dtype and tuple(v.shape) == (lay.chunk_tokens, *g.token_shape)
    assert torch.equal(torch.cat([v.reshape(-1).view(torch.uint8) for v in views]), payload)


def test_from_tensors_and_paged_checks():
    tensors = [torch.zeros(10, 4, 2, 3, dtype=torch.float16), torch.zeros(5, 8, 7)]
    lay = KVLayout.from_tensors("mine", tensors, [4, 8], chunk_tokens=16)
    assert lay.token_bytes == 2 * 3 * 2 + 7 * 4
    lay.check_paged(tensors)
    with pytest.raises(LayoutError, match=r"expected dtype float16, got float32"):
        lay.check_paged([tensors[0].float(), tensors[1]])
    with pytest.raises(
        LayoutError, match=r"expected shape \[num_blocks, 4, 2, 3\], got \[10, 4, 3, 2\]"
    ):
        lay.check_paged([tensors[0].view(10, 4, 3, 2), tensors[1]])
    with pytest.raises(LayoutError, match="block_tokens 4 in dim 1"):
        KVLayout.from_tensors("bad", [torch.zeros(3, 2, 5)], 4)
    with pytest.raises(LayoutError, match="has 2 groups"):
        lay.check_paged(tensors[:1])


def test_payload_checks_name_expected_and_given():
    lay = preset("tiny")
    with pytest.raises(LayoutError, match=f"must be {lay.chunk_bytes} bytes, got 10"):
        lay.check_payload(torch.zeros(10, dtype=torch.uint8))
    with pytest.raises(LayoutError, match="uint8"):
        lay.check_payload(torch.zeros(lay.chunk_bytes, dtype=torch.float16))


@pytest.mark.parametrize(
    "make, msg",
    [
        (lambda: AllocatorGroup("a/b", torch.float16, (1,), 4), "group name"),
        (lambda: AllocatorGroup("a", "float16", (1,), 4), "torch.dtype"),
        (lambda: AllocatorGroup("a", torch.float16, (0,), 4), "token_shape"),
        (lambda: AllocatorGroup("a", torch.float16, (1,), 0), "block_tokens"),
        (lambda: KVLayout("x", (), 16), "at least one"),
        (lambda: KVLayout("x", (AllocatorGroup("a", torch.half, (1,), 3),), 16), "divide"),
        (
            lambda: KVLayout("x", (AllocatorGroup("a", torch.half, (1,), 4),) * 2, 16),
            "unique",
        ),
    ],
)
def test_bad_layouts(make, msg):
    with pytest.raises(LayoutError, match=msg):
        make()


def test_from_transformers_config():
    transformers = pytest.importorskip("transformers")
    cfg = transformers.LlamaConfig(
        num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=8, hidden_size=4096
    )
    assert KVLayout.from_transformers_config(cfg).token_bytes == 131_072
    assert KVLayout.from_transformers_config(cfg, world_size=2).token_bytes == 65_536
    with pytest.raises(LayoutError, match="cannot be split"):
        KVLayout.from_transformers_config(cfg, world_size=3)
    hybrid = transformers.LlamaConfig(
        num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2, hidden_size=64
    )
    hybrid.layer_types = ["sliding_attention", "full_attention"] * 2
    lay = KVLayout.from_transformers_config(hybrid, dtype=torch.float16)
    assert lay.group_names() == ["sliding_attention", "full_attention"]
    assert lay.token_bytes == 4 * 2 * 2 * 16 * 2


@pytest.mark.parametrize("config", ["DeepseekV3Config", "DeepseekV2Config"])
def test_from_transformers_config_mla_is_one_latent_per_layer(config):
    transformers = pytest.importorskip("transformers")
    # DeepSeek-V3's own sizes: 61 layers, a 512-wide latent and a 64-wide rotary key.
    cfg = getattr(transformers, config)(
        num_hidden_layers=61,
        num_attention_heads=128,
        num_key_value_heads=128,
        hidden_size=7168,
        kv_lora_rank=512,
        qk_rope_head_dim=64,
        qk_nope_head_dim=128,
        v_head_dim=128,
    )
    one = KVLayout.from_transformers_config(cfg)
    assert one.group_names() == ["compressed_kv"]
    assert one.groups[0].token_shape == (61, 576)
    assert one.token_bytes == 61 * 576 * 2  # 70,272 B/token: not heads x head_dim
    # The latent has no heads to split: every rank holds all of it, under its own name.
    two = KVLayout.from_transformers_config(cfg, world_size=2)
    assert two.token_bytes == one.token_bytes
    assert two.fingerprint() != one.fingerprint()
