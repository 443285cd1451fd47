"""Synthetic, deterministic KV state: the one generator of the demo, the benchmarks and
the tests.

Every byte is a function of its seed components, so a check regenerates what was
stored and compares byte for byte; nothing needs to be kept aside. Bytes come 64
random bits at a time (several times faster than drawing bytes), which matters when a
benchmark writes gigabytes.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import numpy.typing as npt
import torch

from bsr_io.load.kvcache import Destination
from bsr_io.model.keys import ChunkKey, chunk_keys
from bsr_io.model.layout import KVLayout
from bsr_io.tiers.base import Tier

VOCAB = 128_000
_CHUNK = 0xC4  # tells chunk bytes apart from other streams drawn from the same seed


def synthetic_tokens(seed: int, tokens: int) -> npt.NDArray[np.int64]:
    """Deterministic token ids (int64) for `seed`."""
    return np.random.default_rng([seed, 0x70CE]).integers(0, VOCAB, size=tokens, dtype=np.int64)


def fill_random(out: npt.NDArray[np.uint8], *seed: int) -> npt.NDArray[np.uint8]:
    """Fill the 1-D uint8 array `out` (a slot's view, a tensor's bytes) in place with
    bytes determined by `seed`; returns `out`."""
    if out.dtype != np.uint8 or out.ndim != 1:
        raise ValueError(f"fill_random needs a 1-D uint8 array, got {out.ndim}-D {out.dtype}")
    rng = np.random.default_rng(list(seed))
    words = out.size // 8
    out[: words * 8].view(np.uint64)[:] = rng.bit_generator.random_raw(words)
    out[words * 8 :] = rng.integers(0, 256, out.size - words * 8, dtype=np.uint8)
    return out


def fill_chunk(
    out: npt.NDArray[np.uint8], seed: int, index: int, rank: int = 0
) -> npt.NDArray[np.uint8]:
    """Chunk `index` of `rank`'s state for `seed`, written into `out` (a slot's view)."""
    return fill_random(out, seed, rank, index, _CHUNK)


def synthetic_chunk(
    layout: KVLayout, seed: int, index: int, rank: int = 0
) -> npt.NDArray[np.uint8]:
    """Deterministic bytes (uint8, `layout.chunk_bytes`) of chunk `index` on `rank`, so a
    check can regenerate what `fill_state` stored and compare byte for byte."""
    return fill_chunk(np.empty(layout.chunk_bytes, np.uint8), seed, index, rank)


def fill_state(
    target: Tier,
    layout: KVLayout,
    tokens: int,
    seed: int = 0,
    rank: int = 0,
    world_size: int = 1,
    model: str = "synthetic",
) -> tuple[npt.NDArray[np.int64], list[ChunkKey]]:
    """Write a synthetic state of `tokens` tokens (full chunks) into `target`.

    Returns the token ids and the keys written; chunk i holds
    `synthetic_chunk(layout, seed, i, rank)`.
    """
    token_ids = synthetic_tokens(seed, tokens)
    keys = chunk_keys(token_ids, layout, model, rank, world_size)
    for i, key in enumerate(keys):
        target.write(key, synthetic_chunk(layout, seed, i, rank), layout)
    return token_ids, keys


def fill_destination(
    dest: Destination,
    layout: KVLayout,
    chunks: int,
    seed: int,
    rank: int = 0,
    on_chunk: Callable[[int], None] | None = None,
) -> None:
    """Install chunks 0..`chunks`-1 of the synthetic state into `dest` (a prefill's
    stand-in); `on_chunk(i)` after each."""
    buf = np.empty(layout.chunk_bytes, np.uint8)
    for i in range(chunks):
        dest.install(i, torch.from_numpy(fill_chunk(buf, seed, i, rank)))
        dest.synchronize()  # buf is reused for the next chunk
        if on_chunk is not None:
            on_chunk(i)
