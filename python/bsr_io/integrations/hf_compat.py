"""What bsr-io needs to know about a transformers model and its KV cache.

Kept apart from the restore logic because this is the part that follows
transformers releases: 5.x passes the cache as `cache=` and keeps tensors on
`cache.layers[i].keys`; 4.x used `past_key_values=` and `cache.key_cache[i]`.

Types: configs, models and caches carry transformers' classes. What differs between
releases (the cache's tensors, the model's output, 4.x's `from_legacy_cache`) is read
through `Any` here and nowhere else: transformers' annotations describe one release.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from dataclasses import dataclass
from functools import cache as memoize
from typing import TYPE_CHECKING, Any

import torch

from bsr_io.errors import BsrValueError

if TYPE_CHECKING:
    from transformers import Cache, PretrainedConfig, PreTrainedModel


@dataclass(frozen=True)
class AttentionShape:
    """KV geometry of a decoder as transformers caches it: what one token of one layer
    stores in the cache's keys and values, each `[batch, num_kv_heads, seq, dim]`."""

    num_layers: int
    num_kv_heads: int
    key_dim: int
    value_dim: int
    # MLA: one compressed latent that every attention head reads; it has no heads to
    # split, so each tensor-parallel rank holds all of it.
    latent: bool = False


def attention_shape(config: PretrainedConfig) -> AttentionShape:
    """Read the KV geometry from a model config, refusing caches that are not dense.

    Sliding-window and linear-attention layers keep a rolling or recurrent state,
    not one K/V row per prefix token, so chunks of them cannot be restored by position.
    MLA (DeepSeek-V2/V3, `kv_lora_rank`) is one row per token too: transformers 5.x
    caches the normalised latent (`kv_lora_rank` wide) in the keys' place and the
    shared rotary key (`qk_rope_head_dim`) in the values', each as a single head.
    """
    text = config.get_text_config(decoder=True) if hasattr(config, "get_text_config") else config
    layer_types = getattr(text, "layer_types", None) or []
    other = sorted({t for t in layer_types if t != "full_attention"})
    if other or _uses_sliding_window(text):
        kinds = ", ".join(other) or "sliding_attention"
        raise BsrValueError(
            f"{type(config).__name__} has {kinds} layers; bsr-io restores dense full-attention "
            "caches only (set sliding_window=None / use_sliding_window=False)"
        )
    if getattr(text, "kv_lora_rank", None):
        rope = getattr(text, "qk_rope_head_dim", None)
        if not rope:
            raise BsrValueError(
                f"{type(config).__name__} ({getattr(text, 'model_type', '?')}) has "
                f"kv_lora_rank {text.kv_lora_rank} but no qk_rope_head_dim: not an MLA "
                "cache bsr-io knows the shape of"
            )
        return AttentionShape(text.num_hidden_layers, 1, text.kv_lora_rank, rope, latent=True)
    heads = text.num_attention_heads
    kv_heads = getattr(text, "num_key_value_heads", None) or heads
    head_dim = getattr(text, "head_dim", None) or text.hidden_size // heads
    return AttentionShape(text.num_hidden_layers, kv_heads, head_dim, head_dim)


def _uses_sliding_window(text: PretrainedConfig) -> bool:
    if getattr(text, "use_sliding_window", True) is False:
        return False
    return getattr(text, "sliding_window", None) is not None


@memoize
def _cache_kwarg(model_forward: Callable[..., object]) -> str:
    """The cache's keyword in a model class's `forward`, read once per class's forward."""
    params = inspect.signature(model_forward).parameters
    return "cache" if "cache" in params else "past_key_values"


def forward(
    model: PreTrainedModel, input_ids: torch.Tensor, cache: Cache
) -> tuple[torch.Tensor, Cache]:
    """Run `model` on `input_ids` after `cache`; returns (logits, cache)."""
    kwargs = {_cache_kwarg(type(model).forward): cache, "use_cache": True}
    out: Any = model(input_ids=input_ids, **kwargs)  # a ModelOutput; its fields vary
    new_cache = out.cache if hasattr(out, "cache") else out.past_key_values
    return out.logits, new_cache


def kv_tensors(cache: Cache) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Per layer (keys, values), each [batch, kv_heads, seq, head_dim]."""
    # 5.x types a layer's keys as optional (linear attention has none; attention_shape
    # refuses those models); 4.x's key_cache is not in 5.x's types at all.
    any_cache: Any = cache
    if hasattr(any_cache, "layers"):
        return [(layer.keys, layer.values) for layer in any_cache.layers]
    return list(zip(any_cache.key_cache, any_cache.value_cache, strict=True))


def new_cache(
    model: PreTrainedModel, kv: list[tuple[torch.Tensor, torch.Tensor]] | None = None
) -> Cache:
    """A DynamicCache for `model`, holding `kv` (per layer keys, values) if given."""
    from transformers import DynamicCache

    try:
        if kv is None:
            return DynamicCache(config=model.config)
        return DynamicCache(ddp_cache_data=kv, config=model.config)
    except TypeError:  # transformers 4.x: no config argument
        legacy: Any = DynamicCache  # 4.x's from_legacy_cache is gone from 5.x's types
        return DynamicCache() if kv is None else legacy.from_legacy_cache(tuple(kv))
