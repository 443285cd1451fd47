"""Host memory has one owner: its registration with a ring, and who may write its bytes
after a read is given up.

One `HostMemory` per host memory, keyed by its buffers' address ranges: the buffers a
serving engine's KV pool is made of, registered together (`register_memory`), or one
buffer a read was given up in. It holds

- its registration with each engine's ring: the kernel pins its pages once, and every
  direct read into them skips pinning (READ_FIXED). It lasts while the owner lives: the
  pool's owner keeps the returned object for the pool's life, or a destination over the
  memory holds it (`holder`) while it lives;
- the byte ranges reads given up may still write. A direct read (O_DIRECT straight into
  caller memory, or a pool's scatter read) given up at its deadline goes on in the
  kernel and writes its bytes whenever the device answers: until it returns, that range
  is the kernel's, whatever object the caller wraps the memory in.

Every host destination is a view of its owner, found by address, never by view object:
SGLang builds a new page view per batch, vLLM and the `Restorer` a new cache per request,
LMCache hands out staging buffers, all over the same memory. Every load asks
`owned_by_kernel` before it reads into a range (window.py), and an integration that must
not hand memory back to its host while the kernel may write it waits with
`wait_returned`. An owner with ranges the kernel may still write is kept alive until they
are returned (its registration with it).

The given-up reads keep their buffers exported (the engine holds them), so the memory
cannot be freed and its address reused while a range is owned. A read an engine
break-down left with the kernel is never returned: its range stays owned for good.
"""

from __future__ import annotations

import threading
import time
import weakref
from collections.abc import Callable, Iterable, Sequence
from typing import TYPE_CHECKING, Any

import numpy as np

from bsr_io._core import (
    Engine,
    EngineBrokenError,
    EngineClosedError,
    MemoryRegistration,
    NoFreeSlot,
)

if TYPE_CHECKING:
    from bsr_io.tiers.base import DirectChunk

# A chunk's host runs (a destination's `host_runs`): its buffers, and (buffer, offset,
# payload offset, length) per run. Named here, below install and the destinations that
# make them, so that this module's owners need nothing above it.
HostRuns = tuple[list["np.ndarray[Any, Any] | None"], list[tuple[int, int, int, int]]]

__all__ = [
    "REGISTER_TIMEOUT_S",
    "HostMemory",
    "HostRuns",
    "any_owned",
    "give_up",
    "owned_by_kernel",
    "owner_of",
    "register_memory",
    "registered",
    "registrations",
    "wait_returned",
]

Range = tuple[int, int]  # [start, end) in the process's address space
Spans = tuple[Range, ...]  # an owner's buffers, in the order they were registered

# How long a registration waits for the engine's I/O thread, outside a run's deadline:
# a waiting thread is woken for it, but one held in a system call takes it only after.
REGISTER_TIMEOUT_S = 30.0


class HostMemory:
    """The owner of host buffers `spans` (one or several, [start, end) each): their
    registration with each engine's ring (None where the kernel refused it:
    RLIMIT_MEMLOCK, a full table; reads into them then go unregistered), and the byte
    ranges that reads given up may still write, each with its read, until the read
    returns the memory."""

    __slots__ = ("__weakref__", "spans", "_given_up", "_rings")

    def __init__(self, spans: Spans) -> None:
        self.spans = spans
        self._rings: weakref.WeakKeyDictionary[Engine, MemoryRegistration | None] = (
            weakref.WeakKeyDictionary()
        )
        self._given_up: list[tuple[tuple[Range, ...], DirectChunk]] = []

    def covers(self, start: int, end: int) -> bool:
        return any(s <= start and end <= e for s, e in self.spans)

    # -- its registrations -------------------------------------------------------------
    def registered_with(self, engine: Engine) -> bool:
        """Whether registering it with `engine`'s ring was done (or refused by the
        kernel: then reads go unregistered, and it is not asked again)."""
        return engine in self._rings

    def registration(self, engine: Engine) -> MemoryRegistration | None:
        """Its registration with `engine`'s ring; None where there is none."""
        return self._rings.get(engine)

    def entries(self, engine: Engine) -> int:
        """Ring buffer entries its registration with `engine` takes (0: none)."""
        reg = self._rings.get(engine)
        return 0 if reg is None else reg.entries

    def unregister(self, engine: Engine) -> None:
        """End its registration with `engine`'s ring now (its owner closes: the pool
        goes), not at collection."""
        with _lock:
            reg = self._rings.pop(engine, None)
        if reg is not None:
            reg.close()

    # -- its ranges the kernel owns ----------------------------------------------------
    def owned(self) -> list[Range]:
        """The ranges still owned by the kernel (reads that returned are forgotten)."""
        with _lock:
            self._given_up = [(rs, r) for rs, r in self._given_up if not r.returned()]
            if not self._given_up and _owned.get(self.spans) is self:
                del _owned[self.spans]
            return [rng for rs, _ in self._given_up for rng in rs]

    def wait_returned(self, timeout: float) -> bool:
        """Wait until the kernel owns none of it, at most `timeout` seconds; whether it
        does not."""
        return _poll(lambda: next(iter(self.owned()), None), timeout)

    def __repr__(self) -> str:
        where = ", ".join(f"{s:#x}..{e:#x}" for s, e in self.spans)
        return f"HostMemory({where}; {len(self._rings)} rings, {len(self.owned())} owned)"


# Every live owner by its spans (kept alive by who holds it: a pool's owner, a view, or
# `_owned`); the owners with ranges the kernel may still write (an owner whose reads have
# all returned leaves it: the memory is its holders' again); the views that keep their
# owner (kept weakly); how many registrations each engine's ring was asked for.
_lock = threading.RLock()
_memories: dict[Spans, weakref.ref[HostMemory]] = {}
_owned: dict[Spans, HostMemory] = {}
_holders: weakref.WeakKeyDictionary[Any, HostMemory] = weakref.WeakKeyDictionary()
_made: weakref.WeakKeyDictionary[Engine, int] = weakref.WeakKeyDictionary()


def address_of(buf: Any) -> Range:
    """The address range of host buffer `buf`."""
    a = np.asarray(memoryview(buf)) if not isinstance(buf, np.ndarray) else buf
    start = int(a.__array_interface__["data"][0])
    return start, start + int(a.nbytes)


def spans_of(bufs: Sequence[Any]) -> Spans:
    return tuple(address_of(b) for b in bufs)


def _live() -> list[HostMemory]:
    return [m for m in (r() for r in _memories.values()) if m is not None]


def _owner(spans: Spans) -> HostMemory:
    """The owner of exactly `spans`, made if there is none; a new one takes over the
    kernel's ranges of the unregistered owners inside it (one buffer a read was given up
    in, before the whole memory was registered), so the memory has one owner. Under
    `_lock`."""
    ref = _memories.get(spans)
    got = None if ref is None else ref()
    if got is not None:
        return got
    got = HostMemory(spans)
    for old in _live():
        if not old._rings and all(got.covers(s, e) for s, e in old.spans):
            got._given_up.extend(old._given_up)
            old._given_up = []
            _memories.pop(old.spans, None)
            _owned.pop(old.spans, None)
    if got._given_up:
        _owned[spans] = got

    def gone(r: weakref.ref[HostMemory]) -> None:
        with _lock:
            if _memories.get(spans) is r:
                del _memories[spans]

    _memories[spans] = weakref.ref(got, gone)
    return got


def owner_of(buf: Any) -> HostMemory:
    """The owner of host buffer `buf` (a writable buffer): the one that covers its
    address range if any, else a new one of it alone."""
    start, end = address_of(buf)
    with _lock:
        for m in _live():
            if m.covers(start, end):
                return m
        return _owner(((start, end),))


def register_memory(
    engine: Engine, bufs: Sequence[Any], holder: Any = None, timeout: float = REGISTER_TIMEOUT_S
) -> HostMemory:
    """The owner of `bufs` (writable host buffers), registered with `engine`'s ring once
    per engine and memory: a later call over the same buffers (same addresses and
    lengths) gets the same owner and registration, whoever asks. The registration lasts
    while the owner lives: the returned object (the memory's owner, a serving engine's
    KV pool, may keep it for the memory's life), or `holder` (kept weakly: a destination
    over the memory, for as long as it lives). The kernel pins the pages once; the
    registration holds the buffers (exported) until it ends.

    TimeoutError when the I/O thread has not taken it within `timeout` seconds (a hung
    request holds the thread): the buffers are then never registered with it, and a
    later call tries again."""
    spans = spans_of(bufs)
    with _lock:
        mine = None if holder is None else _holders.get(holder)
        if mine is not None and mine.spans == spans and mine.registered_with(engine):
            return mine
        owner = _owner(spans)
        done = owner.registered_with(engine)
        if not done:
            _made[engine] = _made.get(engine, 0) + 1
    if not done:  # outside the lock: the I/O thread may take its time
        reg = _register(engine, bufs, timeout)
        with _lock:
            extra = reg if owner.registered_with(engine) else None
            owner._rings.setdefault(engine, reg)
        if extra is not None:
            extra.close()  # another thread registered it meanwhile
    if holder is not None:
        with _lock:
            _holders[holder] = owner
    return owner


def _register(engine: Engine, bufs: Sequence[Any], timeout: float) -> MemoryRegistration | None:
    try:
        return engine.register_memory(list(bufs), max(0.0, timeout))
    except (NoFreeSlot, EngineClosedError, EngineBrokenError):
        raise
    except TimeoutError as exc:
        raise TimeoutError(
            f"registering memory waited {timeout:.3g} s for the engine's I/O thread "
            "(a request it holds has not returned); nothing registered"
        ) from exc
    except (OSError, ValueError):
        return None  # the kernel will not pin it: reads go unregistered


def registered(engine: Engine, bufs: Sequence[Any]) -> HostMemory | None:
    """The live owner of exactly `bufs` if it is registered with `engine`'s ring."""
    with _lock:
        ref = _memories.get(spans_of(bufs))
        got = None if ref is None else ref()
    return got if got is not None and got.registered_with(engine) else None


def registrations(engine: Engine) -> int:
    """How many registrations of memory `engine`'s ring was asked for so far."""
    return _made.get(engine, 0)


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
    """`read` was given up while it may still write `where`: those bytes are the kernel's,
    in their owner, until `read.returned()`."""
    bufs, runs = where
    for b in sorted({r[0] for r in runs}):
        buf = bufs[b]
        if buf is None:
            continue
        mine = ranges_of(([buf], [(0, off, at, n) for bi, off, at, n in runs if bi == b]))
        with _lock:
            owner = owner_of(buf)
            owner._given_up.append((tuple(mine), read))
            _owned[owner.spans] = owner


def any_owned() -> bool:
    """Whether any range is owned by the kernel now (cheap: a load skips its checks when
    not)."""
    with _lock:
        return bool(_owned)


def owned_by_kernel(ranges: Iterable[Range]) -> Range | None:
    """The first range the kernel still owns that overlaps one of `ranges`, or None."""
    want = list(ranges)
    if not want or not any_owned():
        return None
    with _lock:
        owners = list(_owned.values())
    for owner in owners:
        for lo, hi in owner.owned():
            for a, b in want:
                if a < hi and lo < b:
                    return lo, hi
    return None


def wait_returned(ranges: Sequence[Range] | None, timeout: float) -> bool:
    """Wait until the kernel owns none of `ranges` (None: no range at all), at most
    `timeout` seconds; whether it does not."""
    return _poll(lambda: owned_by_kernel(ranges) if ranges is not None else _any_left(), timeout)


def _poll(held: Callable[[], Range | None], timeout: float) -> bool:
    """Poll `held()` (a range still owned, or None) until None or `timeout` seconds: the
    reads' completions are the engine's. Backs off from 1 ms to 50 ms."""
    deadline = time.monotonic() + timeout
    pause = 0.001
    while True:
        if held() is None:
            return True
        if time.monotonic() >= deadline:
            return False
        time.sleep(pause)
        pause = min(pause * 2, 0.05)


def _any_left() -> Range | None:
    with _lock:
        owners = list(_owned.values())
    for owner in owners:
        left = owner.owned()
        if left:
            return left[0]
    return None
