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
with O_DIRECT straight into its blocks and hashed there: no slot, no copy. It still
holds one of the W window positions while in flight. Memory or lengths that O_DIRECT
refuses (AlignmentError: torch's 64-byte-aligned tensors, a 512-byte drive's odd
run) send the rest of the run through slots; a hash that differs is a chunk failure
like any other (the record is withdrawn, a lower tier re-reads the chunk into the same
blocks through a slot). A direct read is never abandoned: its memory is the
destination's, so even past the deadline the run waits for it to end. A destination
that lasts across restores (`lasting`) has its host buffers registered with the
engine's ring at its first direct read, for as long as it lives, so the kernel pins its
pages once instead of per request.
"""

from __future__ import annotations

import time
import weakref
from collections import deque
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from functools import partial
from typing import Any

from bsr_io._core import (
    AlignmentError,
    Engine,
    MemoryRegistration,
    NoFreeSlot,
    Slot,
    xxh3_runs,
)
from bsr_io.engine import give_back, wait_for_slot
from bsr_io.errors import ChunkError, LayoutError, Unproven
from bsr_io.load.discovery import holds
from bsr_io.load.install import HostRuns, fused_runs, install_chunk, scoped
from bsr_io.load.kvcache import Destination, Fence
from bsr_io.model.keys import ChunkKey
from bsr_io.tiers.base import ENGINE_ERRORS, DirectChunk, DirectUnavailable, PendingChunk, Tier


class _NotStarted(str):
    """Why a read could not start, and which record failed (for exact invalidation)."""

    record: object | None = None


def _not_started(text: str, exc: BaseException) -> _NotStarted:
    out = _NotStarted(text)
    out.record = _record_of(exc)
    return out


def _record_of(exc: BaseException) -> object | None:
    """The failed record to withdraw: a ChunkError names it (its tier decides whether the
    error proves it bad); any other error (a copy into the destination failed, an
    errno from elsewhere) proves nothing about the stored bytes."""
    if isinstance(exc, ChunkError):
        return getattr(exc, "record", None)
    return Unproven(None, type(exc).__name__)


class _ParallelInstall:
    """A fused install running on an install thread: its fence. `synchronize` raises the
    tier's ChunkCorrupt when the hash differs from the record header's."""

    def __init__(self, future: Future[int], pending: PendingChunk) -> None:
        self.future, self.pending = future, pending

    def synchronize(self) -> None:
        if self.future.result() != self.pending.expected_xxh3:
            raise self.pending.reject("payload checksum mismatch after the install copy")


class ReadTimedOut(Exception):
    """A read was still in flight at the run's deadline (a hung device, a stalled mount).

    Not a chunk failure: the record may be fine, so nothing is invalidated."""

    def __init__(self, index: int, key: ChunkKey) -> None:
        self.index = index
        self.key = key
        super().__init__(f"read of chunk {index} ({key.short()}) still in flight at the deadline")


class ChunkUnavailable(Exception):
    """No tier could deliver a verified copy of a chunk."""

    def __init__(self, index: int, key: ChunkKey, causes: list[str]) -> None:
        self.index = index
        self.key = key
        self.causes = causes
        super().__init__(f"chunk {index} unavailable in every tier: {'; '.join(causes)}")


# Per engine, the lasting destinations whose buffers are registered with its ring (None:
# the kernel would not take them), each for as long as both live: windows come and go
# with restores, a KV cache and its engine stay.
_REGISTERED: weakref.WeakKeyDictionary[
    Engine, weakref.WeakKeyDictionary[Destination, MemoryRegistration | None]
] = weakref.WeakKeyDictionary()


def register_once(engine: Engine, dest: Destination, bufs: Sequence[Any]) -> None:
    """Register a lasting destination's buffers with `engine`'s ring unless done; where
    the kernel refuses (RLIMIT_MEMLOCK, a full table), its reads stay unregistered."""
    done = _REGISTERED.get(engine)
    if done is None:
        done = _REGISTERED[engine] = weakref.WeakKeyDictionary()
    elif dest in done:
        return
    try:
        done[dest] = engine.register_memory(bufs)
    except ENGINE_ERRORS:
        raise
    except (OSError, ValueError):
        done[dest] = None


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


class Window:
    """Reads hit chunks through `engine` (W slots) and installs them in order."""

    def __init__(
        self,
        engine: Engine,
        tiers: Sequence[Tier],
        chunk_bytes: int,
        width: int | None = None,
        fused: bool = True,
        install_threads: int = 1,
        direct: bool = True,
    ) -> None:
        if width is not None and not 1 <= width <= engine.window:
            raise ValueError(f"window width {width} must be in [1, {engine.window}] slots")
        self.engine = engine
        self.tiers = list(tiers)
        self.chunk_bytes = chunk_bytes
        self.width = width or engine.window
        self.fused = fused  # verify while copying where the destination allows it
        if install_threads < 1:
            raise ValueError(f"install_threads must be at least 1, got {install_threads}")
        # Above 1, fused installs of several chunks run at once on their own threads
        # (GIL released), each holding its slot until it is verified.
        self.install_threads = install_threads
        self.direct = direct  # read straight into destinations that allow it
        self._direct_now = False  # ... and this run's destination does, so far
        self._register = False  # ... and lasts: register it before its first direct read
        self._direct_runs: dict[int, HostRuns] = {}  # chunk -> the memory its read fills
        self._pool: ThreadPoolExecutor | None = None
        self._install_s = 0.0
        self._sizes: Sequence[int] | None = None
        self._deadline = self._read_deadline = time.monotonic() + 30.0

    def _size(self, index: int) -> int:
        return self.chunk_bytes if self._sizes is None else self._sizes[index]

    def _remaining(self) -> float:
        return max(0.0, self._read_deadline - time.monotonic())

    def _wait(self, pending: PendingChunk, index: int) -> Slot:
        """The read's slot, or ReadTimedOut at the deadline (the read stays in flight)."""
        try:
            return pending.wait(self._remaining())
        except TimeoutError:
            raise ReadTimedOut(index, pending.key) from None

    def _read_bounded(self, tier: Tier, key: ChunkKey, index: int) -> Slot:
        """A fallback read from `tier`, checked by the tier, waiting for a free slot and
        for the read itself no later than the deadline."""
        while True:
            try:
                pending = tier.submit_read(key, self.engine)
                break
            except NoFreeSlot:
                wait_for_slot(self.engine, self._deadline)
        return self._wait(pending, index)

    def _submit(
        self, key: ChunkKey, source: int, dest: Destination | None = None, index: int = -1
    ) -> PendingChunk | DirectChunk | _NotStarted:
        """Start the read in the source tier (straight into the destination where both
        allow it); a failure to start is kept for `_finish`."""
        tier = self.tiers[source]
        into = getattr(tier, "submit_read_into", None)
        if self._direct_now and into is not None and dest is not None:
            where = fused_runs(dest, index)
            if where is not None and all(b is not None for b in where[0]):
                if self._register:
                    register_once(self.engine, dest, where[0])
                    self._register = False
                try:
                    direct: DirectChunk = into(key, self.engine, *where)
                    self._direct_runs[index] = where  # hashed there once the read ends
                    return direct
                except ENGINE_ERRORS:
                    raise
                except (AlignmentError, LayoutError):
                    self._direct_now = False  # this destination's memory: slots from here
                except DirectUnavailable:
                    pass  # this tier (drive) reads through a slot
                except (ChunkError, OSError) as exc:
                    return _not_started(f"{tier.name}: {exc}", exc)
        try:
            if tier.defers_verify:
                # Only tiers that defer the check (record-file tiers) take `verify`.
                return tier.submit_read(key, self.engine, verify=False)  # type: ignore[call-arg]
            return tier.submit_read(key, self.engine)
        except ENGINE_ERRORS:
            raise  # the engine's own state (full, closed): never a failed chunk
        except (ChunkError, OSError) as exc:
            return _not_started(f"{self.tiers[source].name}: {exc}", exc)

    def _install(
        self, dest: Destination, index: int, slot: Slot, pending: PendingChunk | None = None
    ) -> Fence | None:
        t0 = time.perf_counter()
        try:
            if self._pool is not None and pending is not None and pending.expected_xxh3 is not None:
                where = fused_runs(dest, index) if self.fused else None
                if where is not None:
                    job = self._pool.submit(scoped(dest, slot.install_xxh3), *where)
                    return _ParallelInstall(job, pending)
            return install_chunk(dest, index, slot, self._size(index), pending, self.fused)
        finally:
            self._install_s += time.perf_counter() - t0

    def _attempt(
        self,
        source: int,
        dest: Destination,
        index: int,
        causes: list[str],
        read: Callable[[], Slot],
        pending: PendingChunk | None = None,
    ) -> tuple[tuple[Slot, Fence | None] | None, object | None]:
        """One try at chunk `index` from tier `source`: ((slot, fence), None) once it is
        installed, else (None, the failed record) with the cause appended to `causes`.
        A failed try's slot goes back at once, also when the destination raised: the
        caller may keep that exception, whose frames must not keep the slot."""
        slot = None
        try:
            slot = read()
            return (slot, self._install(dest, index, slot, pending)), None
        except ENGINE_ERRORS:
            raise
        except (ChunkError, OSError) as exc:
            causes.append(f"{self.tiers[source].name}: {exc}")
            record = _record_of(exc)
        except BaseException:
            if slot is not None:
                give_back(slot)
            raise
        if slot is not None:
            give_back(slot)
        return None, record

    def _finish(
        self,
        index: int,
        key: ChunkKey,
        source: int,
        pending: PendingChunk | DirectChunk | _NotStarted,
        dest: Destination,
    ) -> tuple[Slot | None, Fence | None, int, list[str]]:
        """Install chunk `index` verified, from its source tier, else from a lower one.
        Returns (slot, fence of the install or None, tier index, causes); no slot when
        the chunk was read straight into the destination."""
        causes: list[str] = []
        if isinstance(pending, str):
            causes.append(pending)
            record = getattr(pending, "record", None)
        elif isinstance(pending, DirectChunk):
            try:
                self._verify_in_place(index, pending)
                return None, None, source, causes
            except ChunkError as exc:
                causes.append(f"{self.tiers[source].name}: {exc}")
                record = _record_of(exc)
        else:
            read = partial(self._wait, pending, index)
            done, record = self._attempt(source, dest, index, causes, read, pending)
            if done is not None:
                return *done, source, causes
            del pending  # the failed read's slot must be free for the fallback read
        return self._fallback(index, key, source, causes, record, dest)

    def _verify_in_place(self, index: int, pending: DirectChunk) -> None:
        """Wait for a direct read (ReadTimedOut at the deadline) and hash its bytes where
        they lie; the tier's ChunkCorrupt when the hash is not the header's."""
        where = self._direct_runs.pop(index)
        try:
            pending.wait(self._remaining())
        except TimeoutError:
            # Never abandoned: until it ends the read may still write these blocks.
            try:
                pending.wait(None)
            except (ChunkError, OSError):
                pass
            raise ReadTimedOut(index, pending.key) from None
        t0 = time.perf_counter()
        got = xxh3_runs(*where)
        self._install_s += time.perf_counter() - t0
        self._direct_done += 1
        if got != pending.expected_xxh3:
            raise pending.reject("payload checksum mismatch after a direct read")

    def _fallback(
        self,
        index: int,
        key: ChunkKey,
        source: int,
        causes: list[str],
        record: object | None,
        dest: Destination,
    ) -> tuple[Slot, Fence | None, int, list[str]]:
        """Chunk `index` failed in tier `source`: withdraw that record and install the
        chunk from the next tier that holds a good copy, into the same blocks."""
        self._invalidate(source, key, causes[-1], record)
        for ti in range(source + 1, len(self.tiers)):
            tier = self.tiers[ti]
            if not holds(tier, key):
                continue
            # Checked by the tier itself (no deferred verification on a fallback).
            read = partial(self._read_bounded, tier, key, index)
            done, record = self._attempt(ti, dest, index, causes, read)
            if done is not None:
                return *done, ti, causes
            self._invalidate(ti, key, causes[-1], record)
        raise ChunkUnavailable(index, key, causes)

    def _invalidate(self, ti: int, key: ChunkKey, reason: str, record: object | None) -> None:
        """Withdraw exactly the record that failed (a newer one at its place stays)."""
        try:
            if record is None:
                self.tiers[ti].invalidate(key, reason)
            else:
                self.tiers[ti].invalidate(key, reason, record=record)
        except (ChunkError, OSError):
            pass  # a tier that is down cannot record the loss; discovery skips it anyway

    def _settle(
        self,
        entry: tuple[Slot, Fence, int, ChunkKey, int],
        dest: Destination,
        report: InstallReport,
    ) -> None:
        """Wait for one held install; a chunk that fails its check after a parallel
        install is re-read from a lower tier into the same blocks (synchronously)."""
        slot, fence, index, key, source = entry
        t0 = time.perf_counter()
        try:
            fence.synchronize()
            return
        except ChunkError as exc:
            causes = [f"{self.tiers[source].name}: {exc}"]
            record = _record_of(exc)
        finally:
            give_back(slot)
            del slot, entry
            report.install_s += time.perf_counter() - t0
        slot, fence2, ti, causes = self._fallback(index, key, source, causes, record, dest)
        if fence2 is not None:
            fence2.synchronize()
        give_back(slot)
        del slot
        name = self.tiers[ti].name
        report.fallbacks.append({"chunk": index, "tier": name, "causes": causes})
        report.sources[index] = name
        report.bytes_read[name] = report.bytes_read.get(name, 0) + self._size(index)

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
        n = len(keys)
        self._deadline = time.monotonic() + 30.0 if slot_deadline is None else slot_deadline
        self._read_deadline = self._deadline if read_deadline is None else read_deadline
        if sizes is not None:
            if len(sizes) != n:
                raise ValueError(f"{len(sizes)} record sizes for {n} keys")
            big = max(sizes, default=0)
            if big > self.engine.slot_bytes:
                raise ValueError(
                    f"a record of {big} bytes does not fit the engine's "
                    f"{self.engine.slot_bytes}-byte slots"
                )
        self._sizes = sizes
        self._direct_now = self.direct and bool(getattr(dest, "direct_reads", False))
        self._register = self._direct_now and bool(getattr(dest, "lasting", False))
        self._direct_done = 0
        report = InstallReport()
        stop_every = stop_every or self.width
        # started reads, in chunk order
        reads: deque[PendingChunk | DirectChunk | _NotStarted] = deque()
        # (slot, fence, chunk, key, source tier) of installs still running
        held: deque[tuple[Slot, Fence, int, ChunkKey, int]] = deque()
        next_read = 0
        if self.install_threads > 1:
            self._pool = ThreadPoolExecutor(self.install_threads, "bsr-install")
        try:
            for i in range(n):
                # Every free window position gets a read before chunk i is installed.
                while next_read < n and len(reads) + len(held) < self.width:
                    try:
                        key, src = keys[next_read], sources[next_read]
                        reads.append(self._submit(key, src, dest, next_read))
                    except NoFreeSlot:
                        # Back-pressure: finish what is ours first; with nothing of
                        # ours in flight, wait for someone else's slot.
                        if reads:
                            break
                        if held:
                            self._settle(held.popleft(), dest, report)
                            continue
                        wait_for_slot(self.engine, self._deadline)
                        continue
                    next_read += 1
                t0 = time.perf_counter()
                self._install_s = 0.0
                try:
                    slot, fence, tier_index, causes = self._finish(
                        i, keys[i], sources[i], reads.popleft(), dest
                    )
                except ChunkUnavailable as exc:
                    if not keep_going:
                        raise
                    report.failed_chunks.append(i)
                    report.error = report.error or str(exc)
                    continue
                t1 = time.perf_counter()
                report.read_wait_s += t1 - t0 - self._install_s
                name = self.tiers[tier_index].name
                if causes:
                    report.fallbacks.append({"chunk": i, "tier": name, "causes": causes})
                report.bytes_read[name] = report.bytes_read.get(name, 0) + self._size(i)
                if fence is not None:
                    assert slot is not None  # an install's fence is a slot's copy
                    held.append((slot, fence, i, keys[i], tier_index))
                    parallel = isinstance(fence, _ParallelInstall)
                    if len(held) >= (self.install_threads if parallel else self.width):
                        self._settle(held.popleft(), dest, report)
                if fence is None and slot is not None:
                    give_back(slot)  # installed: the slot returns to the ring now
                del slot
                report.install_s += self._install_s + time.perf_counter() - t1
                report.installed += 1
                report.sources.append(name)  # a parallel install's fallback rewrites it
                if (i + 1) % stop_every == 0 and should_stop():
                    report.error = "a peer rank aborted the restore"
                    break
            while held:
                self._settle(held.popleft(), dest, report)
            dest.synchronize()
        except ChunkUnavailable as exc:
            report.failed_chunks.append(exc.index)
            report.error = str(exc)
        except ReadTimedOut as exc:
            report.timed_out = True
            report.error = str(exc)
        finally:
            if self._pool is not None:
                # Installs still running write into the destination: let them finish.
                self._pool.shutdown(wait=True)
                self._pool = None
            # An asynchronous copy (CUDA) may still read a held slot: wait for it before
            # the slot goes back to the ring, whatever ended the run.
            while held:
                slot, fence = held[0][0], held[0][1]
                held.popleft()
                try:
                    fence.synchronize()
                except (ChunkError, OSError):
                    pass  # the outcome is already a failure; only the wait mattered
                give_back(slot)
                del slot, fence
            # Reads already started own their slots until they complete: wait for them
            # until the deadline, then drop them (the engine keeps a slot the kernel may
            # still write until its completion arrives). A direct read writes the
            # destination's own memory: wait for it to end, deadline or not.
            while reads:
                p = reads.popleft()
                try:
                    if isinstance(p, DirectChunk):
                        p.wait(None)
                    elif not isinstance(p, str):
                        give_back(p.wait(self._remaining()))
                except (ChunkError, OSError):
                    pass
                del p
            report.direct = self._direct_done
            self._direct_runs.clear()  # the destination's memory is not the window's to keep
        if report.failed_chunks and not report.error:
            report.error = f"chunks {report.failed_chunks[:8]} unavailable in every tier"
        return report
