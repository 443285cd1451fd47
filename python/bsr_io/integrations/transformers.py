"""Save and restore Hugging Face transformers KV caches through bsr-io.

A prefix's cache is stored as chunks of `chunk_tokens` tokens. Each layer's keys
and values are separate allocator groups, token-major `[tokens, kv_heads, head_dim]`:
that is one strided copy per group per chunk into the `[1, heads, seq, dim]`
tensors transformers keeps, and it lets K and V differ in shape. MLA models
(DeepSeek-V2/V3) cache a latent and a rotary key per layer instead, one "head"
each: groups layer{i}.latent and layer{i}.rope, whole on every rank.

Restore is all-or-nothing (the Restorer's commit). Whatever is not restored (a
zero outcome, a short hit, or the tail that is not a whole chunk) is recomputed
by `prefill`, which runs the model in chunk-aligned pieces. When the original
cache was built by the same `prefill`, the restored continuation is the same
computation as the original one, so its logits are bit-identical.

    layout = kv_layout(model.config, chunk_tokens=256, dtype=model.dtype)
    restorer = Restorer(store, layout, window=32, model="my-model")
    cache, _ = prefill(model, prompt_ids, chunk_tokens=256)
    save_prefix(restorer, prompt_ids, cache)
    ...
    cache, result = restore_prefix(restorer, model, prompt_ids)  # later, any process
    logits, cache = forward(model, next_ids[None], cache)
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from typing import TYPE_CHECKING

import torch

from bsr_io.errors import BsrValueError
from bsr_io.integrations.hf_compat import (
    AttentionShape,
    attention_shape,
    forward,
    kv_tensors,
    new_cache,
)
from bsr_io.load.kvcache import Fence
from bsr_io.model.layout import AllocatorGroup, KVLayout

if TYPE_CHECKING:
    from torch.distributed import ProcessGroup
    from transformers import Cache, PretrainedConfig, PreTrainedModel

    from bsr_io.load.discovery import Plan
    from bsr_io.restore import Restorer, RestoreResult


def head_shard(num_kv_heads: int, rank: int, world_size: int) -> slice:
    """The KV heads rank `rank` holds: [r*h/ws, (r+1)*h/ws)."""
    if world_size < 1 or not 0 <= rank < world_size:
        raise BsrValueError(f"rank {rank} is outside world_size {world_size}")
    if num_kv_heads % world_size:
        raise BsrValueError(
            f"{num_kv_heads} KV heads cannot be split evenly across {world_size} ranks"
        )
    per = num_kv_heads // world_size
    return slice(rank * per, (rank + 1) * per)


def rank_heads(shape: AttentionShape, rank: int, world_size: int) -> slice:
    """The cache heads rank `rank` stores: its shard, or all of an MLA latent."""
    if shape.latent:
        if world_size < 1 or not 0 <= rank < world_size:
            raise BsrValueError(f"rank {rank} is outside world_size {world_size}")
        return slice(0, shape.num_kv_heads)
    return head_shard(shape.num_kv_heads, rank, world_size)


def kv_layout(
    config: PretrainedConfig,
    *,
    chunk_tokens: int,
    dtype: torch.dtype | None = None,
    cache: Cache | None = None,
    rank: int = 0,
    world_size: int = 1,
) -> KVLayout:
    """One rank's chunk layout for a model config: groups layer{i}.k and layer{i}.v
    (layer{i}.latent and layer{i}.rope for MLA).

    The dtype is the cache's: pass `cache` (it is also checked against the config)
    or `dtype`. A dense cache has no blocks, so a group's block is the whole chunk.
    """
    shape = attention_shape(config)
    if cache is not None:
        kv = kv_tensors(cache)
        k = kv[0][0]
        found = (len(kv), k.shape[1], k.shape[-1], kv[0][1].shape[-1])
        want = (shape.num_layers, shape.num_kv_heads, shape.key_dim, shape.value_dim)
        if found != want:
            raise BsrValueError(
                f"cache has (layers, kv heads, key dim, value dim) {found}, the config says {want}"
            )
        if dtype is not None and dtype != k.dtype:
            raise BsrValueError(f"dtype {dtype} given, the cache holds {k.dtype}")
        dtype = k.dtype
    if dtype is None:
        raise BsrValueError("kv_layout needs the cache or its dtype")
    shard = rank_heads(shape, rank, world_size)
    heads = shard.stop - shard.start
    kinds = ("latent", "rope") if shape.latent else ("k", "v")
    groups = tuple(
        AllocatorGroup(f"layer{i}.{kind}", dtype, (heads, dim), chunk_tokens)
        for i in range(shape.num_layers)
        for kind, dim in zip(kinds, (shape.key_dim, shape.value_dim), strict=True)
    )
    text = config.get_text_config(decoder=True) if hasattr(config, "get_text_config") else config
    mla = "-mla" if shape.latent else ""
    name = f"hf-{getattr(text, 'model_type', 'decoder')}{mla}-tp{world_size}"
    return KVLayout(name, groups, chunk_tokens)


class CacheDestination:
    """A Destination over per-layer `[1, heads, seq, dim]` key/value tensors.

    Only this rank's head shard is read or written; `tensors` alternate keys and
    values per layer, in the layout's group order.
    """

    def __init__(self, layout: KVLayout, tensors: Sequence[torch.Tensor], heads: slice) -> None:
        if len(tensors) != len(layout.groups):
            raise BsrValueError(f"{len(tensors)} cache tensors for {len(layout.groups)} groups")
        self.layout = layout
        self._views = [t[0, heads] for t in tensors]  # [heads_r, seq, dim], no copy
        self._offsets = layout.group_offsets()
        self.tokens = min(v.shape[1] for v in self._views)
        self.capacity_chunks = self.tokens // layout.chunk_tokens
        for g, v in zip(layout.groups, self._views, strict=True):
            if v.dtype != g.dtype or (v.shape[0], v.shape[2]) != tuple(g.token_shape):
                raise BsrValueError(
                    f"group {g.name} is {tuple(g.token_shape)} {g.dtype}, cache tensor is "
                    f"{tuple(v.shape)} {v.dtype}"
                )

    @classmethod
    def from_cache(cls, layout: KVLayout, cache: Cache, heads: slice) -> CacheDestination:
        tensors = [t for kv in kv_tensors(cache) for t in kv]
        return cls(layout, tensors, heads)

    def _chunk_views(
        self, chunk_index: int, payload: torch.Tensor
    ) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        ct = self.layout.chunk_tokens
        t0 = chunk_index * ct
        if chunk_index < 0 or t0 + ct > self.tokens:
            raise IndexError(f"chunk {chunk_index} is past the cache's {self.tokens} tokens")
        for view, (off, length) in zip(self._views, self._offsets, strict=True):
            heads, _, dim = view.shape
            src = payload[off : off + length].view(view.dtype).view(ct, heads, dim)
            yield view[:, t0 : t0 + ct].transpose(0, 1), src

    def install(self, chunk_index: int, payload: torch.Tensor) -> Fence | None:
        cuda = bool(self._views) and self._views[0].is_cuda
        for cache_part, chunk_part in self._chunk_views(chunk_index, payload):
            if cuda:
                # Contiguous DMA (asynchronous from a CUDA-registered slot), then the
                # token-major to head-major transpose on the device.
                chunk_part = chunk_part.to(cache_part.device, non_blocking=True)
            cache_part.copy_(chunk_part)
        if not cuda:
            return None
        event = torch.cuda.Event()  # type: ignore[no-untyped-call]
        event.record()
        return event  # the window keeps the slot until this fence passes

    def extract(self, chunk_index: int, out: torch.Tensor) -> None:
        for cache_part, chunk_part in self._chunk_views(chunk_index, out):
            chunk_part.copy_(cache_part)

    def synchronize(self) -> None:
        if self._views and self._views[0].is_cuda:
            torch.cuda.synchronize(self._views[0].device)


def prefill(
    model: PreTrainedModel,
    token_ids: torch.Tensor,
    cache: Cache | None = None,
    *,
    chunk_tokens: int,
) -> tuple[Cache, torch.Tensor | None]:
    """Extend `cache` with `token_ids[cached:]`, one chunk-aligned piece per forward.

    Pieces end on multiples of `chunk_tokens` so that a recompute after a restore
    repeats exactly the forwards of the original prefill. Returns (cache, logits of
    the last token, or None when nothing was left to compute).
    """
    ids = token_ids.reshape(1, -1)
    if cache is None:
        cache = new_cache(model)
    pos = cache.get_seq_length()
    logits = None
    with torch.no_grad():
        while pos < ids.shape[1]:
            end = min((pos // chunk_tokens + 1) * chunk_tokens, ids.shape[1])
            logits, cache = forward(model, ids[:, pos:end], cache)
            pos = end
    return cache, None if logits is None else logits[:, -1]


def save_prefix(restorer: Restorer, token_ids: torch.Tensor, cache: Cache) -> int:
    """Store this rank's head shard of every whole chunk `cache` holds of `token_ids`.

    Returns the number of chunks written (chunks already stored are skipped).
    """
    total = _kv_heads(cache)
    if restorer.layout.groups[0].token_shape[0] == total:
        heads = slice(0, total)  # one rank, or an MLA latent that every rank holds whole
    else:
        heads = head_shard(total, restorer.rank, restorer.world_size)
    dest = CacheDestination.from_cache(restorer.layout, cache, heads)
    return restorer.save(_ids(token_ids)[: dest.tokens], dest)


def restore_prefix(
    restorer: Restorer,
    model: PreTrainedModel,
    token_ids: torch.Tensor,
    plan: Plan | None = None,
    group: ProcessGroup | None = None,
) -> tuple[Cache, RestoreResult]:
    """A cache for `model` holding `token_ids`: restored where the store has it, else recomputed.

    Returns (cache, RestoreResult). `plan` is the restorer's probe of `token_ids`
    when the caller has one. Only a complete outcome reaches the cache; with
    world_size > 1 the ranks of `group` (default: the world) then exchange head
    shards so that each holds the whole cache for its (unsharded) model.
    """
    layout = restorer.layout
    if plan is None:
        plan = restorer.probe(_ids(token_ids))
    shape = attention_shape(model.config)
    heads = rank_heads(shape, restorer.rank, restorer.world_size)
    param = next(model.parameters())
    dtype = layout.groups[0].dtype
    if dtype != param.dtype:
        raise BsrValueError(f"the layout stores {dtype}, the model computes in {param.dtype}")
    tensors = [
        torch.empty(1, shape.num_kv_heads, plan.hit_tokens, dim, dtype=dtype, device=param.device)
        for _ in range(shape.num_layers)
        for dim in (shape.key_dim, shape.value_dim)
    ]
    result = restorer.restore(plan, CacheDestination(layout, tensors, heads))
    kv: list[tuple[torch.Tensor, torch.Tensor]] | None = None
    if result.outcome == "complete" and result.committed_tokens > 0:
        if restorer.world_size > 1 and not shape.latent:
            tensors = [_gather_heads(t, heads, group) for t in tensors]
        kv = list(zip(tensors[0::2], tensors[1::2], strict=True))
    cache, _ = prefill(model, token_ids, new_cache(model, kv), chunk_tokens=layout.chunk_tokens)
    return cache, result


def continue_greedy(
    model: PreTrainedModel, cache: Cache, input_ids: torch.Tensor, steps: int
) -> tuple[list[int], torch.Tensor]:
    """Feed `input_ids` after `cache`, then `steps - 1` greedy tokens one at a time.

    Returns (greedy tokens, logits of every forward concatenated over positions).
    """
    tokens: list[int] = []
    logits_all: list[torch.Tensor] = []
    ids = input_ids.reshape(1, -1)
    with torch.no_grad():
        for _ in range(steps):
            logits, cache = forward(model, ids, cache)
            logits_all.append(logits[0])
            tokens.append(int(logits[0, -1].argmax()))
            ids = torch.tensor([[tokens[-1]]], device=ids.device)
    return tokens, torch.cat(logits_all)


def _gather_heads(t: torch.Tensor, heads: slice, group: ProcessGroup | None) -> torch.Tensor:
    import torch.distributed as dist

    shard = t[:, heads].contiguous()
    parts = [torch.empty_like(shard) for _ in range(dist.get_world_size(group))]
    dist.all_gather(parts, shard, group=group)
    return torch.cat(parts, dim=1)


def _kv_heads(cache: Cache) -> int:
    return kv_tensors(cache)[0][0].shape[1]


def _ids(token_ids: torch.Tensor | Sequence[int]) -> list[int]:
    return token_ids.reshape(-1).tolist() if torch.is_tensor(token_ids) else list(token_ids)
