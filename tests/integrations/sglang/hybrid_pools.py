"""SGLang's host pool sets of hybrid models, built on the CPU with SGLang's own classes.

- `swa`: a sliding-window model: the full-attention KV pool and an SWA pool, both
  `MHATokenToKVPoolHost` (SGLang's `build_kv_host_pool` for each), the SWA one
  trailing (only the window that ends a prefix is kept).
- `mamba`: a Mamba hybrid: the KV pool and SGLang's `MambaPoolHost` (one state slot
  per page key, page size 1 whatever the KV's), trailing with a window of one.
- `dsv4`: DeepSeek-V4's paged set as `build_deepseek_v4_hicache_stack` builds it: a
  `LogicalHostPool` KV anchor (indices only); `DeepSeekV4PagedHostPool`s over SGLang's
  own CPU-built device pools for the SWA window (trailing), the C4 and C128 compressed
  KV (`DeepSeekV4SingleKVPool`, `bytes_per_page_padded`) and the C4 indexer (FP8: the
  fused key+scale region `_dsv4_indexer_regions` gives for a `DeepSeekV4IndexerPool`),
  all pages; and `DeepSeekV4StateHostPool`s for the C4 and C4-indexer compress states
  over SGLang's `CompressStatePool`s (trailing, one page: the state ends the prefix).
- `dsv4_fp8`: the unified-FP8 set: C4 and C128 nope rows with their bf16 rope siblings
  (`deepseek_v4_c4_rope`, `deepseek_v4_c128_rope`), and the FP4 indexer split into
  payload and `deepseek_v4_c4_indexer_scale` (all pages; no SWA or state pools, as the
  assembler builds none for unified KV). Stand-ins, said so: SGLang builds the unified
  pool only inside `DeepSeekV4TokenToKVPool`, which needs a published server config, and
  the FP4 split only on HIP or NPU; these device buffers are CPU tensors of the shapes
  `DeepSeekV4UnifiedKVPool._unified_page_views` and the FP4 `DeepSeekV4IndexerPool` give
  (nope rows of `DSV4_FP8_NOPE_ROW_BYTES`, rope rows of 64 bf16), passed through
  SGLang's own `_dsv4_indexer_regions`.
- `dsa`: a DeepSeek sparse-attention (DSA) model: SGLang's MLA host pool over its
  CPU-built `DSATokenToKVPool` as the KV, and the `indexer` pool SGLang registers beside
  it (`DSAIndexerPoolHost`, from `make_dsa_indexer_pool_decl`: the packed FP8 index
  keys and their scales, riding on the KV's pages), all pages.
- Page sizes: SGLang's DeepSeek-V4 pages are 256 tokens; at the tests' 1 and 64 a
  compressed page holds `max(1, page // ratio)` rows (a geometry stand-in).
- Not built: `deepseek_v4_c128_state` (SGLang keeps C128 state per request, not per
  page, and its assembler registers no host pool for it), and the C1/C2 pools of
  other DeepSeek variants.
"""

from __future__ import annotations

import ctypes
from dataclasses import dataclass
from types import SimpleNamespace
from typing import Any

import torch
from pools import mha_pool, mla_host
from sglang.srt.mem_cache.deepseek_v4_compress_state import CompressStatePool
from sglang.srt.mem_cache.deepseek_v4_memory_pool import (
    DSV4_FP8_NOPE_ROW_BYTES,
    DeepSeekV4IndexerPool,
    DeepSeekV4SingleKVPool,
    get_compress_state_ring_size,
)
from sglang.srt.mem_cache.device_pool_info import MambaStateBufferInfo
from sglang.srt.mem_cache.hicache_storage import PoolHitPolicy, PoolTransfer
from sglang.srt.mem_cache.hybrid_cache.hybrid_pool_assembler import _dsv4_indexer_regions
from sglang.srt.mem_cache.memory_pool import DSATokenToKVPool
from sglang.srt.mem_cache.memory_pool_host import (
    DeepSeekV4PagedHostPool,
    DeepSeekV4StateHostPool,
    LogicalHostPool,
)
from sglang.srt.mem_cache.pool_host.dsa import DSAIndexerPoolHost, make_dsa_indexer_pool_decl
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
    mla: bool = False  # the anchor is an MLA pool (SGLang's storage config says so)

    def sidecar(self, name: str) -> Sidecar:
        return next(s for s in self.sidecars if s.name == name)


LAYERS = 2
NOPE, ROPE, INDEX_DIM = 448, 64, 128  # DeepSeek-V4's head dims


def _paged(name: str, buffers: list[torch.Tensor], item_bytes: int, page: int) -> Any:
    """A host pool as the assembler builds one over a device region's page rows."""
    return DeepSeekV4PagedHostPool(
        name, buffers, item_bytes, HOST_PAGES, page, layout="page_first", pin_memory=False
    )


def _rows(page: int, ratio: int) -> int:
    return max(1, page // ratio)


def _compressed(name: str, page: int, ratio: int) -> Any:
    """C4/C128 (ratio 4/128) or SWA (1) KV: SGLang's `DeepSeekV4SingleKVPool` on the CPU."""
    rows = _rows(page, ratio)
    dev = DeepSeekV4SingleKVPool(
        HOST_PAGES * rows, rows, torch.float8_e4m3fn, NOPE, ROPE, LAYERS, "cpu", False
    )
    return _paged(name, dev.kv_buffer, dev.bytes_per_page_padded, page)


def _indexer_fp8(page: int) -> Any:
    dev = DeepSeekV4IndexerPool(
        HOST_PAGES * _rows(page, 4),
        _rows(page, 4),
        torch.bfloat16,
        INDEX_DIM,
        LAYERS,
        "cpu",
        False,
        use_fp4_indexer=False,
    )
    (region,) = _dsv4_indexer_regions(SimpleNamespace(c4_indexer_kv_pool=dev), page)
    return _paged(str(region.name), region.device_buffers, region.item_bytes, page)


def _indexer_fp4(page: int) -> list[Sidecar]:
    """The FP4 split (payload, scale): the FP4 `DeepSeekV4IndexerPool`'s buffer shapes
    (built on HIP only), through SGLang's `_dsv4_indexer_regions`."""
    rows = _rows(page, 4)
    dev = SimpleNamespace(
        has_npu_storage=False,
        index_k_with_scale_buffer=None,
        index_k_payload_buffer=[
            torch.zeros(HOST_PAGES, 1, 4, rows, 16, dtype=torch.uint8) for _ in range(LAYERS)
        ],
        index_k_scale_buffer=[
            torch.zeros(HOST_PAGES, 1, 4, rows, dtype=torch.uint8) for _ in range(LAYERS)
        ],
    )
    regions = _dsv4_indexer_regions(SimpleNamespace(c4_indexer_kv_pool=dev), page)
    return [
        Sidecar(str(r.name), _paged(str(r.name), r.device_buffers, r.item_bytes, page), ALL)
        for r in regions
    ]


def _unified(name: str, page: int, ratio: int, row_bytes: int) -> Any:
    """A unified-FP8 region's page rows (`_unified_page_views`' shape)."""
    item = _rows(page, ratio) * row_bytes
    return _paged(name, [torch.zeros(HOST_PAGES, item, dtype=torch.uint8)] * LAYERS, item, page)


def _state(name: str, page: int, head_dim: int) -> Any:
    """A C4 compress-state host pool over SGLang's `CompressStatePool`s (one per layer)."""
    ring = get_compress_state_ring_size(4)
    states = [
        CompressStatePool(
            HOST_PAGES * ring,
            ring,
            True,  # overlap: C4's state
            head_dim,
            torch.float32,
            "cpu",
            False,
            4,
            swa_page_size=page,
        )
        for _ in range(LAYERS)
    ]
    return DeepSeekV4StateHostPool(
        name, states, HOST_PAGES, page, layout="page_first", pin_memory=False
    )


def _dsv4(page: int) -> list[Sidecar]:
    return [
        Sidecar("deepseek_v4_c4", _compressed("deepseek_v4_c4", page, 4), ALL),
        Sidecar("deepseek_v4_c4_indexer", _indexer_fp8(page), ALL),
        Sidecar("deepseek_v4_c128", _compressed("deepseek_v4_c128", page, 128), ALL),
        Sidecar("swa", _compressed("swa", page, 1), TRAILING, 2),
        Sidecar(
            "deepseek_v4_c4_state", _state("deepseek_v4_c4_state", page, NOPE + ROPE), TRAILING, 1
        ),
        Sidecar(
            "deepseek_v4_c4_indexer_state",
            _state("deepseek_v4_c4_indexer_state", page, INDEX_DIM),
            TRAILING,
            1,
        ),
    ]


def _dsv4_fp8(page: int) -> list[Sidecar]:
    nope, rope = DSV4_FP8_NOPE_ROW_BYTES, ROPE * 2
    return [
        Sidecar("deepseek_v4_c4", _unified("deepseek_v4_c4", page, 4, nope), ALL),
        Sidecar("deepseek_v4_c4_rope", _unified("deepseek_v4_c4_rope", page, 4, rope), ALL),
        *_indexer_fp4(page),
        Sidecar("deepseek_v4_c128", _unified("deepseek_v4_c128", page, 128, nope), ALL),
        Sidecar("deepseek_v4_c128_rope", _unified("deepseek_v4_c128_rope", page, 128, rope), ALL),
    ]


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


def _dsa(tokens: int, page: int) -> PoolSet:
    """DSA: the MLA KV (latent 64 + rope 32) over SGLang's `DSATokenToKVPool` on the CPU,
    and its `indexer` host pool (SGLang asserts the index head dim is 128)."""
    dev = DSATokenToKVPool(
        tokens,
        page,
        64,
        torch.bfloat16,
        32,
        LAYERS,
        "cpu",
        INDEX_DIM,
        False,
        96,
        start_layer=0,
        end_layer=LAYERS - 1,
        index_buf_size=tokens,  # else sized from the published parallel config
    )
    kv = mla_host(dev, "page_first")
    decl = make_dsa_indexer_pool_decl(dev)
    indexer = DSAIndexerPoolHost(decl, kv, pin_memory=False, device="cpu")
    return PoolSet(kv, [Sidecar(str(decl.pool_name), indexer, ALL)], mla=True)


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
    if kind == "dsa":
        return _dsa(tokens, page)
    if kind in ("dsv4", "dsv4_fp8"):
        anchor = LogicalHostPool(HOST_PAGES * page, page, layout="page_first")
        return PoolSet(anchor, _dsv4(page) if kind == "dsv4" else _dsv4_fp8(page))
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
