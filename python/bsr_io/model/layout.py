"""KV layouts: one rank's KV state as allocator groups.

An allocator group is one kind of KV state (full attention, sliding window, compressed
KV...) with its own dtype, per-token shape and block size. A chunk's payload is every
group's bytes for `chunk_tokens` tokens, concatenated in group order, token-major
(group g: `[chunk_tokens, *g.token_shape]` of `g.dtype`).
"""

from __future__ import annotations

import hashlib
import json
import math
import re
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from bsr_io.errors import BsrValueError, LayoutError

if TYPE_CHECKING:
    import torch

_NAME_RE = re.compile(r"^[A-Za-z0-9_.:-]{1,128}$")


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


@dataclass(frozen=True, slots=True)
class AllocatorGroup:
    name: str
    dtype: torch.dtype
    token_shape: tuple[int, ...]
    block_tokens: int

    def __post_init__(self) -> None:
        import torch  # on use, not with the module: layout names and sizes do not need it

        if not isinstance(self.name, str) or not _NAME_RE.match(self.name):
            raise LayoutError(
                f"group name must be 1-128 chars of [A-Za-z0-9_.:-], got {self.name!r}"
            )
        if not isinstance(self.dtype, torch.dtype):
            raise LayoutError(f"group {self.name}: dtype must be a torch.dtype, got {self.dtype!r}")
        shape = tuple(self.token_shape)
        if not shape or not all(isinstance(d, int) and d > 0 for d in shape):
            raise LayoutError(
                f"group {self.name}: token_shape must be positive ints, got {self.token_shape!r}"
            )
        object.__setattr__(self, "token_shape", shape)
        if not isinstance(self.block_tokens, int) or self.block_tokens < 1:
            raise LayoutError(
                f"group {self.name}: block_tokens must be a positive int, got {self.block_tokens!r}"
            )

    @property
    def token_bytes(self) -> int:
        return math.prod(self.token_shape) * self.dtype.itemsize

    def check_paged(self, tensor: torch.Tensor) -> None:
        """Raise LayoutError unless `tensor` is this group's paged cache
        `[num_blocks, block_tokens, *token_shape]` of `dtype`."""
        import torch

        want = ("num_blocks", self.block_tokens, *self.token_shape)
        if not isinstance(tensor, torch.Tensor):
            raise LayoutError(f"group {self.name}: expected a torch.Tensor, got {type(tensor)}")
        if tensor.dtype != self.dtype:
            raise LayoutError(
                f"group {self.name}: expected dtype {_dtype_name(self.dtype)}, "
                f"got {_dtype_name(tensor.dtype)}"
            )
        if tensor.dim() != len(want) or tuple(tensor.shape[1:]) != want[1:]:
            raise LayoutError(
                f"group {self.name}: expected shape [{', '.join(map(str, want))}], "
                f"got {list(tensor.shape)}"
            )

    def _canonical(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "dtype": _dtype_name(self.dtype),
            "token_shape": list(self.token_shape),
            "block_tokens": self.block_tokens,
        }


# The payload shape (length, group offsets) of every layout made in this process, by
# fingerprint: a record's key names its layout only by fingerprint, and a record whose
# header disagrees with that layout's shape (a wrong length, other offsets) is corrupt
# even where the reader was not handed the layout (a tier holding several layouts).
_SHAPES: OrderedDict[str, tuple[int, tuple[tuple[int, int], ...]]] = OrderedDict()
_SHAPES_MAX = 4096


def _remember(layout: KVLayout) -> None:
    fp = layout.fingerprint()
    _SHAPES[fp] = (layout.chunk_bytes, tuple(layout.group_offsets()))
    _SHAPES.move_to_end(fp)
    while len(_SHAPES) > _SHAPES_MAX:
        _SHAPES.popitem(last=False)


def shape_of(fingerprint: str) -> tuple[int, tuple[tuple[int, int], ...]] | None:
    """(payload bytes, group offsets) of the layout with `fingerprint`, if this process
    made one (None: unknown here, nothing to check against)."""
    return _SHAPES.get(fingerprint)


@dataclass(frozen=True, slots=True)
class KVLayout:
    name: str
    groups: tuple[AllocatorGroup, ...]
    chunk_tokens: int = 256
    # Computed once: every record's save and read asks for them.
    _fingerprint: str = field(default="", init=False, repr=False, compare=False)
    _token_bytes: int = field(default=0, init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        if not isinstance(self.name, str) or not _NAME_RE.match(self.name):
            raise LayoutError(
                f"layout name must be 1-128 chars of [A-Za-z0-9_.:-], got {self.name!r}"
            )
        groups = tuple(self.groups)
        if not groups or not all(isinstance(g, AllocatorGroup) for g in groups):
            raise LayoutError("a layout needs at least one AllocatorGroup")
        names = [g.name for g in groups]
        if len(set(names)) != len(names):
            raise LayoutError(f"group names must be unique, got {names}")
        object.__setattr__(self, "groups", groups)
        if not isinstance(self.chunk_tokens, int) or self.chunk_tokens < 1:
            raise LayoutError(f"chunk_tokens must be a positive int, got {self.chunk_tokens!r}")
        for g in groups:
            # A chunk must cover whole blocks so it installs into whole destination blocks.
            if self.chunk_tokens % g.block_tokens:
                raise LayoutError(
                    f"group {g.name}: block_tokens {g.block_tokens} does not divide "
                    f"chunk_tokens {self.chunk_tokens}"
                )
        object.__setattr__(self, "_token_bytes", sum(g.token_bytes for g in groups))
        object.__setattr__(self, "_fingerprint", self._digest())
        _remember(self)

    @property
    def token_bytes(self) -> int:
        return self._token_bytes

    @property
    def chunk_bytes(self) -> int:
        return self.chunk_tokens * self._token_bytes

    def group(self, name: str) -> AllocatorGroup:
        for g in self.groups:
            if g.name == name:
                return g
        raise LayoutError(f"layout {self.name} has no group {name!r}; groups: {self.group_names()}")

    def group_names(self) -> list[str]:
        return [g.name for g in self.groups]

    def group_offsets(self) -> list[tuple[int, int]]:
        """(offset, length) of each group's bytes in a chunk payload, in group order."""
        out = []
        off = 0
        for g in self.groups:
            n = self.chunk_tokens * g.token_bytes
            out.append((off, n))
            off += n
        return out

    def state_bytes(self, tokens: int) -> int:
        """Stored bytes for a prefix of `tokens` tokens (full chunks only)."""
        if tokens < 0:
            raise BsrValueError(f"tokens must be >= 0, got {tokens}")
        return (tokens // self.chunk_tokens) * self.chunk_bytes

    def fingerprint(self) -> str:
        """32 hex chars over everything that decides the bytes of a chunk."""
        return self._fingerprint

    def _digest(self) -> str:
        doc = {
            "name": self.name,
            "chunk_tokens": self.chunk_tokens,
            "groups": [g._canonical() for g in self.groups],
        }
        text = json.dumps(doc, sort_keys=True, separators=(",", ":")).encode()
        return hashlib.blake2b(text, digest_size=16, person=b"bsr-layout").hexdigest()

    def group_views(self, payload: torch.Tensor) -> list[torch.Tensor]:
        """Typed views `[chunk_tokens, *token_shape]` of each group in a uint8 chunk payload."""
        self.check_payload(payload)
        views = []
        for g, (off, n) in zip(self.groups, self.group_offsets(), strict=True):
            views.append(
                payload[off : off + n].view(g.dtype).view(self.chunk_tokens, *g.token_shape)
            )
        return views

    def check_payload(self, payload: torch.Tensor) -> None:
        import torch

        if payload.dtype != torch.uint8 or payload.dim() != 1:
            raise LayoutError(
                f"chunk payload must be a 1-D uint8 tensor, got {_dtype_name(payload.dtype)} "
                f"{list(payload.shape)}"
            )
        if payload.numel() != self.chunk_bytes:
            raise LayoutError(
                f"chunk payload of layout {self.name} must be {self.chunk_bytes} bytes, "
                f"got {payload.numel()}"
            )

    def check_paged(self, tensors: Sequence[torch.Tensor]) -> None:
        """Raise LayoutError unless `tensors` are this layout's paged caches, one per group."""
        if len(tensors) != len(self.groups):
            raise LayoutError(
                f"layout {self.name} has {len(self.groups)} groups {self.group_names()}, "
                f"got {len(tensors)} tensors"
            )
        for g, t in zip(self.groups, tensors, strict=True):
            g.check_paged(t)

    def describe(self) -> str:
        parts = [
            f"{g.name}: {_dtype_name(g.dtype)}{list(g.token_shape)} x{g.block_tokens}/block"
            for g in self.groups
        ]
        return (
            f"{self.name}: {self.token_bytes} B/token, {self.chunk_bytes} B/chunk "
            f"({self.chunk_tokens} tokens); " + "; ".join(parts)
        )

    @classmethod
    def from_tensors(
        cls,
        name: str,
        tensors: Sequence[torch.Tensor],
        block_tokens: int | Sequence[int],
        chunk_tokens: int = 256,
        group_names: Sequence[str] | None = None,
    ) -> KVLayout:
        """Layout of paged caches `[num_blocks, block_tokens, *token_shape]`, one per group."""
        import torch

        tensors = list(tensors)
        if not tensors:
            raise LayoutError("from_tensors needs at least one tensor")
        blocks = (
            [block_tokens] * len(tensors) if isinstance(block_tokens, int) else list(block_tokens)
        )
        names = (
            list(group_names) if group_names is not None else [f"g{i}" for i in range(len(tensors))]
        )
        if len(blocks) != len(tensors) or len(names) != len(tensors):
            raise LayoutError(
                f"got {len(tensors)} tensors but {len(blocks)} block sizes and {len(names)} names"
            )
        groups = []
        for i, (t, b, n) in enumerate(zip(tensors, blocks, names, strict=True)):
            if not isinstance(t, torch.Tensor) or t.dim() < 3:
                raise LayoutError(
                    f"tensor {i}: expected [num_blocks, block_tokens, *token_shape], got "
                    f"{list(t.shape) if isinstance(t, torch.Tensor) else type(t)}"
                )
            if t.shape[1] != b:
                raise LayoutError(
                    f"tensor {i}: expected block_tokens {b} in dim 1, got shape {list(t.shape)}"
                )
            groups.append(AllocatorGroup(n, t.dtype, tuple(int(d) for d in t.shape[2:]), b))
        return cls(name, tuple(groups), chunk_tokens)

    @classmethod
    def from_transformers_config(
        cls,
        config: Any,
        world_size: int = 1,
        dtype: torch.dtype | None = None,
        chunk_tokens: int = 256,
        block_tokens: int = 16,
        name: str | None = None,
    ) -> KVLayout:
        """Per-rank layout of a decoder's K/V cache from a transformers config.

        KV heads are split over `world_size` ranks (replicated when fewer than ranks).
        Configs with `layer_types` (hybrid sliding/full attention) get one group per type.
        MLA configs (DeepSeek-V2/V3: `kv_lora_rank`) get one `compressed_kv` group: per
        layer the latent and the rotary key, `kv_lora_rank + qk_rope_head_dim` wide,
        whole on every rank (it has no heads to split). `dtype` None: bfloat16.
        """
        import torch

        if dtype is None:
            dtype = torch.bfloat16
        if world_size < 1:
            raise BsrValueError(f"world_size must be >= 1, got {world_size}")
        cfg = config.get_text_config() if hasattr(config, "get_text_config") else config
        layers = int(cfg.num_hidden_layers)
        label = name or getattr(cfg, "model_type", None) or "transformers"
        label = re.sub(r"[^A-Za-z0-9_.:-]", "_", str(label))[:100]
        if getattr(cfg, "kv_lora_rank", None):
            rope = getattr(cfg, "qk_rope_head_dim", None)
            if not rope:
                raise LayoutError(
                    f"{label}: kv_lora_rank {cfg.kv_lora_rank} without qk_rope_head_dim is "
                    "not an MLA cache bsr-io knows the width of"
                )
            width = int(cfg.kv_lora_rank) + int(rope)
            latent = AllocatorGroup("compressed_kv", dtype, (layers, width), block_tokens)
            return cls(f"{label}-mla-tp{world_size}", (latent,), chunk_tokens)
        heads = int(cfg.num_attention_heads)
        kv_heads = int(getattr(cfg, "num_key_value_heads", None) or heads)
        head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // heads
        if kv_heads % world_size and world_size % kv_heads:
            raise LayoutError(f"{kv_heads} KV heads cannot be split evenly over {world_size} ranks")
        per_rank = max(1, kv_heads // world_size)
        types = list(getattr(cfg, "layer_types", None) or ["full_attention"] * layers)
        counts: dict[str, int] = {}
        for t in types:
            counts[t] = counts.get(t, 0) + 1
        groups = tuple(
            AllocatorGroup(t, dtype, (n, 2, per_rank, int(head_dim)), block_tokens)
            for t, n in counts.items()
        )
        return cls(f"{label}-tp{world_size}", groups, chunk_tokens)


def _deepseek_v4_flash(chunk_tokens: int, block_tokens: int | None) -> KVLayout:
    import torch

    # TP=2, per rank. The paper gives 64,096 B/token/rank; the split into a compressed
    # latent KV group and a sliding-window group is illustrative (two groups, two
    # sizes, two block sizes), the total is exact.
    return KVLayout(
        "deepseek-v4-flash-tp2",
        (
            AllocatorGroup("compressed_kv", torch.bfloat16, (43, 576), block_tokens or 64),
            AllocatorGroup("window_kv", torch.bfloat16, (35, 208), block_tokens or 128),
        ),
        chunk_tokens,
    )


def _llama_31_8b(chunk_tokens: int, block_tokens: int | None) -> KVLayout:
    import torch

    # 32 layers x (K, V) x 8 KV heads x 128 x bf16 = 131,072 B/token, TP=1.
    return KVLayout(
        "llama-3.1-8b-tp1",
        (AllocatorGroup("kv", torch.bfloat16, (32, 2, 8, 128), block_tokens or 16),),
        chunk_tokens,
    )


def _tiny(chunk_tokens: int, block_tokens: int | None) -> KVLayout:
    import torch

    # Three groups of different dtypes and sizes; 132 B/token, so a 16-token chunk is
    # 2,112 bytes: not a multiple of 4096, which exercises O_DIRECT padding.
    return KVLayout(
        "tiny",
        (
            AllocatorGroup("full", torch.float16, (2, 2, 8), block_tokens or 4),
            AllocatorGroup("window", torch.bfloat16, (1, 24), block_tokens or 8),
            AllocatorGroup("state", torch.float32, (5,), block_tokens or 16),
        ),
        chunk_tokens,
    )


PRESETS = {
    "deepseek-v4-flash": (_deepseek_v4_flash, 256),
    "llama-3.1-8b": (_llama_31_8b, 256),
    "tiny": (_tiny, 16),
}


def preset(
    name: str, *, chunk_tokens: int | None = None, block_tokens: int | None = None
) -> KVLayout:
    """A named layout. `chunk_tokens` / `block_tokens` override the preset's sizes."""
    try:
        build, default_chunk = PRESETS[name]
    except KeyError:
        raise BsrValueError(
            f"unknown layout preset {name!r}; choose one of {sorted(PRESETS)}"
        ) from None
    for what, value in (("chunk_tokens", chunk_tokens), ("block_tokens", block_tokens)):
        # None keeps the preset's size; 0 is not "the default" but a mistake.
        if value is not None and (
            isinstance(value, bool) or not isinstance(value, int) or value < 1
        ):
            raise BsrValueError(
                f"{what} must be an int >= 1 (or None: the preset's), got {value!r}"
            )
    return build(default_chunk if chunk_tokens is None else chunk_tokens, block_tokens)
