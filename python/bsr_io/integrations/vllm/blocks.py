"""A request's blocks in vLLM's paged cache as a bsr-io Destination.

Chunk c of a request covers its blocks `[c*per, (c+1)*per)`, `per = chunk_tokens /
block_size`. Blocks below `first_block` hold vLLM's own local prefix hit: they may be
shared with other requests, so an install never writes them (their bytes in the
payload are skipped). Every install and extract runs under the request's guard:
once the guard is closed (the load timed out and was reported failed, so vLLM may
hand the blocks to another request) nothing touches the blocks again.
"""

from __future__ import annotations

import threading
from collections.abc import Sequence

import torch

from bsr_io.layout import KVLayout


class Abandoned(Exception):
    """The request's blocks were given back to vLLM; the transfer must stop."""


class Guard:
    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._open = True
        self.fences: list = []  # waits for copies already issued (a CUDA stream)

    def close(self) -> None:
        """After this returns, no install or extract of this request runs or will run,
        and no copy issued before is still in flight."""
        with self._lock:
            self._open = False
        for wait in self.fences:
            wait()

    def __enter__(self) -> Guard:
        self._lock.acquire()
        if not self._open:
            self._lock.release()
            raise Abandoned("the request's blocks were released (timeout)")
        return self

    def __exit__(self, *exc: object) -> None:
        self._lock.release()


class RequestBlocks:
    """Destination over one request's block ids in every layer's cache.

    It offers no `host_runs` (the fused copy-and-hash install): that path would bypass
    the guard, and a chunk whose first blocks are vLLM's own is only partly written."""

    def __init__(
        self,
        layout: KVLayout,
        layers: Sequence[torch.Tensor],
        block_ids: Sequence[int],
        first_block: int = 0,
        guard: Guard | None = None,
    ) -> None:
        self.layout = layout
        self.layers = list(layers)  # uint8 [num_blocks, block_bytes], one per group
        self.block_ids = list(block_ids)
        self.first_block = first_block
        self.guard = guard or Guard()
        g = layout.groups[0]
        self.per = layout.chunk_tokens // g.block_tokens
        self.block_bytes = g.block_tokens * g.token_bytes
        self.device = self.layers[0].device if self.layers else torch.device("cpu")
        self._cuda = self.device.type == "cuda"
        self._stream = torch.cuda.Stream(self.device) if self._cuda else None
        if self._stream is not None:
            self.guard.fences.append(self._stream.synchronize)
        num_blocks = self.layers[0].shape[0] if self.layers else 0
        bad = [b for b in self.block_ids if not 0 <= b < num_blocks]
        if bad:
            raise ValueError(f"block ids {bad[:4]} outside the cache's {num_blocks} blocks")

    @property
    def capacity_chunks(self) -> int:
        return len(self.block_ids) // self.per

    def _blocks(self, chunk_index: int) -> list[tuple[int, int]]:
        """(position in chunk, block id) of the chunk's blocks this request may write."""
        start = chunk_index * self.per
        if start + self.per > len(self.block_ids):
            raise IndexError(f"chunk {chunk_index} lies beyond the request's blocks")
        return [
            (j, self.block_ids[start + j]) for j in range(self.per) if start + j >= self.first_block
        ]

    def install(self, chunk_index: int, payload: torch.Tensor):
        blocks = self._blocks(chunk_index)
        bb, per = self.block_bytes, self.per
        with self.guard:
            if self._cuda:
                # The slot is registered with CUDA: asynchronous copies on our own stream,
                # and an event that tells the window when the slot may be reused.
                with torch.cuda.stream(self._stream):
                    for li, layer in enumerate(self.layers):
                        base = li * per * bb
                        for j, b in blocks:
                            src = payload[base + j * bb : base + (j + 1) * bb]
                            layer[b].copy_(src, non_blocking=True)
                    event = torch.cuda.Event()
                    event.record(self._stream)
                return event
            src = payload.numpy()
            for li, layer in enumerate(self.layers):
                dst = layer.numpy()
                base = li * per * bb
                for j, b in blocks:
                    dst[b] = src[base + j * bb : base + (j + 1) * bb]
        return None

    def extract(self, chunk_index: int, out: torch.Tensor) -> None:
        start = chunk_index * self.per
        if start + self.per > len(self.block_ids):
            raise IndexError(f"chunk {chunk_index} lies beyond the request's blocks")
        bb, per = self.block_bytes, self.per
        with self.guard:
            for li, layer in enumerate(self.layers):
                base = li * per * bb
                ids = self.block_ids[start : start + per]
                if self._cuda:
                    out[base : base + per * bb].view(per, bb).copy_(layer[ids].cpu())
                else:
                    dst = out.numpy()
                    src = layer.numpy()
                    for j, b in enumerate(ids):
                        dst[base + j * bb : base + (j + 1) * bb] = src[b]

    def synchronize(self) -> None:
        if self._cuda:
            self._stream.synchronize()
