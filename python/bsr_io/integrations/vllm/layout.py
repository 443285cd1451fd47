"""vLLM's KV cache groups as bsr-io record layouts: one record layout per group.

A vLLM KV cache group is one allocator group: its layers share one block table and one
block size. bsr-io never looks inside a page: a layer's page for a block is
`kv_cache_spec.page_size_bytes` opaque bytes (padded, quantized, float32 state: all the
same to it), at `offset + l * layer_stride + b * block_stride` of the one backing
allocation (vLLM's `KVCacheTensor`). Layer-outermost layouts (LBHNC) and DeepSeek-V4's
block-first packing (BLHNC) both give one contiguous run per (layer, block); anything
else is refused, naming the group and the layer.

Each group's part of a chunk is a record of its own, keyed under the group's own
fingerprint, so discovery and failure are per group:

- "full" (full attention, MLA, DeepSeek's compressed and indexer caches): the record of
  chunk c holds every block of the chunk, every layer;
- "window" (sliding window, and DeepSeek's compressor state, which vLLM also keeps
  through a window): the record at chunk boundary c holds exactly the blocks vLLM keeps
  for a prefix hit ending there, the `cdiv(window - 1 + retained, block)` blocks before
  `(c + 1) * chunk_tokens` (fewer at the start: the missing pages are left zero), so a
  restore reads the same bytes for that group whatever the prefix length;
- anything else (recurrent state, chunked-local, cross attention, unknown specs) is
  refused at start with the group and its spec class named.

A record's `KVLayout` counts pages, not tokens: one AllocatorGroup per layer of
`uint8[page_bytes]` with one page per "token", and `chunk_tokens` = pages per layer in
the record. Its name carries the kind, block size, window, the real chunk size and a
digest of the layers' specs and vLLM's physical layout, so the fingerprint in every key
covers everything that decides the bytes.
"""

from __future__ import annotations

import hashlib
import math
import re
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from bsr_io.errors import LayoutError
from bsr_io.model.layout import AllocatorGroup, KVLayout

# The connector asks for layer-outermost pages; DeepSeek-V4 overrides it with BLHNC.
REQUIRED_LAYOUT = "LBHNC"
FULL = "full"
WINDOW = "window"
_SAFE = re.compile(r"[^A-Za-z0-9_.:-]")


class GroupRefused(LayoutError):
    """A KV cache group the connector cannot restore; the message names it and why."""


@dataclass(frozen=True)
class LayerPages:
    """Where one layer's pages are in vLLM's backing allocation (bytes)."""

    name: str
    page_bytes: int
    offset: int  # block 0's page
    block_stride: int  # from block b to b + 1


@dataclass(frozen=True)
class GroupLayout:
    """One vLLM KV cache group as bsr-io records."""

    index: int  # vLLM's group id (position in block-id tuples)
    kind: str  # FULL | WINDOW
    spec: str  # spec class name, for messages
    block_tokens: int
    window: int  # tokens the group keeps before a restore point (WINDOW); 0 for FULL
    chunk_tokens: int
    layers: tuple[LayerPages, ...]
    replicated: bool  # every TP rank holds the same bytes (vLLM's max_tp_shards == 1)
    record: KVLayout

    @property
    def blocks_per_chunk(self) -> int:
        return self.chunk_tokens // self.block_tokens

    @property
    def record_blocks(self) -> int:
        """Pages per layer in one record."""
        return self.record.chunk_tokens

    @property
    def record_bytes(self) -> int:
        return self.record.chunk_bytes

    def fingerprint(self) -> str:
        return self.record.fingerprint()

    def span(self, chunk: int) -> range:
        """Block positions (of the request's block list) the record of chunk `chunk`
        covers, in payload order; positions below 0 are pages the record leaves zero."""
        end = (chunk + 1) * self.blocks_per_chunk
        return range(end - self.record_blocks, end)

    def key_rank(self, rank: int) -> int:
        """The rank whose records this rank reads: its own, or rank 0's for a group
        every rank holds the same bytes of."""
        return 0 if self.replicated else rank

    def describe(self) -> str:
        what = f"window {self.window} tokens, " if self.kind == WINDOW else ""
        return (
            f"group {self.index} ({self.spec}, {self.kind}, {what}block {self.block_tokens}, "
            f"{len(self.layers)} layers, {self.record_blocks} pages/layer/record, "
            f"{self.record_bytes} B/record{', same on every rank' if self.replicated else ''})"
        )


def _layer_specs(spec: Any, names: Sequence[str]) -> list[tuple[str, Any]]:
    from vllm.v1.kv_cache_interface import UniformTypeKVCacheSpecs

    if isinstance(spec, UniformTypeKVCacheSpecs):
        return [(n, spec.kv_cache_specs[n]) for n in names]
    return [(n, spec) for n in names]


def _kind(index: int, spec: Any) -> tuple[str, int]:
    """(kind, window tokens kept before a restore point) of one layer's spec, or
    GroupRefused naming the group and the spec class."""
    from vllm.v1.kv_cache_interface import (
        FullAttentionSpec,
        MLAAttentionSpec,
        SlidingWindowMLASpec,
        SlidingWindowSpec,
    )

    cls = type(spec)
    name = cls.__name__
    if cls in (FullAttentionSpec, MLAAttentionSpec):
        # A full spec holding a sliding or chunked-local layer (the hybrid allocator
        # off) still keeps every block: restoring all of them is right.
        return FULL, 0
    if cls in (SlidingWindowSpec, SlidingWindowMLASpec):
        if isinstance(spec, SlidingWindowMLASpec) and spec.bounded_replay:
            raise GroupRefused(
                f"KV cache group {index} ({name}) replays its window after a hit "
                "(bounded_replay): vLLM does not prefix-cache it, nor can bsr-io"
            )
        retained = int(getattr(spec, "extra_retained_tokens", 0) or 0)
        return WINDOW, int(spec.sliding_window) - 1 + retained
    raise GroupRefused(
        f"KV cache group {index} holds {name} layers, which bsr-io cannot restore "
        "(supported: FullAttentionSpec, MLAAttentionSpec, SlidingWindowSpec, "
        "SlidingWindowMLASpec); start vLLM without the bsr-io connector for this model"
    )


def _placements(kv_cache_config: Any) -> dict[str, LayerPages]:
    """Each layer's page placement from vLLM's KVCacheTensors (page size filled later)."""
    out: dict[str, LayerPages] = {}
    for t in kv_cache_config.kv_cache_tensors:
        layers = list(getattr(t, "layers", None) or getattr(t, "shared_by", []))
        for li, name in enumerate(layers):
            off = int(getattr(t, "offset", 0)) + li * int(getattr(t, "layer_stride", 0))
            out[name] = LayerPages(name, 0, off, int(getattr(t, "block_stride", 0)))
    return out


def _record_name(
    cache_layout: str,
    kind: str,
    block: int,
    window: int,
    chunk: int,
    specs: Sequence[tuple[str, Any]],
) -> str:
    text = repr([(n, repr(s)) for n, s in specs]) + cache_layout
    digest = hashlib.blake2b(text.encode(), digest_size=6, person=b"bsr-vllm-grp").hexdigest()
    win = f"-w{window + 1}" if kind == WINDOW else ""
    return f"vllm-{cache_layout}-{kind}-b{block}{win}-c{chunk}-{digest}"


def group_layouts(
    kv_cache_config: Any,
    chunk_tokens: int,
    cache_layout: str | None = None,
    replicate_once: bool = True,
) -> list[GroupLayout]:
    """The record layout of every transferable vLLM KV cache group, in group order.
    `replicate_once`: a group every TP rank holds the same bytes of is stored once, by
    rank 0, for all (else each rank stores its own copy: drives local to each node).

    Raises GroupRefused for a group kind bsr-io cannot restore or pages it cannot
    address, ConfigError (config.py) when `chunk_tokens` does not fit the groups."""
    from bsr_io.integrations.vllm.config import check_chunk_tokens

    cache_layout = str(
        cache_layout or getattr(kv_cache_config, "kv_cache_layout", None) or REQUIRED_LAYOUT
    )
    groups = list(kv_cache_config.kv_cache_groups)
    blocks = [int(g.kv_cache_spec.block_size) for g in groups]
    alignment = getattr(kv_cache_config, "cache_hit_alignment_tokens", None)
    check_chunk_tokens(chunk_tokens, blocks, alignment)
    places = _placements(kv_cache_config)
    out: list[GroupLayout] = []
    for gi, g in enumerate(groups):
        if not getattr(g, "enable_kv_transfer", True):
            continue  # an ephemeral replica vLLM rebuilds from its source group
        names = list(g.layer_names)
        specs = _layer_specs(g.kv_cache_spec, names)
        kinds = {_kind(gi, s) for _, s in specs}
        if len(kinds) != 1:
            raise GroupRefused(f"KV cache group {gi} mixes layer kinds {sorted(kinds)}")
        kind, window = kinds.pop()
        block = int(g.kv_cache_spec.block_size)
        layers = []
        for name, spec in specs:
            page = int(spec.page_size_bytes)
            place = places.get(name)
            if place is None:
                raise GroupRefused(
                    f"KV cache group {gi} ({type(spec).__name__}): layer {name} has no "
                    "KVCacheTensor placement; bsr-io cannot address its pages"
                )
            if place.block_stride < page:
                raise GroupRefused(
                    f"KV cache group {gi} ({type(spec).__name__}), layer {name}: pages of "
                    f"{page} B are {place.block_stride} B apart, so a page is not one "
                    f"contiguous run (vLLM layout {cache_layout}); bsr-io needs each "
                    "(layer, block) page contiguous"
                )
            layers.append(LayerPages(name, page, place.offset, place.block_stride))
        per = chunk_tokens // block
        nwin = per if kind == FULL else max(1, -(-window // block))
        record = KVLayout(
            _record_name(cache_layout, kind, block, window, chunk_tokens, specs),
            tuple(
                AllocatorGroup(_SAFE.sub("_", lp.name)[:128], torch.uint8, (lp.page_bytes,), 1)
                for lp in layers
            ),
            nwin,
        )
        replicated = replicate_once and all(
            getattr(s, "max_tp_shards", None) == 1 for _, s in specs
        )
        out.append(
            GroupLayout(
                gi,
                kind,
                type(g.kv_cache_spec).__name__,
                block,
                window,
                chunk_tokens,
                tuple(layers),
                replicated,
                record,
            )
        )
    if not out:
        raise GroupRefused("vLLM's KV cache has no group bsr-io can transfer")
    return out


def hit_alignment(kv_cache_config: Any) -> int:
    """Tokens at which vLLM's prefix hits land (resolved by vLLM, else the lcm of the
    groups' block sizes)."""
    got = getattr(kv_cache_config, "cache_hit_alignment_tokens", None)
    if got:
        return int(got)
    return math.lcm(*(int(g.kv_cache_spec.block_size) for g in kv_cache_config.kv_cache_groups))
