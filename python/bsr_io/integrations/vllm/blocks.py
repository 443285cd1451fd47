"""vLLM's paged KV cache as a bsr-io destination: records over per-group block ids.

`KVPages` addresses vLLM's backing allocation once (one flat byte view per storage,
however many groups overlay it) and knows each layer's page placement, checked
against the tensors vLLM registered. `RequestPages` is one request's records: record
i is one group's pages for one chunk (or one window), each page at a block id of that
group, or skipped (-1: a null block, a block of vLLM's own local hit, a page before
the prompt). It offers `host_runs` (consecutive blocks coalesced into one run) for the
core's fused copy-and-verify install, and `install_scope()`: the request's `Guard`,
held around every install and extract, so once a load is abandoned nothing touches
the blocks vLLM may have handed to another request.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from bsr_io.errors import BsrValueError, LayoutError
from bsr_io.integrations.vllm.layout import GroupLayout

SKIP = -1  # a record position no block backs here: not installed, extracted as zeros


class Abandoned(Exception):
    """The request's blocks were given back to vLLM; the transfer must stop."""


class Guard:
    def __init__(self) -> None:
        # Re-entrant: the core's install holds the scope around `install`, which
        # enters the guard itself (a fallback install from a lower tier deadlocked on a
        # plain Lock, and the watchdog's close then blocked vLLM's model runner).
        self._lock = threading.RLock()
        self._open = True
        self.fences: list[Callable[[], None]] = []  # waits for copies already issued

    def close(self) -> None:
        """After this returns, no install or extract of this request runs or will run,
        and no copy issued before is still in flight."""
        with self._lock:
            self._open = False
        for wait in self.fences:
            wait()

    @property
    def open(self) -> bool:
        return self._open

    def __enter__(self) -> Guard:
        self._lock.acquire()
        if not self._open:
            self._lock.release()
            raise Abandoned("the request's blocks were released (timeout or abort)")
        return self

    def __exit__(self, *exc: object) -> None:
        self._lock.release()


@dataclass(frozen=True)
class _Layer:
    buf: int  # index into KVPages.bufs
    base: int  # byte offset of block 0's page in that buffer
    stride: int  # bytes from block b to b + 1
    page: int


class KVPages:
    """Where every layer's pages are, over vLLM's storage addressed once."""

    def __init__(
        self, kv_caches: Mapping[str, torch.Tensor], groups: Sequence[GroupLayout], num_blocks: int
    ) -> None:
        self.num_blocks = num_blocks
        storages: dict[int, int] = {}
        self.tensors: list[torch.Tensor] = []  # flat uint8 views, one per storage
        self.layers: dict[str, _Layer] = {}
        device = None
        for g in groups:
            for lp in g.layers:
                t = kv_caches.get(lp.name)
                where = f"KV cache group {g.index} ({g.spec}), layer {lp.name}"
                if t is None:
                    raise LayoutError(f"{where}: vLLM registered no KV cache tensor for it")
                st = t.untyped_storage()
                key = st.data_ptr()
                if key not in storages:
                    storages[key] = len(self.tensors)
                    flat = torch.empty(0, dtype=torch.uint8, device=t.device)
                    # torch's stub lists set_(storage, offset, size) only with a stride.
                    flat.set_(st, 0, (st.nbytes(),))  # type: ignore[call-overload]
                    self.tensors.append(flat)
                device = t.device
                base = t.data_ptr() - key
                self._check(where, t, lp.page_bytes, lp.block_stride, base, lp.offset, st.nbytes())
                self.layers[lp.name] = _Layer(storages[key], base, lp.block_stride, lp.page_bytes)
        self.device = device or torch.device("cpu")
        # Plain host memory: numpy views for the fused install (and memcpy-speed copies).
        self.bufs: list[np.ndarray[Any, Any]] | None = (
            [t.numpy() for t in self.tensors] if self.device.type == "cpu" else None
        )

    def _check(
        self,
        where: str,
        t: torch.Tensor,
        page: int,
        stride: int,
        base: int,
        offset: int,
        nbytes: int,
    ) -> None:
        """Refuse, naming the layer, what bsr-io cannot read as one run per page."""
        es = t.element_size()
        if base != offset:
            raise LayoutError(
                f"{where}: tensor starts {base} B into vLLM's allocation, its KVCacheTensor "
                f"says {offset}; bsr-io cannot address its pages"
            )
        n = self.num_blocks
        if t.dim() < 1 or t.shape[0] % n:
            raise LayoutError(f"{where}: tensor shape {list(t.shape)} is not [{n} blocks, ...]")
        ratio = t.shape[0] // n  # kernel blocks per vLLM block
        block = t[0:ratio]
        if t.stride(0) * es * ratio != stride or not block.is_contiguous():
            raise LayoutError(
                f"{where}: a block of shape {list(t.shape)} strides {list(t.stride())} is not "
                f"one contiguous run of bytes {stride} B apart; bsr-io reads each (layer, "
                "block) page as one run (use a layer- or block-outermost layout: LBHNC, BLHNC)"
            )
        if block.numel() * es > page:
            raise LayoutError(f"{where}: a block holds {block.numel() * es} B, its page {page} B")
        if base + (n - 1) * stride + page > nbytes:
            raise LayoutError(f"{where}: {n} pages of {page} B do not fit its storage")


@dataclass(frozen=True)
class RecordPlan:
    """One record of a request: a group, and the block id behind each of its pages
    (in `group.span(chunk)` order; SKIP where no block is touched)."""

    group: GroupLayout
    ids: tuple[int, ...]

    def __post_init__(self) -> None:
        if len(self.ids) != self.group.record_blocks:
            raise BsrValueError(
                f"record of {self.group.describe()} needs {self.group.record_blocks} "
                f"block ids, got {len(self.ids)}"
            )


class RequestPages:
    """Destination over one request's records (loads install them, saves extract them)."""

    def __init__(
        self, pages: KVPages, records: Sequence[RecordPlan], guard: Guard | None = None
    ) -> None:
        self.pages = pages
        self.records = list(records)
        self.guard = guard or Guard()
        self.device = pages.device
        self._cuda = self.device.type == "cuda"
        self._stream = torch.cuda.Stream(self.device) if self._cuda else None  # type: ignore[no-untyped-call]
        if self._stream is not None:
            self.guard.fences.append(self._stream.synchronize)
        for r in self.records:
            bad = [b for b in r.ids if b != SKIP and not 0 < b < pages.num_blocks]
            if bad:
                raise BsrValueError(
                    f"{r.group.describe()}: block ids {bad[:4]} are null or "
                    f"outside the cache's {pages.num_blocks} blocks"
                )

    @property
    def capacity_chunks(self) -> int:
        return len(self.records)

    def sizes(self) -> list[int]:
        return [r.group.record_bytes for r in self.records]

    def runs(self, i: int) -> list[tuple[int, int, int, int]]:
        """(buffer, offset in it, payload offset, length) of record i's pages, in payload
        order; consecutive blocks of a layer whose pages abut are one run."""
        r = self.records[i]
        out: list[tuple[int, int, int, int]] = []
        for lp, (off, _n) in zip(r.group.layers, r.group.record.group_offsets(), strict=True):
            lay = self.pages.layers[lp.name]
            page = lay.page
            j = 0
            ids = r.ids
            while j < len(ids):
                if ids[j] == SKIP:
                    j += 1
                    continue
                k = j + 1
                while k < len(ids) and ids[k] == ids[k - 1] + 1 and lay.stride == page:
                    k += 1
                out.append(
                    (lay.buf, lay.base + ids[j] * lay.stride, off + j * page, (k - j) * page)
                )
                j = k
        return out

    # -- the core's destination protocol -------------------------------------------
    def install_scope(self) -> Guard:
        return self.guard

    def host_runs(
        self, i: int
    ) -> tuple[list[np.ndarray[Any, Any] | None], list[tuple[int, int, int, int]]] | None:
        if self.pages.bufs is None:
            return None
        return list(self.pages.bufs), self.runs(i)

    def install(self, i: int, payload: torch.Tensor) -> Any:
        runs = self.runs(i)
        with self.guard:
            if self._cuda:
                assert self._stream is not None
                with torch.cuda.stream(self._stream):
                    for b, dst, src, n in runs:
                        self.pages.tensors[b][dst : dst + n].copy_(
                            payload[src : src + n], non_blocking=True
                        )
                    event = torch.cuda.Event()  # type: ignore[no-untyped-call]
                    event.record(self._stream)
                return event
            assert self.pages.bufs is not None
            src_np = payload.numpy()
            for b, dst, src, n in runs:
                np.copyto(self.pages.bufs[b][dst : dst + n], src_np[src : src + n])
        return None

    def extract(self, i: int, out: torch.Tensor) -> None:
        r = self.records[i]
        with self.guard:
            if SKIP in r.ids:
                out.zero_()
            for b, src, dst, n in self.runs(i):
                out[dst : dst + n].copy_(self.pages.tensors[b][src : src + n])

    def synchronize(self) -> None:
        if self._stream is not None:
            self._stream.synchronize()
