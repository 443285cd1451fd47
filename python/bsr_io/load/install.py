"""Installing one staged chunk into its destination, with verification after the copy.

Bytes placed in the destination's blocks are installed, not visible, until the
restore commits, so a chunk may be verified while (or after) it is copied:

- fused (destinations in plain host memory that expose `host_runs`): one pass in Rust
  copies the slot into the KV blocks and hashes what landed (xxh3-64), GIL released;
- otherwise (a CUDA destination, where the copy is a DMA from the registered slot, or
  any other `Destination`): the install is issued first and the slot hashed while the
  copy runs.

The hash is then checked against the record header's (`PendingChunk.expected_xxh3`,
set by tiers that defer their check to the install). A mismatch quarantines the
record and raises `ChunkCorrupt`: the chunk fails like any other bad read, and the
window re-reads it from a lower tier into the same blocks, or the restore ends zero.
"""

from __future__ import annotations

from collections.abc import Callable
from contextlib import AbstractContextManager, nullcontext
from typing import Any, TypeVar

import torch

from bsr_io._core import Slot
from bsr_io.load.kvcache import Destination, Fence
from bsr_io.load.memory import HostRuns
from bsr_io.tiers.base import PendingChunk

T = TypeVar("T")


def install_scope(dest: Destination) -> AbstractContextManager[Any]:
    """What the destination holds around each install (vLLM's guard: once the request's
    blocks are given back, nothing writes them), or nothing."""
    scope = getattr(dest, "install_scope", None)
    return nullcontext() if scope is None else scope()


def scoped(dest: Destination, fn: Callable[..., T]) -> Callable[..., T]:
    """`fn` run inside the destination's install scope (for an install thread)."""

    def run(*args: Any) -> T:
        with install_scope(dest):
            return fn(*args)

    return run


def fused_runs(dest: Destination, index: int) -> HostRuns | None:
    """(host byte buffers, runs) for the fused install of chunk `index`, or None when the
    destination's memory is not plain host memory it can hand out."""
    runs = getattr(dest, "host_runs", None)
    return None if runs is None else runs(index)


def install_chunk(
    dest: Destination,
    index: int,
    slot: Slot,
    chunk_bytes: int,
    pending: PendingChunk | None = None,
    fused: bool = True,
) -> Fence | None:
    """Install chunk `index` from `slot`; verify it if the tier left that to us.

    Returns the install's fence (an asynchronous copy holds the slot until it is
    done) or None. Raises the tier's `ChunkCorrupt` when the payload's hash differs
    from its record header's; the destination's blocks then hold unverified bytes,
    which no one sees before the commit."""
    expected = pending.expected_xxh3 if pending is not None else None
    where = fused_runs(dest, index) if fused and expected is not None else None
    got: int | None = None
    fence: Fence | None = None
    if where is not None:
        bufs, runs = where
        with install_scope(dest):
            got = slot.install_xxh3(bufs, runs)
    else:
        payload = torch.frombuffer(slot, dtype=torch.uint8, count=chunk_bytes)
        with install_scope(dest):
            fence = dest.install(index, payload)
        del payload
        # With an asynchronous copy in flight the hash overlaps it: both only read the slot.
        got = slot.checksum(0, chunk_bytes) if expected is not None else None
    if pending is not None and expected is not None and got != expected:
        if fence is not None:
            fence.synchronize()  # the copy still reads the slot: finish before it is reused
        raise pending.reject("payload checksum mismatch after the install copy")
    return fence
