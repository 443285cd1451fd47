"""Destinations of a restore: where installed chunk bytes land.

A `Destination` takes one chunk's payload (a uint8 tensor viewing a staging slot)
and scatters it into KV storage; for saves it gathers a chunk back out. The paged
KV cache below is what serving engines allocate: one tensor per allocator group,
`[num_blocks, block_tokens, *token_shape]`, addressed by block ids.
"""

from __future__ import annotations

import mmap
from collections.abc import Sequence
from typing import Any, Protocol, runtime_checkable

import numpy as np
import torch

from bsr_io._core import Engine
from bsr_io.errors import BsrValueError, expect_type
from bsr_io.load.memory import REGISTER_TIMEOUT_S, HostMemory, register_memory
from bsr_io.model.layout import KVLayout


@runtime_checkable
class Fence(Protocol):
    """Completion of an asynchronous install; the staging slot is held until it is done."""

    def synchronize(self) -> None: ...


@runtime_checkable
class Destination(Protocol):
    def install(self, chunk_index: int, payload: torch.Tensor) -> Fence | None:
        """Scatter one chunk's payload (uint8, `layout.chunk_bytes` long) into KV storage."""
        ...

    def extract(self, chunk_index: int, out: torch.Tensor) -> None:
        """Gather one chunk's bytes into `out` (uint8, `layout.chunk_bytes` long)."""
        ...

    def synchronize(self) -> None:
        """Wait until every install issued so far has landed."""
        ...


def _page_aligned(shape: tuple[int, ...], dtype: torch.dtype, zero: bool) -> torch.Tensor:
    """A host tensor on its own private mapping, 2 MiB-aligned and advised to huge pages,
    so a direct read (O_DIRECT into its blocks, window.py) can land there and its 1 MiB
    requests are not split: on 4 KiB pages each needs 256 segments, more than a
    virtio disk's queue takes (torch's own allocations are also only 64-aligned).
    Fresh anonymous memory reads as zeros, whatever `zero` says."""
    nbytes = int(np.prod(shape)) * torch.empty((), dtype=dtype).element_size()
    if nbytes == 0:
        return torch.empty(shape, dtype=dtype)  # no blocks (a miss): nothing to map
    huge = 2 << 20
    size = max(huge, -(-nbytes // huge) * huge)
    mm = mmap.mmap(-1, size, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    if hasattr(mmap, "MADV_HUGEPAGE"):
        try:
            mm.madvise(mmap.MADV_HUGEPAGE)
        except OSError:
            pass  # no transparent huge pages here: 4 KiB pages, still page-aligned
    # The tensor keeps the mapping alive (torch.frombuffer holds a reference to it).
    return torch.frombuffer(mm, dtype=torch.uint8, count=nbytes).view(dtype).view(shape)


class PagedKVCache:
    """Per-group paged KV tensors plus the block ids a request's tokens occupy.

    `direct_reads`: a host cache owns its memory for as long as a restore runs, so the
    window may read records straight into its blocks (window.py); off on a GPU, where
    chunks share blocks, and for a cache whose owner may hand its blocks elsewhere
    mid-restore. `lasting`: the cache outlives a restore (it is the serving engine's KV
    cache), so its buffers are worth registering with the engine's ring, once per
    memory (memory.py `register_memory`): per-request caches over one pool share it.
    """

    direct_reads = True
    lasting = True

    def __init__(
        self,
        layout: KVLayout,
        tensors: Sequence[torch.Tensor],
        block_ids: Sequence[Sequence[int]],
    ) -> None:
        expect_type(layout, KVLayout, "layout")
        groups = layout.groups
        if len(tensors) != len(groups):
            raise BsrValueError(
                f"layout {layout.name!r} has {len(groups)} allocator groups, "
                f"got {len(tensors)} KV tensors"
            )
        if len(block_ids) != len(groups):
            raise BsrValueError(
                f"need one block-id list per group ({len(groups)}), got {len(block_ids)}"
            )
        self.layout = layout
        self.tensors = list(tensors)
        self._ids: list[list[int]] = []
        for g, t, ids in zip(groups, tensors, block_ids, strict=True):
            want = (g.block_tokens, *g.token_shape)
            if t.dtype != g.dtype or tuple(t.shape[1:]) != want:
                raise BsrValueError(
                    f"group {g.name!r}: expected a [num_blocks, {', '.join(map(str, want))}] "
                    f"{g.dtype} tensor, got {list(t.shape)} {t.dtype}"
                )
            if not t.is_contiguous():
                raise BsrValueError(f"group {g.name!r}: KV tensor must be contiguous")
            if layout.chunk_tokens % g.block_tokens:
                raise BsrValueError(
                    f"group {g.name!r}: block_tokens {g.block_tokens} does not divide "
                    f"chunk_tokens {layout.chunk_tokens}"
                )
            idx = torch.as_tensor(list(ids), dtype=torch.long)
            if idx.numel() and (int(idx.min()) < 0 or int(idx.max()) >= t.shape[0]):
                raise BsrValueError(f"group {g.name!r}: block id out of range [0, {t.shape[0]})")
            self._ids.append(idx.tolist())
        self._offsets = layout.group_offsets()
        # Flat byte views of host tensors: installs there are plain memcpys through numpy,
        # which stays at memory speed where torch's threaded copy stalls on a busy host.
        self._host_bytes = [
            t.reshape(-1).view(torch.uint8).numpy() if t.device.type == "cpu" else None
            for t in self.tensors
        ]
        self._block_bytes = [g.block_tokens * g.token_bytes for g in groups]
        self.device = self.tensors[0].device if self.tensors else torch.device("cpu")
        # Direct reads of several chunks are in flight at once: chunks sharing blocks (ids
        # that cycle, to bound memory) would race in them, so those go through slots.
        if self.device.type != "cpu" or any(len(set(ids)) != len(ids) for ids in self._ids):
            self.direct_reads = False

    @classmethod
    def allocate(
        cls,
        layout: KVLayout,
        num_tokens: int,
        *,
        device: str | torch.device = "cpu",
        spare_blocks: int = 0,
        zero: bool = True,
    ) -> PagedKVCache:
        """A cache holding `num_tokens` tokens in consecutive blocks (after `spare_blocks`).
        `num_tokens` 0 (a miss: `plan.hit_tokens` is 0) gives a cache of no blocks."""
        expect_type(layout, KVLayout, "layout")
        for what, value in (("num_tokens", num_tokens), ("spare_blocks", spare_blocks)):
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                raise BsrValueError(f"{what} must be an int >= 0, got {value!r}")
        tensors, ids = [], []
        for g in layout.groups:
            n = -(-num_tokens // g.block_tokens)
            shape = (spare_blocks + n, g.block_tokens, *g.token_shape)
            if torch.device(device).type == "cpu":
                tensors.append(_page_aligned(shape, g.dtype, zero))
            else:
                make = torch.zeros if zero else torch.empty
                tensors.append(make(shape, dtype=g.dtype, device=device))
            ids.append(range(spare_blocks, spare_blocks + n))
        return cls(layout, tensors, ids)

    @property
    def capacity_chunks(self) -> int:
        ct = self.layout.chunk_tokens
        return min(
            len(ix) * g.block_tokens // ct
            for g, ix in zip(self.layout.groups, self._ids, strict=True)
        )

    def _runs(self, gi: int, chunk_index: int) -> list[tuple[int, int, int]]:
        """(first block, position in chunk, count) for each run of consecutive block ids:
        a run is one memcpy, far faster than a gather or scatter kernel."""
        per = self.layout.chunk_tokens // self.layout.groups[gi].block_tokens
        ids = self._ids[gi][chunk_index * per : (chunk_index + 1) * per]
        if len(ids) != per:
            raise IndexError(
                f"chunk {chunk_index} lies beyond the {self.capacity_chunks} chunks "
                "of block ids given for this request"
            )
        runs = []
        start = 0
        for j in range(1, per + 1):
            if j == per or ids[j] != ids[j - 1] + 1:
                runs.append((ids[start], start, j - start))
                start = j
        return runs

    def _group_view(self, gi: int, payload: torch.Tensor) -> torch.Tensor:
        g = self.layout.groups[gi]
        off, length = self._offsets[gi]
        per = self.layout.chunk_tokens // g.block_tokens
        return payload[off : off + length].view(g.dtype).view(per, g.block_tokens, *g.token_shape)

    def install(self, chunk_index: int, payload: torch.Tensor) -> Fence | None:
        if payload.numel() != self.layout.chunk_bytes:
            raise BsrValueError(
                f"payload has {payload.numel()} bytes, a chunk of {self.layout.name!r} "
                f"has {self.layout.chunk_bytes}"
            )
        cuda = self.device.type == "cuda"
        host_src = None if cuda else payload.numpy()
        for gi, t in enumerate(self.tensors):
            runs = self._runs(gi, chunk_index)
            flat = self._host_bytes[gi]
            if flat is not None and host_src is not None:
                off, bb = self._offsets[gi][0], self._block_bytes[gi]
                for block, pos, count in runs:
                    np.copyto(
                        flat[block * bb : (block + count) * bb],
                        host_src[off + pos * bb : off + (pos + count) * bb],
                    )
                continue
            src = self._group_view(gi, payload)
            for block, pos, count in runs:
                # On a GPU the slot is registered with CUDA: an asynchronous DMA copy.
                t[block : block + count].copy_(src[pos : pos + count], non_blocking=cuda)
        if cuda:
            event = torch.cuda.Event()  # type: ignore[no-untyped-call]
            event.record()
            return event
        return None

    def register(self, engine: Engine, timeout: float = REGISTER_TIMEOUT_S) -> HostMemory:
        """Register this cache's host memory with `engine`'s ring for as long as the
        returned object (the memory's owner, memory.py) is kept: a serving engine keeps
        it for its KV pool's life, and every destination made over the same tensors (a
        request's view with its own block ids) is a view of it and reads into that one
        registration. TimeoutError when the engine's I/O thread is held past `timeout`
        seconds (nothing registered)."""
        bufs = [b for b in self._host_bytes if b is not None]
        if len(bufs) != len(self._host_bytes):
            raise BsrValueError("only a cache in host memory can be registered with a ring")
        return register_memory(engine, bufs, timeout=timeout)

    def host_memory(self) -> list[np.ndarray[Any, Any]]:
        """Every host buffer a chunk of this cache lies in (none on a GPU)."""
        return [b for b in self._host_bytes if b is not None]

    def host_runs(
        self, chunk_index: int
    ) -> tuple[list[np.ndarray[Any, Any] | None], list[tuple[int, int, int, int]]] | None:
        """Where chunk `chunk_index`'s payload goes, for the fused install (install.py):
        the groups' flat host byte views and (view index, offset in it, payload offset,
        length) per run of consecutive blocks, in payload order. None on a GPU."""
        if any(b is None for b in self._host_bytes):
            return None
        runs = []
        for gi in range(len(self.tensors)):
            off, bb = self._offsets[gi][0], self._block_bytes[gi]
            for block, pos, count in self._runs(gi, chunk_index):
                runs.append((gi, block * bb, off + pos * bb, count * bb))
        return self._host_bytes, runs

    def extract(self, chunk_index: int, out: torch.Tensor) -> None:
        for gi, t in enumerate(self.tensors):
            dst = self._group_view(gi, out)
            for block, pos, count in self._runs(gi, chunk_index):
                dst[pos : pos + count].copy_(t[block : block + count])

    def synchronize(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    def chunk_bytes(self, chunk_index: int) -> bytes:
        """One chunk's bytes as stored (for checks and tests)."""
        out = torch.empty(self.layout.chunk_bytes, dtype=torch.uint8)
        self.extract(chunk_index, out)
        return out.numpy().tobytes()


class HostBuffers:
    """A destination of one flat host buffer per record (record i lands in `bufs[i]`):
    staging objects another cache hands out (LMCache's memory objects), or plain arrays.
    Installs are fused (copy and hash in one pass) through `host_runs`."""

    def __init__(self, bufs: Sequence[np.ndarray[Any, Any]]) -> None:
        for i, b in enumerate(bufs):
            if b.dtype != np.uint8 or b.ndim != 1 or not b.flags.c_contiguous:
                raise BsrValueError(f"buffer {i}: need a flat contiguous uint8 array")
            if not b.flags.writeable:
                raise BsrValueError(f"buffer {i} is read-only")
        self.bufs = list(bufs)
        self.device = torch.device("cpu")
        self.capacity_chunks = len(self.bufs)

    def _check(self, index: int, nbytes: int) -> np.ndarray[Any, Any]:
        buf = self.bufs[index]
        if nbytes != buf.nbytes:
            raise BsrValueError(f"record {index} is {nbytes} bytes, its buffer {buf.nbytes}")
        return buf

    def install(self, chunk_index: int, payload: torch.Tensor) -> Fence | None:
        np.copyto(self._check(chunk_index, payload.numel()), payload.numpy())
        return None

    def host_memory(self) -> list[np.ndarray[Any, Any]]:
        """Every host buffer a record of this destination lies in."""
        return list(self.bufs)

    def host_runs(
        self, chunk_index: int
    ) -> tuple[list[np.ndarray[Any, Any] | None], list[tuple[int, int, int, int]]]:
        buf = self.bufs[chunk_index]
        return [buf], [(0, 0, 0, buf.nbytes)]

    def extract(self, chunk_index: int, out: torch.Tensor) -> None:
        np.copyto(out.numpy(), self._check(chunk_index, out.numel()))

    def synchronize(self) -> None:
        return None
