"""vLLM KV cache configurations built by vLLM's own code, without an engine.

`get_kv_cache_config_from_groups` (vLLM's allocator planning) places the layers of
real spec objects in one backing allocation, and `allocate_kv_cache` (vLLM's worker
allocation) makes the per-layer views a connector is handed: the same objects and
strides an engine produces, for models this machine cannot run (DeepSeek-V4 needs
AMX) or shapes a test wants to vary. The vLLM config around them is the few fields
those two functions read.
"""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import torch
from vllm.config.cache import CacheConfig
from vllm.v1.kv_cache_interface import (
    FullAttentionSpec,
    KVCacheGroupSpec,
    KVCacheSpec,
    MambaSpec,
    MLAAttentionSpec,
    SlidingWindowMLASpec,
    SlidingWindowSpec,
    UniformTypeKVCacheSpecs,
)
from vllm.v1.kv_cache_layout import KVCacheLayout
from vllm.v1.worker.utils import allocate_kv_cache

try:  # vLLM 0.33 moved the planner out of kv_cache_utils (checked against 0.32's types)
    from vllm.v1.core.kv_cache_planning import (  # type: ignore[import-not-found, unused-ignore]
        get_kv_cache_config_from_groups,
    )
except ImportError:  # vLLM 0.32
    from vllm.v1.core.kv_cache_utils import get_kv_cache_config_from_groups


def _vllm_config(layout: str) -> Any:
    # A stand-in for vLLM's CacheConfig (its unbound method reads these fields only).
    cache: Any = SimpleNamespace(
        kv_cache_layout=layout, prefix_cache_retention_interval=None, num_gpu_blocks_override=None
    )
    cache.get_resolved_kv_cache_layout = lambda: CacheConfig.get_resolved_kv_cache_layout(cache)
    return SimpleNamespace(
        cache_config=cache, attention_config=SimpleNamespace(hisparse_config=None)
    )


def plan(
    groups: list[KVCacheGroupSpec], num_blocks: int, layout: str, alignment: int | None = None
) -> Any:
    """vLLM's KVCacheConfig for `groups` with `num_blocks` blocks."""
    cfg = _vllm_config(layout)
    cfg.cache_config.num_gpu_blocks_override = num_blocks
    out = get_kv_cache_config_from_groups(cfg, groups, 1 << 40)
    out.kv_cache_layout = layout
    out.cache_hit_alignment_tokens = alignment
    return out


def allocate(kv_cache_config: Any) -> dict[str, torch.Tensor]:
    """The per-layer tensors vLLM's worker would register, on the CPU."""
    layout = KVCacheLayout[kv_cache_config.kv_cache_layout]
    return allocate_kv_cache(kv_cache_config, torch.device("cpu"), layout)


def _layer(i: int) -> str:
    return f"model.layers.{i}.self_attn.attn"


def gemma3(num_blocks: int = 24, layout: str = "LBHNC") -> Any:
    """The tiny Gemma 3's groups (vllm-hybrid.md): two sliding groups (layers 0,3 and
    1,4; window 256) and one full group (2,5); block 128, 1 KV head of 64, bf16."""
    sw = SlidingWindowSpec(
        block_size=128, num_kv_heads=1, head_size=64, dtype=torch.bfloat16, sliding_window=256
    )
    fa = FullAttentionSpec(block_size=128, num_kv_heads=1, head_size=64, dtype=torch.bfloat16)
    groups = [
        KVCacheGroupSpec([_layer(0), _layer(3)], sw),
        KVCacheGroupSpec([_layer(1), _layer(4)], sw),
        KVCacheGroupSpec([_layer(2), _layer(5)], fa),
    ]
    return plan(groups, num_blocks, layout, alignment=128)


def with_mamba(num_blocks: int = 8) -> Any:
    """A full group and a recurrent-state group (a Mamba-style hybrid)."""
    fa = FullAttentionSpec(block_size=16, num_kv_heads=1, head_size=64, dtype=torch.bfloat16)
    ssm = MambaSpec(
        block_size=16,
        shapes=((4, 512),),
        dtypes=(torch.bfloat16,),
        page_size_padded=fa.page_size_bytes,
    )
    groups = [KVCacheGroupSpec([_layer(0)], fa), KVCacheGroupSpec([_layer(1)], ssm)]
    return plan(groups, num_blocks, "LBHNC", alignment=16)


def dsv4(num_blocks: int = 12, layout: str = "BLHNC") -> Any:
    """DeepSeek-V4's six groups (vllm-hybrid.md's table), two layers per kind, packed
    block-first: three sliding-window caches (fp8_ds_mla, 584 B per token, block 64,
    window 128); compressed MLA (ratio 4 and 128) with the indexer's keys (block 256);
    the compressor states of the ratio-4 layers (block 4, fp32) and of the ratio-128
    layers (block 8, fp32). Specs as vLLM's DeepSeek-V4 layers make them."""
    u8 = torch.uint8

    def swa() -> SlidingWindowMLASpec:
        return SlidingWindowMLASpec(
            block_size=64,
            num_kv_heads=1,
            max_tp_shards=1,
            head_size=512,
            dtype=u8,
            sliding_window=128,
            cache_dtype_str="fp8_ds_mla",
            state_content_bytes=584,
            alignment=576,
            model_version="deepseek_v4",
        )

    def mla(
        ratio: int, head: int = 512, content: int | None = 584, dtype: torch.dtype = u8
    ) -> MLAAttentionSpec:
        return MLAAttentionSpec(
            block_size=256,
            num_kv_heads=1,
            max_tp_shards=1,
            head_size=head,
            dtype=dtype,
            tokens_per_state=ratio,
            cache_dtype_str="fp8_ds_mla",
            alignment=576,
            model_version="deepseek_v4",
            state_content_bytes=content,
        )

    def state(block: int, dim: int, window: int) -> SlidingWindowMLASpec:
        return SlidingWindowMLASpec(
            block_size=block,
            num_kv_heads=1,
            max_tp_shards=1,
            head_size=dim,
            dtype=torch.float32,
            sliding_window=window,
            alignment=576,
        )

    names = [f"model.layers.{i}" for i in range(4)]
    c4, c128 = names[:2], names[2:]
    compressed: dict[str, KVCacheSpec] = {
        f"{n}.attn.compressed": mla(4 if n in c4 else 128) for n in names
    }
    compressed |= {f"{n}.attn.indexer": mla(4, head=132, content=None) for n in c4}
    s4: dict[str, KVCacheSpec] = {f"{n}.attn.compressor.state": state(4, 2048, 8) for n in c4}
    s4 |= {f"{n}.attn.indexer.compressor.state": state(4, 512, 8) for n in c4}
    s128: dict[str, KVCacheSpec] = {f"{n}.attn.compressor.state": state(8, 1024, 128) for n in c128}
    groups = [KVCacheGroupSpec([f"{n}.attn.swa" for n in names[g::3]], swa()) for g in range(3)]
    groups.append(KVCacheGroupSpec(list(compressed), UniformTypeKVCacheSpecs(256, compressed)))
    groups.append(KVCacheGroupSpec(list(s4), UniformTypeKVCacheSpecs(4, s4)))
    groups.append(KVCacheGroupSpec(list(s128), UniformTypeKVCacheSpecs(8, s128)))
    return plan(groups, num_blocks, layout, alignment=256)
