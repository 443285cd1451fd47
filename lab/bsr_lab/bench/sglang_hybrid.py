"""The sidecar pools of `bsr-lab bench sglang --layout hybrid`: DeepSeek-V4's KV-derived
pools (C4 and C128 compressed KV, the C4 indexer) as SGLang 0.5.23's
`build_deepseek_v4_hicache_stack` builds them, `DeepSeekV4PagedHostPool`s.

Their device pools are stand-ins: CPU tensors of the page-row bytes SGLang's own device
pools give (`DeepSeekV4SingleKVPool.bytes_per_page_padded`: 584 bytes a row, padded to
576-byte units; the FP8 indexer's fused key and scale: 132 bytes a row), at
`page // ratio` rows a page (at least one). Every pool holds every page (all pages).
"""

from __future__ import annotations

from typing import Any

DSV4_KV_ROW, DSV4_KV_PAD, DSV4_INDEXER_ROW = 584, 576, 128 + 4
# (pool name, compression ratio, bytes of one compressed row before padding)
SIDECARS = (
    ("deepseek_v4_c4", 4, DSV4_KV_ROW),
    ("deepseek_v4_c4_indexer", 4, DSV4_INDEXER_ROW),
    ("deepseek_v4_c128", 128, DSV4_KV_ROW),
)


def item_bytes(page: int, ratio: int, row: int) -> int:
    """One layer's bytes of one page of a pool, as SGLang's device pool lays it out."""
    rows = max(1, page // ratio)
    if row == DSV4_KV_ROW:
        return -(-rows * row // DSV4_KV_PAD) * DSV4_KV_PAD
    return rows * row


def sidecars(page: int, layers: int, host_pages: int) -> list[tuple[str, Any]]:
    """Each sidecar's name and host pool (`host_pages` pages, page_first)."""
    import torch
    from sglang.srt.mem_cache.memory_pool_host import DeepSeekV4PagedHostPool

    out = []
    for name, ratio, row in SIDECARS:
        item = item_bytes(page, ratio, row)
        device = [torch.zeros(host_pages, item, dtype=torch.uint8) for _ in range(layers)]
        pool = DeepSeekV4PagedHostPool(
            name, device, item, host_pages, page, layout="page_first", pin_memory=False
        )
        out.append((name, pool))
    return out
