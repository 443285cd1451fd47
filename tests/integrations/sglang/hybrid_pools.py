"""SGLang's host pool sets of hybrid models, built on the CPU with SGLang's own classes.

- `swa`: a sliding-window model: the full-attention KV pool and an SWA pool, both
  `MHATokenToKVPoolHost` (SGLang's `build_kv_host_pool` for each), the SWA one
  trailing (only the window that ends a prefix is kept).
- `mamba`: a Mamba hybrid: the KV pool and SGLang's `MambaPoolHost` (one state slot
  per page key, page size 1 whatever the KV's), trailing with a window of one.
- `dsv4`: DeepSeek-V4's set as `hybrid_pool_assembler` builds it: a `LogicalHostPool`
  KV anchor (indices only) and `DeepSeekV4PagedHostPool`s for the C4 and C128
  compressed KV, the C4 indexer (all pages, KV-derived) and the SWA window (trailing).
  Their "device" buffers are CPU tensors of the shapes the assembler passes. The C4
  state pools (`DeepSeekV4StateHostPool`) need SGLang's device `CompressStatePool`,
  which its CPU code cannot build: not in this set.
"""

from __future__ import annotations

import ctypes
from dataclasses import dataclass
from typing import Any

import torch
from pools import mha_pool
from sglang.srt.mem_cache.device_pool_info import MambaStateBufferInfo
from sglang.srt.mem_cache.hicache_storage import PoolHitPolicy, PoolTransfer
from sglang.srt.mem_cache.memory_pool_host import DeepSeekV4PagedHostPool, LogicalHostPool
from sglang.srt.mem_cache.pool_host.mamba import MambaPoolHost

ALL, TRAILING = PoolHitPolicy.ALL_PAGES, PoolHitPolicy.TRAILING_PAGES
HOST_PAGES = 24  # pages each pool holds (small: a few KiB to a few hundred per page)


@dataclass
class Sidecar:
    name: str
    pool: Any
    policy: PoolHitPolicy
    window: int = 0  # TRAILING: pages its window holds


@dataclass
class PoolSet:
    kv: Any  # the anchor (logical for DeepSeek-V4)
    sidecars: list[Sidecar]

    def sidecar(self, name: str) -> Sidecar:
        return next(s for s in self.sidecars if s.name == name)


def _dsv4(name: str, page: int, layers: int, item_bytes: int) -> DeepSeekV4PagedHostPool:
    # The assembler passes the device pool's per-layer buffers; CPU tensors here.
    device = [torch.zeros(HOST_PAGES, item_bytes, dtype=torch.uint8) for _ in range(layers)]
    return DeepSeekV4PagedHostPool(
        name, device, item_bytes, HOST_PAGES, page, layout="page_first", pin_memory=False
    )


def mamba_pool(slots: int = HOST_PAGES) -> MambaPoolHost:
    """SGLang's Mamba host pool: 2 layers of a (4, 16) fp32 temporal and a (3, 32) bf16
    conv state per slot."""
    info = MambaStateBufferInfo(
        temporal=torch.zeros(2, slots, 4, 16, dtype=torch.float32),
        conv=(torch.zeros(2, slots, 3, 32, dtype=torch.bfloat16),),
    )
    return MambaPoolHost(
        info, 1.0, 0, device_capacity=slots, pin_memory=False, device="cpu", layout="page_first"
    )


def build(kind: str, page: int) -> PoolSet:
    tokens = HOST_PAGES * page // 2  # the host pool holds twice the device's
    if kind == "swa":
        return PoolSet(
            mha_pool("page_first", tokens=tokens, page=page),
            [Sidecar("swa", mha_pool("page_first", tokens=tokens, page=page), TRAILING, 2)],
        )
    if kind == "mamba":
        return PoolSet(
            mha_pool("page_first", tokens=tokens, page=page),
            [Sidecar("mamba", mamba_pool(), TRAILING, 1)],
        )
    if kind == "dsv4":
        row = max(64, page * 8)  # bytes of a page row per layer
        return PoolSet(
            LogicalHostPool(HOST_PAGES * page, page, layout="page_first"),
            [
                Sidecar("deepseek_v4_c4", _dsv4("deepseek_v4_c4", page, 2, row), ALL),
                Sidecar(
                    "deepseek_v4_c4_indexer",
                    _dsv4("deepseek_v4_c4_indexer", page, 2, row // 2),
                    ALL,
                ),
                Sidecar("deepseek_v4_c128", _dsv4("deepseek_v4_c128", page, 2, 64), ALL),
                Sidecar("swa", _dsv4("swa", page, 2, row), TRAILING, 2),
            ],
        )
    raise ValueError(kind)


def slots(pool: Any, pages: list[int]) -> torch.Tensor:
    """Host indices of `pages` (page numbers) in `pool` (Mamba: one slot each)."""
    p = int(pool.page_size)
    return torch.cat([torch.arange(q * p, (q + 1) * p) for q in pages])


def transfer(s: Sidecar, keys: list[str], pages: list[int]) -> PoolTransfer:
    return PoolTransfer(
        name=s.name, host_indices=slots(s.pool, pages), keys=list(keys), hit_policy=s.policy
    )


def _runs(pool: Any, pages: list[int]) -> list[list[tuple[int, int]]]:
    """Each page's (address, size) runs, as SGLang's own page meta gives them."""
    out = []
    for q in pages:
        ptrs, sizes = pool.get_page_buffer_meta(slots(pool, [q]))
        out.append([(int(a), int(n)) for a, n in zip(ptrs, sizes, strict=True)])
    return out


def fill(pool: Any, pages: list[int], seed: int) -> None:
    g = torch.Generator().manual_seed(seed)
    for runs in _runs(pool, pages):
        for addr, n in runs:
            data = torch.randint(0, 256, (n,), generator=g, dtype=torch.uint8).numpy().tobytes()
            ctypes.memmove(addr, data, n)


def page_bytes(pool: Any, pages: list[int]) -> list[bytes]:
    return [b"".join(ctypes.string_at(a, n) for a, n in runs) for runs in _runs(pool, pages)]
