"""SGLang host-pool pages as bsr-io records and as a destination for the window.

A page's record is the bytes the pool's own `get_page_buffer_meta` names for it, in
that order (MHA `page_first`: the page's K then its V; `layer_first`: K and V of each
layer in turn; MLA: one latent run per page or per layer). Nothing here reads the pool's
layout rules itself: SGLang's meta is the one source of where a page lies, so every
layout it can describe is a layout the backend reads, and one it cannot is refused when
the pool is registered.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from bsr_io.errors import BsrValueError
from bsr_io.load.kvcache import Fence
from bsr_io.model.layout import AllocatorGroup, KVLayout

# Host tensors (or lists of them) a pool may keep its pages in: the fused MHA/MLA
# buffer (per layer in a DeepSeek-V4 pool's layer_first), split K and V, a DSA
# indexer's keys and scales, a Mamba pool's temporal and conv states.
_BUFFERS = (
    "kv_buffer",
    "k_buffer",
    "v_buffer",
    "index_k_buffer",
    "index_k_scale_buffer",
    "index_k_with_scale_buffer",
    "temporal_buffer",
    "conv_buffer",
)
# What decides a page's bytes besides its layout, page size and dtype.
_GEOMETRY = (
    "layer_num",
    "head_num",
    "head_dim",
    "v_head_dim",
    "kv_lora_rank",
    "qk_rope_head_dim",
    "kv_cache_dim",
)

Run = tuple[int, int, int, int]  # (buffer index, offset in it, offset in the record, length)


def _buffers(pool: Any) -> list[torch.Tensor]:
    out: list[torch.Tensor] = []
    for name in _BUFFERS:
        try:
            found = getattr(pool, name, None)
        except Exception:  # noqa: BLE001 - a property that does not apply to this layout
            continue
        for t in found if isinstance(found, (list, tuple)) else [found]:
            # Once each: a pool may name one tensor twice (Mamba's kv_buffer lists its
            # temporal and conv buffers).
            if isinstance(t, torch.Tensor) and t.numel() and all(t is not b for b in out):
                if all(t.data_ptr() != b.data_ptr() for b in out):
                    out.append(t)
    return out


@dataclass
class PoolPages:
    """Where each page of `pool` lies, and the bsr-io layout of its records."""

    pool: Any
    layout: KVLayout
    page_size: int
    views: list[np.ndarray[Any, Any]]  # flat uint8 views of the pool's host buffers
    bases: list[int]  # their addresses

    @classmethod
    def of(cls, pool: Any, name: str = "kv") -> PoolPages:
        """ValueError naming what does not fit: a pool off the host, a layout SGLang's
        meta cannot describe, pages outside the pool's buffers. `name`: SGLang's name
        of the pool (its records are apart from every other pool's)."""
        kind, layout_name = type(pool).__name__, getattr(pool, "layout", "?")
        if name != "kv":
            kind = f"{kind} {name!r}"
        bufs = _buffers(pool)
        if not bufs:
            raise BsrValueError(f"{kind} ({layout_name}): no host KV buffer to read pages into")
        for t in bufs:
            if t.device.type != "cpu" or not t.is_contiguous():
                raise BsrValueError(f"{kind}: its KV buffers must be contiguous host tensors")
        page = int(pool.page_size)
        views = [t.view(-1).view(torch.uint8).numpy() for t in bufs]
        bases = [t.data_ptr() for t in bufs]
        try:
            runs = _page_runs(pool, bases, views, page, torch.arange(page))[0]
        except Exception as exc:  # SGLang's ValueError, assertion or NotImplementedError
            raise BsrValueError(
                f"{kind}: cannot read pages of host layout {layout_name!r} "
                f"({type(exc).__name__}: {exc}); "
                "use page_first, page_first_direct, page_head or layer_first"
            ) from None
        nbytes = sum(r[3] for r in runs)
        dtype = pool.dtype
        if nbytes % (page * dtype.itemsize):
            # A page of several dtypes (Mamba: temporal and conv states) is bytes.
            dtype = torch.uint8
        if nbytes % page:
            raise BsrValueError(f"{kind}: a page of {nbytes} bytes is not {page} whole tokens")
        geometry = {
            "pool": kind,
            "layout": layout_name,
            "runs": [r[3] for r in runs],
            **{g: getattr(pool, g) for g in _GEOMETRY if isinstance(getattr(pool, g, None), int)},
        }
        digest = hashlib.blake2b(
            json.dumps(geometry, sort_keys=True).encode(), digest_size=8
        ).hexdigest()
        per_token = nbytes // (page * dtype.itemsize)
        layout = KVLayout(
            f"sglang.{layout_name}.{digest}",
            (AllocatorGroup(name, dtype, (per_token,), page),),
            chunk_tokens=page,
        )
        return cls(pool, layout, page, views, bases)

    def page_runs(self, host_indices: torch.Tensor) -> list[list[Run]]:
        """Each page's runs (in record order) for `host_indices` (page_size per page)."""
        return _page_runs(self.pool, self.bases, self.views, self.page_size, host_indices)


def _page_runs(
    pool: Any,
    bases: Sequence[int],
    views: Sequence[np.ndarray[Any, Any]],
    page_size: int,
    host_indices: torch.Tensor,
) -> list[list[Run]]:
    n = host_indices.numel()
    if n == 0 or n % page_size:
        raise BsrValueError(f"{n} host indices is not a whole number of {page_size}-token pages")
    ptrs, sizes = pool.get_page_buffer_meta(host_indices)
    pages = n // page_size
    if len(ptrs) != len(sizes) or len(ptrs) % pages:
        raise BsrValueError(f"page buffer meta gave {len(ptrs)} runs for {pages} pages")
    per = len(ptrs) // pages
    out: list[list[Run]] = []
    for p in range(pages):
        runs: list[Run] = []
        at = 0
        for ptr, size in zip(
            ptrs[p * per : (p + 1) * per], sizes[p * per : (p + 1) * per], strict=True
        ):
            b, off = _locate(bases, views, int(ptr), int(size))
            runs.append((b, off, at, int(size)))
            at += int(size)
        out.append(runs)
    return out


def _locate(
    bases: Sequence[int], views: Sequence[np.ndarray[Any, Any]], ptr: int, size: int
) -> tuple[int, int]:
    for i, (base, view) in enumerate(zip(bases, views, strict=True)):
        if base <= ptr and ptr + size <= base + view.nbytes:
            return i, ptr - base
    raise BsrValueError(f"a page run ({size} bytes at {ptr:#x}) lies outside the pool's buffers")


class HostPages:
    """The pages of one batch as a bsr-io destination (record i is page i): read into
    and hashed in place through `host_runs`, installed or extracted run by run."""

    device = torch.device("cpu")
    lasting = False  # the backend registers the pool's memory with the engine once

    def __init__(self, pages: PoolPages, runs: Sequence[list[Run]], direct_reads: bool) -> None:
        self.pages = pages
        self.runs = list(runs)
        self.capacity_chunks = len(self.runs)
        self.direct_reads = direct_reads

    def host_memory(self) -> list[np.ndarray[Any, Any]]:
        """Every host buffer a page lies in: the pool's."""
        return list(self.pages.views)

    def host_runs(
        self, chunk_index: int
    ) -> tuple[list[np.ndarray[Any, Any] | None], list[tuple[int, int, int, int]]]:
        return list(self.pages.views), self.runs[chunk_index]

    def install(self, chunk_index: int, payload: torch.Tensor) -> Fence | None:
        src = payload.numpy()
        for b, off, at, n in self.runs[chunk_index]:
            np.copyto(self.pages.views[b][off : off + n], src[at : at + n])
        return None

    def extract(self, chunk_index: int, out: torch.Tensor) -> None:
        dst = out.numpy()
        for b, off, at, n in self.runs[chunk_index]:
            np.copyto(dst[at : at + n], self.pages.views[b][off : off + n])

    def synchronize(self) -> None:
        return None
