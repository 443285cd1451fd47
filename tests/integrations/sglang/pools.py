"""SGLang's real pools and config, built on the CPU for the backend's tests."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from sglang.srt.mem_cache.hicache_storage import HiCacheStorageConfig
from sglang.srt.mem_cache.memory_pool import MHATokenToKVPool, MLATokenToKVPool
from sglang.srt.mem_cache.pool_host.mha import MHATokenToKVPoolHost
from sglang.srt.mem_cache.pool_host.mla import MLATokenToKVPoolHost
from sglang.srt.mem_cache.storage import StorageBackendFactory

from bsr_io.integrations.sglang import CLASS_NAME, MODULE_PATH
from bsr_io.integrations.sglang.backend import BsrHiCacheStorage

PAGE = 16  # tokens per page
LAYERS, HEADS, DIM = 2, 2, 64  # a K (or V) page run: 16 x 2 x 2 x 64 x 2 B = 8 KiB


def mha_pool(layout: str, *, tokens: int = 1024, page: int = PAGE) -> MHATokenToKVPoolHost:
    """SGLang's MHA host pool (pinned memory off: no CUDA here) over its CPU device pool."""
    device = MHATokenToKVPool(
        tokens,
        page,
        torch.bfloat16,
        HEADS,
        DIM,
        LAYERS,
        "cpu",
        False,
        start_layer=0,
        end_layer=LAYERS - 1,
    )
    return MHATokenToKVPoolHost(
        device.get_device_pool_infos()[0].buffer_info,
        2.0,
        0,
        page,
        layout,
        pin_memory=False,
        device="cpu",
        device_capacity_tokens=device.size,
        start_layer=device.start_layer,
        end_layer=device.end_layer,
    )


def mla_pool(layout: str, *, tokens: int = 1024, page: int = PAGE) -> MLATokenToKVPoolHost:
    """SGLang's MLA host pool (latent 64 + rope 32 per token and layer) on the CPU."""
    device = MLATokenToKVPool(
        tokens,
        page,
        torch.bfloat16,
        64,
        32,
        LAYERS,
        "cpu",
        False,
        start_layer=0,
        end_layer=LAYERS - 1,
    )
    return mla_host(device, layout)


def mla_host(device: Any, layout: str) -> MLATokenToKVPoolHost:
    """SGLang's MLA host pool over `device` (an MLA device pool of LAYERS layers)."""
    return MLATokenToKVPoolHost(
        device.get_device_pool_infos()[0].buffer_info,
        2.0,
        0,
        device.page_size,
        layout,
        pin_memory=False,
        device="cpu",
        device_capacity_tokens=device.size,
        start_layer=0,
        end_layer=LAYERS - 1,
        target_layer_num=LAYERS,
    )


def storage_config(
    extra: dict[str, Any],
    *,
    tp_rank: int = 0,
    tp_size: int = 1,
    mla: bool = False,
    model: str = "tiny-test-model",
    layout: str = "page_first",
) -> HiCacheStorageConfig:
    return HiCacheStorageConfig(
        tp_rank=tp_rank,
        tp_size=tp_size,
        pp_rank=0,
        pp_size=1,
        attn_cp_rank=0,
        attn_cp_size=1,
        is_mla_model=mla,
        enable_storage_metrics=False,
        is_page_first_layout=layout == "page_first",
        model_name=model,
        extra_config=extra,
    )


def extra_config(store_dir: Path | str | list[str], **bsr: Any) -> dict[str, Any]:
    """What `--hicache-storage-backend-extra-config` carries for this backend."""
    return {
        "backend_name": "bsr",
        "module_path": MODULE_PATH,
        "class_name": CLASS_NAME,
        "interface_v1": 1,
        "store_dir": store_dir if isinstance(store_dir, list) else str(store_dir),
        **bsr,
    }


def make_backend(
    store_dir: Path | str | list[str],
    pool: Any,
    *,
    tp_rank: int = 0,
    tp_size: int = 1,
    mla: bool = False,
    **bsr: Any,
) -> BsrHiCacheStorage:
    """Built as SGLang builds it: the factory's dynamic path, then the pool registered."""
    cfg = storage_config(
        extra_config(store_dir, **bsr),
        tp_rank=tp_rank,
        tp_size=tp_size,
        mla=mla,
        layout=pool.layout,
    )
    backend = StorageBackendFactory.create_backend("dynamic", cfg, pool)
    assert isinstance(backend, BsrHiCacheStorage)
    backend.register_mem_pool_host(pool)
    return backend


def fill(pool: Any, host_indices: torch.Tensor, seed: int) -> None:
    """Known bytes in the pages at `host_indices` (and nowhere else)."""
    g = torch.Generator().manual_seed(seed)
    for i in range(0, host_indices.numel(), pool.page_size):
        page = pool.get_data_page(int(host_indices[i]), flat=True)
        pool.set_from_flat_data_page(
            int(host_indices[i]), torch.randn(page.numel(), generator=g).to(pool.dtype)
        )


def page_bytes(pool: Any, host_indices: torch.Tensor) -> list[bytes]:
    """Each page's bytes, read through SGLang's own `get_data_page`."""
    return [
        pool.get_data_page(int(host_indices[i]), flat=True)
        .contiguous()
        .view(torch.uint8)
        .numpy()
        .tobytes()
        for i in range(0, host_indices.numel(), pool.page_size)
    ]


def keys(n: int, salt: str = "") -> list[str]:
    """Page keys shaped like SGLang's (chained SHA-256 hex)."""
    import hashlib

    out, prev = [], salt.encode()
    for i in range(n):
        prev = hashlib.sha256(prev + i.to_bytes(4, "little")).hexdigest().encode()
        out.append(prev.decode())
    return out
