"""vLLM's KV cache as a bsr-io layout: one allocator group per attention layer.

vLLM allocates each layer's cache as `[num_blocks, ...]` with every block one
contiguous run of bytes when the layer and block dimensions are outermost (the
"LBHNC" and "LBNHC" layouts). bsr-io moves whole blocks and never looks inside
them, so a chunk's payload is, per layer in order, the raw bytes of the chunk's
blocks. The physical layout's name is part of the layout's name, hence of the
fingerprint in every key: records written under one block interior are never
installed into another.
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from typing import Any

import torch

from bsr_io.errors import LayoutError
from bsr_io.layout import AllocatorGroup, KVLayout

# Layouts whose (layer, block) pages are contiguous; the CPU backend supports LBHNC only.
BLOCK_COMPACT = ("LBHNC", "LBNHC")
REQUIRED_LAYOUT = "LBHNC"
_SAFE = re.compile(r"[^A-Za-z0-9_.:-]")


def kv_layout(
    layer_names: Sequence[str],
    *,
    block_tokens: int,
    num_kv_heads: int,
    head_size: int,
    head_size_v: int | None,
    dtype: torch.dtype,
    chunk_tokens: int,
    cache_layout: str,
) -> KVLayout:
    """The per-rank layout of a full-attention model's paged cache in vLLM."""
    if cache_layout not in BLOCK_COMPACT:
        raise LayoutError(
            f"vLLM KV cache layout {cache_layout} does not keep each (layer, block) page "
            f"contiguous; bsr-io needs one of {BLOCK_COMPACT}"
        )
    token_shape = (num_kv_heads, head_size + (head_size_v or head_size))
    groups = tuple(
        AllocatorGroup(_SAFE.sub("_", name)[:128], dtype, token_shape, block_tokens)
        for name in layer_names
    )
    return KVLayout(f"vllm-{cache_layout}", groups, chunk_tokens)


def layout_from_kv_cache_config(kv_cache_config: Any, cache_layout: str, chunk_tokens: int):
    """(layout, layer names in group order) from vLLM's KVCacheConfig."""
    groups = list(kv_cache_config.kv_cache_groups)
    if len(groups) != 1:
        raise LayoutError(
            f"bsr-io's vLLM connector supports one KV cache group (full attention), got "
            f"{len(groups)}; hybrid models are not supported yet"
        )
    spec = groups[0].kv_cache_spec
    for attr in ("num_kv_heads", "head_size", "block_size", "dtype"):
        if not hasattr(spec, attr):
            raise LayoutError(f"KV cache spec {type(spec).__name__} is not an attention spec")
    if getattr(spec, "sliding_window", None):
        raise LayoutError("sliding-window attention groups are not supported yet")
    names = list(groups[0].layer_names)
    layout = kv_layout(
        names,
        block_tokens=int(spec.block_size),
        num_kv_heads=int(spec.num_kv_heads),
        head_size=int(spec.head_size),
        head_size_v=getattr(spec, "head_size_v", None),
        dtype=spec.dtype,
        chunk_tokens=chunk_tokens,
        cache_layout=cache_layout,
    )
    page = getattr(spec, "page_size_bytes", None)
    block_bytes = layout.groups[0].block_tokens * layout.groups[0].token_bytes
    if page is not None and int(page) != block_bytes:
        raise LayoutError(
            f"vLLM pages are {page} bytes but the layout gives {block_bytes} per block "
            "(padded or quantized pages are not supported yet)"
        )
    return layout, names


def block_views(
    kv_caches: Mapping[str, torch.Tensor],
    layer_names: Sequence[str],
    layout: KVLayout,
    num_blocks: int,
) -> list[torch.Tensor]:
    """uint8 views `[num_blocks, block_bytes]` of each layer's cache, in group order.

    Checks what bsr-io relies on: every layer is there, has the layout's dtype, and
    each block is one contiguous run of `block_bytes` at a stride of `block_bytes`.
    """
    views = []
    for name, group in zip(layer_names, layout.groups, strict=True):
        t = kv_caches.get(name)
        if t is None:
            raise LayoutError(f"vLLM registered no KV cache for layer {name}")
        if t.dtype != group.dtype:
            raise LayoutError(f"layer {name}: KV cache dtype {t.dtype}, layout says {group.dtype}")
        bb = group.block_tokens * group.token_bytes
        if not t.is_contiguous():
            raise LayoutError(
                f"layer {name}: KV cache shape {list(t.shape)} strides {list(t.stride())} is "
                "not contiguous; each block must be one run of bytes"
            )
        if t.numel() * t.element_size() != num_blocks * bb:
            raise LayoutError(
                f"layer {name}: KV cache of {t.numel() * t.element_size()} bytes is not "
                f"{num_blocks} blocks of {bb} bytes (shape {list(t.shape)})"
            )
        views.append(t.view(-1).view(torch.uint8).view(num_blocks, bb))
    return views
