"""Windowed install: stream hit chunks through at most W staging slots.

Reads for chunks i+1..i+W-1 are in flight in the engine (which keeps its queue
full on its own I/O thread) while chunk i is installed into the destination.
A new read starts only when an earlier chunk's slot has been installed and
dropped, so reads in flight plus slots awaiting an asynchronous install never
exceed W. A chunk that fails in its source tier is invalidated there and read
again from the next tier that holds it, inside the same window position. Tiers
that can (`defers_verify`) leave the payload check to the install, which hashes
while it copies (install.py); a mismatch there is a chunk failure like the others.

Records may differ in size (a hybrid model's groups each have records of their own):
`sizes[i]` is record i's payload. Every wait has a deadline: a read still in flight
at `read_deadline` ends the run (its slot stays with the engine until the kernel
gives it back; nothing is invalidated for slowness). Before any slot goes back to
the ring, the copies out of it (a CUDA install's fence) are waited for, on every
path out of `run`.

Direct reads: where the destination owns plain host memory for the restore
(`direct_reads`, `host_runs`) and the tier can (`submit_read_into`), a chunk is read
with O_DIRECT straight into its blocks and hashed there (as its requests land, where
the tier can: `DirectChunk.wait_hashed`): no slot, no copy. It still
holds one of the W window positions while in flight. Memory or lengths that O_DIRECT
refuses (AlignmentError: torch's 64-byte-aligned tensors, a 512-byte drive's odd
run) send the rest of the run through slots. A hash that differs proves nothing yet
(the bytes lie in memory the caller owns): the chunk is read once more through a slot
from the same tier, and only if that copy is bad too is it a chunk failure like any
other (the record is withdrawn, a lower tier re-reads the chunk into the same blocks).
A direct read has the run's deadline too: past it, it is given up (a pool call still
queued never runs, a file read still queued in the engine is withdrawn) and, when it
may still write the destination's blocks, they are reported unusable
(`InstallReport.unusable`) and left to the kernel (memory.py: by address, until the read
returns them): the run ends `zero` with no fallback into them, and no later run reads
into those bytes, through whatever destination object it is given (`KernelOwnedMemory`,
before anything is read). A destination
that lasts across restores (`lasting`) has its host buffers registered with the engine's
ring at its first direct read, for as long as it lives, so the kernel pins its pages once
instead of per request.

The run's last direct read goes to the kernel at most `tail_inflight` bytes at a time.
Nothing comes after it to overlap its hash, and a chunk whose requests are all in flight
at once lands all at once, at the end: its whole hash then follows the drive (about 2 ms
for a 16 MiB chunk). Capped at 8 MiB, the first half lands and is hashed while the rest
is read, and the drive is no slower for it (`bsr-lab bench ttft --sweep
--compare-no-tail`: the same restore uncapped, interleaved).

Each window position holds one of three reads (`_Read`): a read into a ring slot
(`_SlotRead`), a read straight into the destination (`_DirectRead`: a file's O_DIRECT
read or a pool's scatter read, both a tier's `DirectChunk`), or a read that never
started (`_NotStarted`, its cause kept for the fallback). Each knows how it lands
(waits, is verified, is installed) and how it ends unused when the run stops early.
"""

from __future__ import annotations

import time
from abc import ABC, abstractmethod
from collections import deque
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from functools import partial
from typing import Any

from bsr_io._core import (
    AlignmentError,
    Engine,
    NoFreeSlot,
    Slot,
    xxh3_runs,
)
from bsr_io.engine import give_back, wait_for_slot
from bsr_io.errors import (
    BsrValueError,
    ChunkError,
    DestinationUnusable,
    KernelOwnedMemory,
    LayoutError,
    Unproven,
)
from bsr_io.load import memory
from bsr_io.load.discovery import holds
from bsr_io.load.install import fused_runs, install_chunk, scoped
from bsr_io.load.kvcache import Destination, Fence
from bsr_io.load.memory import HostRuns
from bsr_io.model.keys import ChunkKey
from bsr_io.tiers.base import (
    ENGINE_ERRORS,
    DirectChunk,
    DirectUnavailable,
    PendingChunk,
    Tier,
    reads_by,
    reads_end,
)

# The last direct read's bytes in the kernel at once (module docstring).
TAIL_INFLIGHT = 8 << 20


def _record_of(exc: BaseException) -> object | None:
    """The failed record to withdraw: a ChunkError names it (its tier decides whether the
    error proves it bad); any other error (a copy into the destination failed, an
    errno from elsewhere) proves nothing about the stored bytes."""
    if isinstance(exc, ChunkError):
        return getattr(exc, "record", None)
    return Unproven(None, type(exc).__name__)


class ReadTimedOut(Exception):
    """A read was still in flight at the run's deadline (a hung device, a stalled mount).

    Not a chunk failure: the record may be fine, so nothing is invalidated. `where` is
    what the wait said of the read (the engine's: in the kernel since when, or still
    queued in the engine), so that a stalled device and a held queue read differently."""

    def __init__(self, index: int, key: ChunkKey, where: str = "") -> None:
        self.index = index
        self.key = key
        said = f" ({where})" if where else ""
        super().__init__(
            f"read of chunk {index} ({key.short()}) still in flight at the deadline{said}"
        )


def _whereabouts(exc: TimeoutError) -> str:
    """What a timed-out wait said of its read, without the errno and the generic words
    around it: "read of PATH sent 3.1 s ago, in the kernel for 3.0 s"."""
    said = exc.strerror if isinstance(exc.strerror, str) else str(exc)
    return said.split("timed out waiting for the operation: ", 1)[-1]


class ChunkUnavailable(Exception):
    """No tier could deliver a verified copy of a chunk."""

    def __init__(self, index: int, key: ChunkKey, causes: list[str]) -> None:
        self.index = index
        self.key = key
        self.causes = causes
        super().__init__(f"chunk {index} unavailable in every tier: {'; '.join(causes)}")


@dataclass
class _Trail:
    """Chunk `index`'s failed tries so far. Causes are kept as text, never as exceptions,
    whose frames could keep a slot or the destination's memory alive."""

    index: int
    key: ChunkKey
    causes: list[str] = field(default_factory=list)
    record: object | None = None  # the last failed record, to withdraw exactly that one

    def failed(self, cause: str, record: object | None) -> None:
        self.causes.append(cause)
        self.record = record

    def failed_in(self, tier: Tier, exc: BaseException) -> None:
        self.failed(f"{tier.name}: {exc}", _record_of(exc))


@dataclass
class _Landed:
    """A chunk installed from tier `source`. `slot` is None for a direct read; `fence`,
    when set, is an install still copying out of (or, in parallel, hashing) the slot."""

    source: int
    causes: list[str]  # why the tiers above `source` failed, empty without a fallback
    slot: Slot | None = None
    fence: Fence | None = None


@dataclass
class _Held:
    """An install whose copy may still read `slot`: the slot goes back after `fence`."""

    slot: Slot
    fence: Fence
    index: int
    key: ChunkKey
    source: int


class _ParallelInstall:
    """A fused install running on an install thread: its fence. `synchronize` raises the
    tier's ChunkCorrupt when the hash differs from the record header's."""

    def __init__(self, future: Future[int], pending: PendingChunk) -> None:
        self.future, self.pending = future, pending

    def synchronize(self) -> None:
        if self.future.result() != self.pending.expected_xxh3:
            raise self.pending.reject("payload checksum mismatch after the install copy")


@dataclass
class _Read(ABC):
    """One window position: chunk `index`'s first read, from tier `source`."""

    index: int
    key: ChunkKey
    source: int

    @abstractmethod
    def land(self, window: Window, trail: _Trail) -> _Landed | None:
        """Wait for the read (ReadTimedOut at the deadline), verify and install the
        chunk; None when it failed here, with the cause on `trail`."""

    @abstractmethod
    def drain(self, window: Window, timeout: float) -> None:
        """The run ended before this read landed: let it end, unused. May raise the
        read's ChunkError or OSError, which the ended run ignores."""


@dataclass
class _SlotRead(_Read):
    """A read into a ring slot, installed from there; verified by its tier, or by the
    install where the tier defers that (`handle.expected_xxh3`)."""

    handle: PendingChunk

    def wait(self, timeout: float) -> Slot:
        """The read's slot, or ReadTimedOut at the deadline (the read stays in flight,
        unless it was still queued in the engine: withdrawn then)."""
        try:
            return self.handle.wait(timeout)
        except TimeoutError as exc:
            self.handle.withdraw()  # still queued in the engine: its slot back now
            raise ReadTimedOut(self.index, self.key, _whereabouts(exc)) from None

    def land(self, window: Window, trail: _Trail) -> _Landed | None:
        return window._attempt(
            self.source, trail, lambda: self.wait(window._remaining()), self.handle
        )

    def drain(self, window: Window, timeout: float) -> None:
        # Still queued in the engine: withdrawn, its slot back in the ring now. Else the
        # engine keeps a slot the kernel may still write until its completion arrives.
        if not self.handle.withdraw():
            give_back(self.handle.wait(timeout))


@dataclass
class _DirectRead(_Read):
    """A read straight into the destination's blocks along `where` (an O_DIRECT file read
    or a pool's scatter read): no slot, no copy; hashed where the bytes lie."""

    handle: DirectChunk
    where: HostRuns

    def wait(
        self, window: Window, timeout: float, hashed: bool = False
    ) -> tuple[int, float] | None:
        """The bytes are in place, or ReadTimedOut at the deadline: the read is given up
        then, and its blocks, which it may still write, are reported unusable (unless it
        never started). DestinationUnusable when its tier gave it up the same way.
        `hashed`: hashed as they landed where the tier can (`DirectChunk.wait_hashed`)."""
        try:
            got = self.handle.wait_hashed(timeout) if hashed else None
            if got is None:
                self.handle.wait(timeout)
            return got
        except TimeoutError as exc:
            if not self.handle.done() and not self.handle.abandon():
                window._unusable(self.index, self.handle, self.where)
            raise ReadTimedOut(self.index, self.key, _whereabouts(exc)) from None
        except DestinationUnusable:
            window._unusable(self.index, self.handle, self.where)
            raise

    def land(self, window: Window, trail: _Trail) -> _Landed | None:
        tier = window.tiers[self.source]
        try:
            # Hashed as its requests landed, but for the last one's bytes; nothing counts
            # as verified before the whole payload's hash matched the record's.
            hashed = self.wait(window, window._remaining(), hashed=True)
            got = window._hash_in_place(self.where, hashed)
            # A pool's header arrives with its payload: the expected hash is final only now.
            if got == self.handle.expected_xxh3:
                window._direct_done += 1
                return _Landed(self.source, trail.causes)
        except ChunkError as exc:
            trail.failed_in(tier, exc)
            return None
        # The bytes landed in memory bsr-io does not own (its owner may write these blocks,
        # a registration may be stale): no proof the record is bad. Read it once more
        # through a slot, which the tier checks itself, withdrawing the record only if
        # that copy is bad too.
        trail.failed(f"{tier.name}: payload checksum mismatch after a direct read", None)
        return window._attempt(
            self.source, trail, partial(window._read_bounded, self.source, trail)
        )

    def drain(self, window: Window, timeout: float) -> None:
        # The destination's own memory: waited for until the deadline, then given up and
        # its blocks reported unusable (never handed back while it may still be written).
        try:
            self.wait(window, timeout)
        except ReadTimedOut:
            pass


@dataclass
class _NotStarted(_Read):
    """A read its tier refused to start: the chunk goes straight to the fallback."""

    cause: str
    record: object | None  # the failed record (for exact invalidation)

    def land(self, window: Window, trail: _Trail) -> _Landed | None:
        trail.failed(self.cause, self.record)
        return None

    def drain(self, window: Window, timeout: float) -> None:
        pass  # nothing in flight


def register_once(engine: Engine, dest: Destination, bufs: Sequence[Any], timeout: float) -> None:
    """Register a lasting destination's buffers with `engine`'s ring, once per memory:
    the destination is a view of the memory's one owner (memory.py `HostMemory`), which
    every destination over the same buffers (per-request views of one serving pool)
    shares, and which lasts while one of them, or the pool's owner
    (`PagedKVCache.register`), holds it. TimeoutError past `timeout`."""
    memory.register_memory(engine, bufs, holder=dest, timeout=timeout)


@dataclass
class InstallReport:
    installed: int = 0
    sources: list[str] = field(default_factory=list)  # tier name per installed chunk
    fallbacks: list[dict[str, Any]] = field(default_factory=list)
    bytes_read: dict[str, int] = field(default_factory=dict)
    error: str = ""
    read_wait_s: float = 0.0
    install_s: float = 0.0
    failed_chunks: list[int] = field(default_factory=list)  # no tier had a good copy
    timed_out: bool = False  # a read was still in flight at the deadline
    direct: int = 0  # chunks read straight into the destination and verified there
    # Chunks whose destination blocks a read given up may still write: never reused.
    unusable: list[int] = field(default_factory=list)
    # Those reads, kept: the caller learns from them when the memory is its own again.
    given_up: list[DirectChunk] = field(default_factory=list)
    # When each step of the run happened (time.perf_counter): "begin", "registered"
    # (a lasting destination's buffers with the ring), "first_submitted" (chunk 0's read
    # handed to the engine), "first_hash" and "last_hash" (a chunk's read had landed: its
    # last request's end where it was hashed as it landed, else when its hash began),
    # "end". A bench's phase breakdown; a few stamps per run.
    marks: dict[str, float] = field(default_factory=dict)


def chunk_ranges(dest: Destination, index: int) -> list[memory.Range]:
    """The host address ranges chunk `index` of `dest` lies in (none off the host)."""
    where = fused_runs(dest, index)
    return [] if where is None else memory.ranges_of(where)


def _kernel_owned(dest: Destination, chunks: int) -> Iterator[tuple[int, memory.Range]]:
    """Each of `dest`'s first `chunks` chunks whose memory a read given up earlier may
    still write, with the range the kernel owns (memory.py: by address)."""
    if not memory.any_owned():
        return
    whole = getattr(dest, "host_memory", None)
    if whole is not None and memory.owned_by_kernel(map(memory.address_of, whole())) is None:
        return  # none of its memory is the kernel's: no chunk to look at
    for i in range(chunks):
        held = memory.owned_by_kernel(chunk_ranges(dest, i))
        if held is not None:
            yield i, held


def unusable_chunks(dest: Destination) -> frozenset[int]:
    """The chunks of `dest` whose bytes a given-up read may still write (memory.py: by
    address, whichever object `dest` is)."""
    return frozenset(i for i, _ in _kernel_owned(dest, getattr(dest, "capacity_chunks", 0)))


def refuse_kernel_owned(dest: Destination, chunks: int) -> None:
    """KernelOwnedMemory when a read given up earlier may still write the memory of one
    of `dest`'s first `chunks` chunks."""
    for i, (lo, hi) in _kernel_owned(dest, chunks):
        raise KernelOwnedMemory(
            f"chunk {i}'s host memory may still be written by a read given up earlier: "
            f"bytes {lo:#x}..{hi:#x} are still owned by the kernel until it returns "
            "them; restore into other memory",
            start=lo,
            end=hi,
        )


class Window:
    """Reads hit chunks through `engine` (W slots) and installs them in order."""

    # One run's state, set by `_begin`.
    _keys: Sequence[ChunkKey]
    _sources: Sequence[int]
    _dest: Destination
    _report: InstallReport
    _reads: deque[_Read]  # started reads, in chunk order
    _held: deque[_Held]  # installs still copying out of their slots
    _next: int  # the next chunk to start reading
    _direct_done: int

    def __init__(
        self,
        engine: Engine,
        tiers: Sequence[Tier],
        chunk_bytes: int,
        width: int | None = None,
        fused: bool = True,
        install_threads: int = 1,
        direct: bool = True,
        tail_inflight: int | None = TAIL_INFLIGHT,
    ) -> None:
        if width is not None and not 1 <= width <= engine.window:
            raise BsrValueError(f"window width {width} must be in [1, {engine.window}] slots")
        self.engine = engine
        self.tiers = list(tiers)
        self.chunk_bytes = chunk_bytes
        self.width = width or engine.window
        self.fused = fused  # verify while copying where the destination allows it
        if install_threads < 1:
            raise BsrValueError(f"install_threads must be at least 1, got {install_threads}")
        # Above 1, fused installs of several chunks run at once on their own threads
        # (GIL released), each holding its slot until it is verified.
        self.install_threads = install_threads
        self.direct = direct  # read straight into destinations that allow it
        if tail_inflight is not None and tail_inflight < 1:
            raise BsrValueError(f"tail_inflight must be a positive byte count, got {tail_inflight}")
        self.tail_inflight = tail_inflight  # the last direct read's bytes in the kernel
        self._direct_now = False  # ... and this run's destination does, so far
        self._register = False  # ... and lasts: register it before its first direct read
        self._pool: ThreadPoolExecutor | None = None
        self._install_s = 0.0
        self._sizes: Sequence[int] | None = None
        self._deadline = self._read_deadline = time.monotonic() + 30.0

    def run(
        self,
        keys: Sequence[ChunkKey],
        sources: Sequence[int],
        dest: Destination,
        should_stop: Callable[[], bool] = lambda: False,
        stop_every: int | None = None,
        slot_deadline: float | None = None,
        *,
        sizes: Sequence[int] | None = None,
        read_deadline: float | None = None,
        keep_going: bool = False,
    ) -> InstallReport:
        """Install `keys` from their `sources`. When the engine has no free slot (shared,
        or a slot held elsewhere) the window narrows, and with nothing of its own in
        flight it waits for one until `slot_deadline` (time.monotonic; default 30 s),
        then raises EngineBusy: nothing is invalidated for the engine's own state.

        `sizes[i]`: record i's payload bytes (default `chunk_bytes` for all). A read not
        done by `read_deadline` (default `slot_deadline`) ends the run with `timed_out`.
        `keep_going`: after a chunk no tier can deliver, go on through the rest, so one
        failed load finds (and its tiers withdraw) every bad record, not the first only;
        the run still reports the failure."""
        self._begin(keys, sources, dest, sizes, slot_deadline, read_deadline)
        report = self._report
        report.marks["begin"] = time.perf_counter()
        stop_every = stop_every or self.width
        deadline = reads_by(self._read_deadline)  # a tier's waits to start a read too
        try:
            refuse_kernel_owned(dest, len(keys))
            for i in range(len(keys)):
                self._fill()
                if not self._install_next(i, keep_going):
                    continue  # chunk i failed in every tier and the run goes on
                if (i + 1) % stop_every == 0 and should_stop():
                    report.error = "a peer rank aborted the restore"
                    break
            while self._held:
                self._settle(self._held.popleft())
            dest.synchronize()
        except ChunkUnavailable as exc:
            report.failed_chunks.append(exc.index)
            report.error = str(exc)
        except ReadTimedOut as exc:
            report.timed_out = True
            report.error = str(exc)
        except DestinationUnusable as exc:
            report.error = str(exc)
        finally:
            self._end()
            reads_end(deadline)
            report.marks["end"] = time.perf_counter()
        if report.failed_chunks and not report.error:
            report.error = f"chunks {report.failed_chunks[:8]} unavailable in every tier"
        return report

    # -- one run, in order -------------------------------------------------------------

    def _begin(
        self,
        keys: Sequence[ChunkKey],
        sources: Sequence[int],
        dest: Destination,
        sizes: Sequence[int] | None,
        slot_deadline: float | None,
        read_deadline: float | None,
    ) -> None:
        """Check the sizes and set up this run's state."""
        n = len(keys)
        if sizes is not None:
            if len(sizes) != n:
                raise BsrValueError(f"{len(sizes)} record sizes for {n} keys")
            big = max(sizes, default=0)
            if big > self.engine.slot_bytes:
                raise BsrValueError(
                    f"a record of {big} bytes does not fit the engine's "
                    f"{self.engine.slot_bytes}-byte slots"
                )
        self._deadline = time.monotonic() + 30.0 if slot_deadline is None else slot_deadline
        self._read_deadline = self._deadline if read_deadline is None else read_deadline
        self._keys, self._sources, self._dest, self._sizes = keys, sources, dest, sizes
        self._direct_now = self.direct and bool(getattr(dest, "direct_reads", False))
        self._register = self._direct_now and bool(getattr(dest, "lasting", False))
        self._direct_done = 0
        self._report = InstallReport()
        self._reads, self._held, self._next = deque(), deque(), 0
        if self.install_threads > 1:
            self._pool = ThreadPoolExecutor(self.install_threads, "bsr-install")

    def _fill(self) -> None:
        """Every free window position gets a read before the next chunk is installed."""
        while self._next < len(self._keys) and len(self._reads) + len(self._held) < self.width:
            try:
                self._reads.append(self._submit(self._next))
                if self._next == 0:
                    self._report.marks["first_submitted"] = time.perf_counter()
            except NoFreeSlot:
                # Back-pressure: finish what is ours first; with nothing of ours in
                # flight, wait for someone else's slot.
                if self._reads:
                    return
                if self._held:
                    self._settle(self._held.popleft())
                else:
                    wait_for_slot(self.engine, self._deadline)
                continue
            self._next += 1

    def _submit(self, index: int) -> _Read:
        """Start chunk `index`'s read in its source tier, straight into the destination
        where both allow it; a failure to start is kept for the fallback."""
        key, source = self._keys[index], self._sources[index]
        tier = self.tiers[source]
        if self._direct_now:
            direct = self._submit_direct(index, key, source, tier)
            if direct is not None:
                return direct
        try:
            if tier.defers_verify:
                # Only tiers that defer the check (record-file tiers) take `verify`.
                pending = tier.submit_read(key, self.engine, verify=False)  # type: ignore[call-arg]
            else:
                pending = tier.submit_read(key, self.engine)
        except ENGINE_ERRORS:
            raise  # the engine's own state (full, closed): never a failed chunk
        except (ChunkError, OSError) as exc:
            return _NotStarted(index, key, source, f"{tier.name}: {exc}", _record_of(exc))
        return _SlotRead(index, key, source, pending)

    def _submit_direct(self, index: int, key: ChunkKey, source: int, tier: Tier) -> _Read | None:
        """A read of chunk `index` straight into its blocks, or None: read it through a
        slot (the tier cannot, or the destination's memory is not plain host memory)."""
        into = getattr(tier, "submit_read_into", None)
        if into is None:
            return None
        where = fused_runs(self._dest, index)
        if where is None or not all(b is not None for b in where[0]):
            return None
        if self._register:
            self._register = False
            try:
                register_once(self.engine, self._dest, where[0], self._remaining())
                self._report.marks["registered"] = time.perf_counter()
            except TimeoutError:
                # The I/O thread is held past the run's deadline: no direct read (its
                # blocks would be written late); slot reads end the run as timed out.
                self._direct_now = False
                return None
        try:
            last = index == len(self._keys) - 1
            cap = self.tail_inflight if last else None
            read = into(key, self.engine, *where, inflight=cap)
            return _DirectRead(index, key, source, read, where)
        except ENGINE_ERRORS:
            raise
        except (AlignmentError, LayoutError):
            self._direct_now = False  # this destination's memory: slots from here
        except DirectUnavailable:
            pass  # this tier (drive) reads through a slot
        except (ChunkError, OSError) as exc:
            return _NotStarted(index, key, source, f"{tier.name}: {exc}", _record_of(exc))
        return None

    def _install_next(self, index: int, keep_going: bool) -> bool:
        """Reap, verify and install chunk `index`, from a lower tier where its read failed.
        False when no tier had it and `keep_going` lets the run go on."""
        report = self._report
        t0 = time.perf_counter()
        self._install_s = 0.0
        try:
            landed = self._land(self._reads.popleft())
        except ChunkUnavailable as exc:
            if not keep_going:
                raise
            report.failed_chunks.append(index)
            report.error = report.error or str(exc)
            return False
        t1 = time.perf_counter()
        report.read_wait_s += t1 - t0 - self._install_s
        name = self._credit(index, landed)
        self._hold(index, landed)
        del landed  # a slot not held is back in the ring: nothing here keeps it
        report.install_s += self._install_s + time.perf_counter() - t1
        report.installed += 1
        report.sources.append(name)  # a parallel install's fallback rewrites it
        return True

    def _land(self, read: _Read) -> _Landed:
        """Chunk `read.index` installed verified, from its source tier, else a lower one."""
        trail = _Trail(read.index, read.key)
        landed = read.land(self, trail)
        if landed is not None:
            return landed
        source = read.source
        del read  # the failed read's slot must be free for the fallback read
        return self._fallback(trail, source)

    def _fallback(self, trail: _Trail, source: int) -> _Landed:
        """The chunk failed in tier `source`: withdraw that record and install the chunk
        from the next tier that holds a good copy, into the same blocks."""
        self._invalidate(source, trail)
        for ti in range(source + 1, len(self.tiers)):
            if not holds(self.tiers[ti], trail.key):
                continue
            # Checked by the tier itself (no deferred verification on a fallback).
            landed = self._attempt(ti, trail, partial(self._read_bounded, ti, trail))
            if landed is not None:
                return landed
            self._invalidate(ti, trail)
        raise ChunkUnavailable(trail.index, trail.key, trail.causes)

    def _hold(self, index: int, landed: _Landed) -> None:
        """Keep the slot an install still copies out of; any other slot goes back now."""
        if landed.fence is None:
            if landed.slot is not None:
                give_back(landed.slot)
            return
        assert landed.slot is not None  # an install's fence is a slot's copy
        self._held.append(_Held(landed.slot, landed.fence, index, self._keys[index], landed.source))
        parallel = isinstance(landed.fence, _ParallelInstall)
        if len(self._held) >= (self.install_threads if parallel else self.width):
            self._settle(self._held.popleft())

    def _settle(self, held: _Held) -> None:
        """Wait for one held install; a chunk that fails its check after a parallel
        install is re-read from a lower tier into the same blocks (synchronously)."""
        index, key, source = held.index, held.key, held.source
        t0 = time.perf_counter()
        try:
            held.fence.synchronize()
            return
        except ChunkError as exc:
            trail = _Trail(index, key)
            trail.failed_in(self.tiers[source], exc)
        finally:
            give_back(held.slot)
            del held
            self._report.install_s += time.perf_counter() - t0
        landed = self._fallback(trail, source)
        assert landed.slot is not None  # a fallback reads through a slot
        if landed.fence is not None:
            landed.fence.synchronize()
        give_back(landed.slot)
        self._report.sources[index] = self._credit(index, landed)

    def _end(self) -> None:
        """However the run ended, what still touches memory ends before it is let go."""
        if self._pool is not None:
            # Installs still running write into the destination: let them finish.
            self._pool.shutdown(wait=True)
            self._pool = None
        # An asynchronous copy (CUDA) may still read a held slot: wait for it before
        # the slot goes back to the ring, whatever ended the run.
        while self._held:
            held = self._held.popleft()
            try:
                held.fence.synchronize()
            except (ChunkError, OSError):
                pass  # the outcome is already a failure; only the wait mattered
            give_back(held.slot)
            del held
        # Reads already started own their memory until they complete: a slot read is
        # waited for until the deadline, then dropped (the engine keeps its slot); so is
        # a direct read, whose blocks are then reported unusable (`_unusable`). A slot
        # read still queued in the engine is withdrawn, its slot back at once.
        while self._reads:
            read = self._reads.popleft()
            try:
                read.drain(self, self._remaining())
            except (ChunkError, OSError, DestinationUnusable):
                pass
            del read  # the destination's memory is not the window's to keep
        self._report.direct = self._direct_done

    # -- one try at a chunk ----------------------------------------------------------------

    def _attempt(
        self,
        source: int,
        trail: _Trail,
        read: Callable[[], Slot],
        pending: PendingChunk | None = None,
    ) -> _Landed | None:
        """One try at the chunk from tier `source`: installed, or None with the cause on
        `trail`. `read()` gives its slot. A failed try's slot goes back at once,
        also when the destination raised: the caller may keep that exception, whose
        frames must not keep the slot."""
        slot = None
        try:
            slot = read()
            return _Landed(source, trail.causes, slot, self._install(trail.index, slot, pending))
        except ENGINE_ERRORS:
            raise
        except (ChunkError, OSError) as exc:
            trail.failed_in(self.tiers[source], exc)
        except BaseException:
            if slot is not None:
                give_back(slot)
            raise
        if slot is not None:
            give_back(slot)
        return None

    def _read_bounded(self, source: int, trail: _Trail) -> Slot:
        """A fallback read from tier `source`, checked by the tier, waiting for a free
        slot and for the read itself no later than the deadline."""
        while True:
            try:
                pending = self.tiers[source].submit_read(trail.key, self.engine)
                break
            except NoFreeSlot:
                wait_for_slot(self.engine, self._deadline)
        return _SlotRead(trail.index, trail.key, source, pending).wait(self._remaining())

    def _install(self, index: int, slot: Slot, pending: PendingChunk | None) -> Fence | None:
        t0 = self._hash_mark()
        try:
            if self._pool is not None and pending is not None and pending.expected_xxh3 is not None:
                where = fused_runs(self._dest, index) if self.fused else None
                if where is not None:
                    job = self._pool.submit(scoped(self._dest, slot.install_xxh3), *where)
                    return _ParallelInstall(job, pending)
            return install_chunk(self._dest, index, slot, self._size(index), pending, self.fused)
        finally:
            self._install_s += time.perf_counter() - t0

    def _unusable(self, index: int, handle: DirectChunk, where: HostRuns) -> None:
        """Chunk `index`'s blocks (`where`) may still be written by a read given up
        (`handle`): reported, and left to the kernel by address until the read returns
        them (memory.py), so that no later run reads into them, through any view."""
        self._report.unusable.append(index)
        self._report.given_up.append(handle)
        memory.give_up(where, handle)

    def _hash_in_place(self, where: HostRuns, hashed: tuple[int, float] | None = None) -> int:
        """xxh3 of a direct read's bytes where they lie (counted as install time), or
        `hashed`'s (xxh3, landed at) when the read hashed them as they landed: then
        what ran after the landing counts."""
        if hashed is not None:
            got, landed = hashed
            self._hash_mark(landed)
            self._install_s += time.perf_counter() - landed
            return got
        t0 = self._hash_mark()
        got = xxh3_runs(*where)
        self._install_s += time.perf_counter() - t0
        return got

    def _hash_mark(self, at: float | None = None) -> float:
        """Now (or `at`); a chunk's read has landed and its verification begins."""
        now = time.perf_counter() if at is None else at
        marks = self._report.marks
        marks.setdefault("first_hash", now)
        marks["last_hash"] = now
        return now

    def _credit(self, index: int, landed: _Landed) -> str:
        """Count chunk `index`'s bytes (and its fallback) to the tier that delivered it."""
        name = self.tiers[landed.source].name
        report = self._report
        if landed.causes:
            report.fallbacks.append({"chunk": index, "tier": name, "causes": landed.causes})
        report.bytes_read[name] = report.bytes_read.get(name, 0) + self._size(index)
        return name

    def _invalidate(self, ti: int, trail: _Trail) -> None:
        """Withdraw exactly the record that failed (a newer one at its place stays)."""
        try:
            if trail.record is None:
                self.tiers[ti].invalidate(trail.key, trail.causes[-1])
            else:
                self.tiers[ti].invalidate(trail.key, trail.causes[-1], record=trail.record)
        except (ChunkError, OSError):
            pass  # a tier that is down cannot record the loss; discovery skips it anyway

    def _size(self, index: int) -> int:
        return self.chunk_bytes if self._sizes is None else self._sizes[index]

    def _remaining(self) -> float:
        return max(0.0, self._read_deadline - time.monotonic())
