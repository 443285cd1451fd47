"""Host memory has one owner: who may write a host buffer's bytes after a read is given up.

A direct read (O_DIRECT straight into caller memory, or a pool's scatter read) given up at
its deadline goes on in the kernel: it writes its bytes whenever the device answers. Until
it returns, that byte range is the kernel's, whatever object the caller wraps the memory
in: SGLang builds a new page view per batch, vLLM and the `Restorer` a new cache per
request, over the same pool. So ownership is kept here by address, not by view object:
one `HostMemory` per host buffer (keyed by its address range, as `register_memory` keys a
registration) holds the ranges of its given-up reads until each read says its memory is
returned. Every load asks `owned_by_kernel` before it reads into a range (window.py), and
an integration that must not hand memory back to its host while the kernel may write it
waits with `wait_returned`.

The given-up reads keep their buffers exported (the engine holds them), so the memory
cannot be freed and its address reused while a range is owned. A read an engine
break-down left with the kernel is never returned: its range stays owned for good.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterable, Sequence
from typing import TYPE_CHECKING, Any

import numpy as np

if TYPE_CHECKING:
    from bsr_io.load.install import HostRuns
    from bsr_io.tiers.base import DirectChunk

Range = tuple[int, int]  # [start, end) in the process's address space


class HostMemory:
    """One host buffer, [start, end): the byte ranges that reads given up may still write,
    each with its read, until the read returns the memory."""

    __slots__ = ("end", "start", "_given_up")

    def __init__(self, start: int, end: int) -> None:
        self.start, self.end = start, end
        self._given_up: list[tuple[tuple[Range, ...], DirectChunk]] = []

    def owned(self) -> list[Range]:
        """The ranges still owned by the kernel (reads that returned are forgotten)."""
        with _lock:
            self._given_up = [(rs, r) for rs, r in self._given_up if not r.returned()]
            if not self._given_up:
                _owners.pop((self.start, self.end), None)
            return [rng for rs, _ in self._given_up for rng in rs]

    def __repr__(self) -> str:
        return f"HostMemory({self.start:#x}..{self.end:#x}, {len(self.owned())} owned ranges)"


# Owners with ranges the kernel may still write, by their buffer's (start, end). An owner
# whose reads have all returned leaves the table: the memory is its holders' again.
_owners: dict[Range, HostMemory] = {}
_lock = threading.RLock()


def address_of(buf: Any) -> Range:
    """The address range of host buffer `buf`."""
    a = np.asarray(memoryview(buf)) if not isinstance(buf, np.ndarray) else buf
    start = int(a.__array_interface__["data"][0])
    return start, start + int(a.nbytes)


def owner_of(buf: Any) -> HostMemory:
    """The owner of host buffer `buf` (a writable buffer): the one that covers its address
    range if any, else a new one."""
    start, end = address_of(buf)
    with _lock:
        for (s, e), owner in _owners.items():
            if s <= start and end <= e:
                return owner
        return HostMemory(start, end)


def ranges_of(where: HostRuns) -> list[Range]:
    """The address ranges a chunk's host runs (`host_runs`: buffers, and (buffer, offset,
    payload offset, length) per run) cover."""
    bufs, runs = where
    out = []
    for b, off, _at, n in runs:
        buf = bufs[b]
        if buf is None:
            continue
        start = address_of(buf)[0] + off
        out.append((start, start + n))
    return out


def give_up(where: HostRuns, read: DirectChunk) -> None:
    """`read` was given up while it may still write `where`: those bytes are the kernel's
    until `read.returned()`."""
    bufs, runs = where
    for b in sorted({r[0] for r in runs}):
        buf = bufs[b]
        if buf is None:
            continue
        owner = owner_of(buf)
        mine = ranges_of(([buf], [(0, off, at, n) for bi, off, at, n in runs if bi == b]))
        with _lock:
            owner._given_up.append((tuple(mine), read))
            _owners[(owner.start, owner.end)] = owner


def any_owned() -> bool:
    """Whether any range is owned by the kernel now (cheap: a load skips its checks when
    not)."""
    with _lock:
        return bool(_owners)


def owned_by_kernel(ranges: Iterable[Range]) -> Range | None:
    """The first range the kernel still owns that overlaps one of `ranges`, or None."""
    want = list(ranges)
    if not want or not any_owned():
        return None
    with _lock:
        owners = list(_owners.values())
    for owner in owners:
        for lo, hi in owner.owned():
            for a, b in want:
                if a < hi and lo < b:
                    return lo, hi
    return None


def wait_returned(ranges: Sequence[Range] | None, timeout: float) -> bool:
    """Wait until the kernel owns none of `ranges` (None: no range at all), at most
    `timeout` seconds; whether it does not. A poll (the reads' completions are the
    engine's), backing off from 1 ms to 50 ms."""
    deadline = time.monotonic() + timeout
    pause = 0.001
    while True:
        held = owned_by_kernel(ranges) if ranges is not None else _any_left()
        if held is None:
            return True
        if time.monotonic() >= deadline:
            return False
        time.sleep(pause)
        pause = min(pause * 2, 0.05)


def _any_left() -> Range | None:
    with _lock:
        owners = list(_owners.values())
    for owner in owners:
        left = owner.owned()
        if left:
            return left[0]
    return None
