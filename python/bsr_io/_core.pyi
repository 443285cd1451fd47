"""Typed surface of the Rust engine (`bsr_io._core`).

The engine owns one anonymous, page-aligned mapping cut into `window` slots of
`slot_bytes` each. A slot is lent out as a `Slot` object; bytes move between
slots and files by io_uring (or a pread/pwrite pool) with O_DIRECT where the
filesystem allows it. A slot returns to the free ring when `Slot.release()` is
called (or its `with` block ends); release is refused while a buffer view of the
slot lives (memoryview, numpy array, or a tensor made by `bsr_io.as_tensor`), so a
slot is never refilled under a view. Collection of the last reference is only the
fallback: a kept traceback must not be able to starve the ring.
"""

import os
import sys
from collections.abc import Sequence
from os import PathLike
from typing import Any, Self, final

if sys.version_info >= (3, 12):
    from collections.abc import Buffer
else:
    from typing_extensions import Buffer

__all__ = [
    "Engine",
    "File",
    "Slot",
    "Pending",
    "DirectRead",
    "MemoryRegistration",
    "BsrError",
    "BsrIoError",
    "AlignmentError",
    "ShortReadError",
    "EngineClosedError",
    "BackendUnavailable",
    "NoFreeSlot",
    "NoSpaceError",
    "FileMissingError",
    "FilePermissionError",
    "WaitTimeoutError",
    "EngineBrokenError",
    "NoMemoryError",
    "KernelOwnedError",
    "BsrValueError",
    "BsrTypeError",
    "xxh3_64",
    "dio_alignment",
    "xxh3_runs",
    "prefix_hashes",
    "PublishStall",
    "stall_publish",
]

class BsrError(Exception):
    """Root of every bsr-io error: the engine's, and chunk, layout, capacity and
    record-format errors (bsr_io.errors)."""

class BsrIoError(BsrError, OSError):
    """Root of engine errors; `errno` is set where the kernel gave one."""

class AlignmentError(BsrIoError):
    """O_DIRECT refused an offset, length or address (EINVAL)."""

class ShortReadError(BsrIoError):
    """The file ended before the requested range did."""

class EngineClosedError(BsrIoError):
    """The engine was closed; no further I/O is accepted."""

class BackendUnavailable(BsrIoError):
    """The requested backend cannot run on this kernel or under these limits."""

class NoFreeSlot(BsrIoError):
    """All `window` slots are leased or in flight (errno EAGAIN)."""

class NoSpaceError(BsrIoError):
    """The device is full (errno ENOSPC)."""

class FileMissingError(BsrIoError, FileNotFoundError):
    """The file does not exist (errno ENOENT)."""

class FilePermissionError(BsrIoError, PermissionError):
    """Access to the file was refused (errno EACCES or EPERM)."""

class WaitTimeoutError(BsrIoError, TimeoutError):
    """A wait ran past its timeout (errno ETIMEDOUT); the operation keeps its slot.
    From `Engine.publish`, `step` names what was under way."""

    step: str

class EngineBrokenError(BsrIoError):
    """The engine's I/O thread met an error it cannot retry (io_uring_enter failing
    with EBADF, ENOMEM...; a completion no request owns) or panicked. Every queued and
    in-flight operation failed with it (errno kept; EIO for a panic), and every later
    submit or lease raises it. Not a chunk failure: close the engine, make a new one."""

class KernelOwnedError(EngineBrokenError):
    """The engine broke down while the kernel held a direct read (`submit_read_into`):
    its destination blocks are still owned by the kernel, which may write them at any
    time, so the DirectRead keeps them exported for good; never reuse them."""

class NoMemoryError(BsrIoError):
    """The staging arena does not fit in the memory available (errno ENOMEM), checked
    before mapping (MemAvailable, or the memory cgroup's limit where lower); the
    message says how many bytes were asked and how many are available."""

class BsrValueError(BsrError, ValueError):
    """An argument of the right type but a wrong value: a BsrError and a ValueError."""

class BsrTypeError(BsrError, TypeError):
    """An argument of a wrong type: a BsrError and a TypeError."""

@final
class File:
    """An open file used by the engine (O_DIRECT unless the filesystem refused it)."""

    @property
    def path(self) -> str: ...
    @property
    def size(self) -> int:
        """Size in bytes at open time, updated by writes through the engine."""
    @property
    def direct(self) -> bool:
        """True when opened with O_DIRECT; False when the filesystem refused it."""
    @property
    def writable(self) -> bool: ...
    @property
    def alignment(self) -> int:
        """Offset/length alignment required by this file (STATX_DIOALIGN or fallback)."""
    def fileno(self) -> int: ...
    def sync(self) -> None:
        """fdatasync the file."""
    def truncate(self, size: int) -> None: ...
    def close(self) -> None:
        """Close now; later I/O on this file raises. Also closed when collected."""
    def __enter__(self) -> File: ...
    def __exit__(self, *exc: object) -> None: ...

@final
class Slot:
    """One staging slot, lent to Python. Supports the buffer protocol (writable).

    `len(slot)` is the number of valid bytes (what the last read filled, or what
    the caller set with `set_length`), at most `capacity`. A slot from `lease()`
    starts with `len(slot) == capacity`. The buffer export covers `len(slot)` bytes
    and keeps this Slot alive (`view.obj` is the Slot); the Slot counts its live
    exports. Exports are refused (BufferError) while a write from the slot is in
    flight and after release. `torch.frombuffer(slot)` keeps the Slot but no export:
    use `bsr_io.as_tensor(slot)`, which goes through a memoryview, so that release()
    sees the tensor.

        with engine.lease() as slot:   # released at the end of the block
            slot.fill_from(data)
    """

    def release(self, *, after_writes: bool = False) -> None:
        """Give the slot back to the engine's ring now. BufferError while a view of it
        lives; ValueError while a write from it is in flight (the write owns it until
        it completes), unless `after_writes`: then the last such write returns it to the
        ring as it ends, never before (the kernel may still read it). Any later use
        raises ValueError; a second release is a no-op."""
    @property
    def released(self) -> bool: ...
    def __enter__(self) -> Slot: ...
    def __exit__(self, *exc: object) -> None:
        """release(); raises BufferError if a view of the slot is still alive."""

    @property
    def index(self) -> int: ...
    @property
    def capacity(self) -> int: ...
    @property
    def address(self) -> int:
        """Address of the slot's first byte (for CUDA registration checks)."""
    def __len__(self) -> int: ...
    def __buffer__(self, flags: int, /) -> memoryview: ...
    def set_length(self, length: int) -> None:
        """Declare how many bytes are valid (for writes filled from Python)."""
    def checksum(self, offset: int = 0, length: int | None = None) -> int:
        """xxh3-64 of slot bytes [offset, offset+length), GIL released; of the whole
        slot right after `gather`, the hash it returned (no second pass)."""
    def fill_from(self, data: Buffer, offset: int = 0) -> None:
        """Copy bytes into the slot at `offset` (GIL released)."""
    def install_xxh3(self, dsts: Sequence[Any], runs: Sequence[tuple[int, int, int, int]]) -> int:
        """Copy the valid bytes into the writable buffers `dsts` along `runs` ((buffer
        index, offset in it, slot offset, length), in slot order) and return the xxh3-64
        of all the valid bytes, in one pass (GIL released)."""
    def gather(self, srcs: Sequence[Any], runs: Sequence[tuple[int, int, int, int]]) -> int:
        """Copy `runs` ((buffer index, offset in it, slot offset, length), in slot order)
        of the buffers `srcs` into the valid bytes and zero the bytes no run covers, in
        one call (GIL released); returns the xxh3-64 of the valid bytes, hashed in the
        same pass, which `checksum()` of the whole slot returns until they may have
        changed (set_length, fill_from, a view made of the slot)."""

@final
class Pending:
    """An in-flight read or write. The slot is owned by the operation until done."""

    def done(self) -> bool: ...
    def withdraw(self) -> bool:
        """Give a read up while none of it has reached the kernel (queued in the engine):
        True then, its slot back in the ring at once (a wait raises ECANCELED); False
        once the kernel has it, or for a write."""
    def wait(self, timeout: float | None = None) -> Slot:
        """Block (GIL released) until complete; returns the slot. Raises the I/O error
        if the operation failed (the slot is then returned to the ring), TimeoutError
        when `timeout` passes first (the operation keeps its slot until it completes; the
        message says whether it is in the kernel, and since when, or still queued).
        A read's slot is handed out once; the Pending keeps only a weak reference, so
        a later wait returns the same Slot while it lives and ValueError after."""

@final
class DirectRead:
    """A read from a file straight into caller buffers (`Engine.submit_read_into`). The
    buffers stay exported (pinned) until the read ends; dropped before that, they stay
    pinned for good, since the kernel may still write them."""

    def done(self) -> bool: ...
    def withdraw(self) -> bool:
        """Give the read up while none of it has reached the kernel (queued in the
        engine): True then, and the buffers are the caller's again at once, never
        written; False once the kernel has it (it may still write them)."""
    def wait(self, timeout: float | None = None) -> int:
        """Block (GIL released) until the read ended; the bytes read. Raises the I/O
        error (ShortReadError past the end of the file), TimeoutError meanwhile (saying
        where the read is, as `Pending.wait` does), and
        KernelOwnedError when the engine broke down with the read in the kernel's hands
        (the buffers then stay exported for good)."""
    def wait_xxh3(self, timeout: float | None = None) -> tuple[int, float]:
        """As `wait`, hashing the bytes as they land (request by request, in order), so
        that only the last request's bytes are hashed after the read ended: (xxh3-64 of
        the payload in run order, when the read ended on the `time.perf_counter` clock).
        Raises as `wait` does; what was hashed of a read that failed is dropped."""
    @property
    def length(self) -> int: ...

@final
class MemoryRegistration:
    """Buffers registered with an engine's I/O ring (`Engine.register_memory`): direct
    reads into them skip pinning their pages per request. Holds the buffers (exported:
    never freed or resized) until `close()` or collection, which unregisters them."""

    def close(self) -> None: ...
    @property
    def entries(self) -> int:
        """Ring buffer entries taken (one per GiB); 0 where the backend registers
        nothing (pread, io_uring_plain): reads into the buffers then work unregistered."""
    @property
    def closed(self) -> bool: ...
    def __enter__(self) -> MemoryRegistration: ...
    def __exit__(self, *exc: object) -> None: ...

@final
class Engine:
    def __new__(
        cls,
        window: int,
        slot_bytes: int,
        *,
        queue_depth: int = 32,
        request_bytes: int = 1 << 20,
        backend: str | None = None,
        inflight_bytes: int = 32 << 20,
    ) -> Self:
        """`backend`: None/"auto" (or env BSR_IO_BACKEND), "io_uring" (fixed buffers
        and registered files where allowed), "io_uring_plain", "pread".
        `inflight_bytes`: at most this many bytes in flight per drive (io_uring; 0: the
        queue depth alone bounds them), so a small read's first chunk lands while the
        rest are read; a drive with nothing in flight always takes one request.
        Raises ValueError for window < 1, slot_bytes == 0, queue_depth < 1,
        request_bytes not a positive multiple of 4096; BackendUnavailable when an
        explicitly requested backend cannot start; NoMemoryError when the arena
        (window x slot_bytes, plus 128 MiB of headroom) exceeds available memory."""
    @property
    def backend(self) -> str:
        """The path actually taken: "io_uring" or "pread"."""
    @property
    def features(self) -> dict[str, bool | int | str]:
        """What the probe found: fixed_buffers, registered_files, registered_memory
        (`register_memory` can take caller memory), mlock, hugepages,
        queue_depth, request_bytes, inflight_bytes (0: unbounded), open_path (how
        paths below a store's root are resolved: "openat2", or "walk" where openat2 is
        missing or refused by a seccomp profile), and `notes` (why something was
        skipped)."""
    @property
    def window(self) -> int: ...
    @property
    def slot_bytes(self) -> int:
        """Slot size after rounding up to the alignment (4096)."""
    @property
    def arena_address(self) -> int: ...
    @property
    def arena_bytes(self) -> int: ...
    def open(
        self,
        path: str | PathLike[str],
        *,
        write: bool = False,
        create: bool = False,
        direct: bool = True,
        special: bool = False,
        root: str | PathLike[str] | None = None,
    ) -> File:
        """Open for the engine. Falls back to buffered I/O (File.direct False) where
        O_DIRECT is refused. create=True creates with mode 0600 (implies write).
        The open never blocks (O_NONBLOCK, cleared once the file is checked): anything
        but a regular file is refused with BsrIoError (EINVAL; EISDIR for a directory)
        before any byte moves, unless `special=True` accepts a FIFO or device node.
        A link at `path` is never followed (ELOOP). With `root` (a store's directory)
        `path` must lie under it (EXDEV otherwise) and no component below `root` may be
        a link (ELOOP): openat2 RESOLVE_BENEATH | RESOLVE_NO_SYMLINKS, or a walk one
        directory at a time where the kernel lacks openat2."""
    def lease(self) -> Slot:
        """Take a free slot to fill from Python (save path). Raises NoFreeSlot. Give it
        back with `slot.release()` or use it as a context manager."""
    def submit_read(self, file: File, offset: int, length: int) -> Pending:
        """Read exactly `length` bytes at `offset` into a free slot. Raises NoFreeSlot
        when none is free, ValueError for negative offset / length 0 / length above
        slot_bytes. The pending result raises ShortReadError if the file is shorter."""
    def read(self, file: File, offset: int, length: int) -> Slot:
        """submit_read + wait."""
    def submit_write(
        self, slot: Slot, file: File, offset: int, length: int | None = None
    ) -> Pending:
        """Write slot bytes [0, length) (default len(slot)) at `offset`. On an O_DIRECT
        file an unaligned length is padded with zeros to the alignment and the file is
        truncated back to offset+length if that is its new end. Padding inside an
        existing file carries the bytes already there, so nothing past `length` changes.
        The write takes ownership of the slot until it completes: it is refused
        (BufferError) while a view of the slot lives; meanwhile `release`,
        `fill_from` and `set_length` raise ValueError and new views BufferError.
        `wait()` hands the slot back."""
    def write(self, slot: Slot, file: File, offset: int, length: int | None = None) -> int: ...
    def submit_read_into(
        self,
        file: File,
        offset: int,
        dsts: Sequence[Any],
        runs: Sequence[tuple[int, int, int, int]],
        *,
        inflight: int | None = None,
    ) -> DirectRead:
        """Read the file from `offset` straight into the writable buffers `dsts` along
        `runs` ((buffer index, offset in it, payload offset, length), covering the payload
        in order without gaps or overlap): no slot is taken. AlignmentError when a run's
        address or length does not suit O_DIRECT on this file (read through a slot).
        `inflight`: at most this many of its bytes in the kernel at once (io_uring), so
        its requests land one after another and `DirectRead.wait_xxh3` hashes them as
        they land; None: only the engine's own bounds."""
    def register_memory(
        self, bufs: Sequence[Buffer], timeout: float | None = None
    ) -> MemoryRegistration:
        """Register the writable buffers `bufs` (a host KV cache's tensors) with the I/O
        ring for `submit_read_into`. Costs a pass over their pages once; OSError (ENOMEM:
        RLIMIT_MEMLOCK) when the kernel will not pin them, ValueError for an empty one.
        The I/O thread registers between its waits (woken for it), waited for at most
        `timeout` seconds: WaitTimeoutError past it, and the buffers are never registered."""
    def publish(
        self,
        slot: Slot,
        tmp: str | os.PathLike[str],
        dest: str | os.PathLike[str],
        head: bytes,
        length: int,
        *,
        root: str | os.PathLike[str] | None = None,
        release: bool = False,
        durable: bool = True,
        timeout: float | None = None,
    ) -> tuple[int, int, int, int]:
        """Publish a record in one call, the GIL released once: `head` then the slot's
        first `length` bytes into the new temp file `tmp` (O_EXCL, below `root` with no
        link followed; missing directories made 0700), fdatasync, rename to `dest`, the
        directory fsynced (a group commit), on a kept thread of the caller's CPUs and
        priority. (st_dev, st_ino, st_mtime_ns, st_size) of the record. Past `timeout`
        seconds WaitTimeoutError, whose `step` names the step under way; nothing is
        published unless a rename already under way completes (the record whole and
        durable). OSError (errno, the step in its text) when a step fails; no temp file
        is left. `release`: the slot goes back to the ring once its bytes are written.
        `durable` False: no fdatasync and no directory fsync (a power loss may tear or
        unname the record; a reader's checksum catches it)."""
    def sync(self, file: File, timeout: float | None = None) -> None:
        """fdatasync `file` on the engine's I/O thread, waiting at most `timeout` seconds
        (GIL released): WaitTimeoutError then, while the sync goes on without a waiter."""
    def free_slots(self) -> int: ...
    def live_bytes(self) -> int:
        """Staging bytes now leased or in flight (slot_bytes per such slot)."""
    def peak_bytes(self) -> int:
        """Highest live_bytes since construction or reset_peak()."""
    def reset_peak(self) -> None: ...
    def trace_start(self, max_events: int = 1 << 20) -> None:
        """Record each request's timings on the I/O thread from now on (io_uring only;
        ValueError on the pread pool), at most `max_events`; a running trace restarts."""
    def trace_take(self) -> list[tuple[int, int, int, int, int, int, int]]:
        """Stop recording; one (offset, bytes, queued_ns, submit_ns, complete_ns, depth,
        waiting) per request, in completion order: times in ns since trace_start, `depth`
        the requests in flight once it went to the kernel (itself included), `waiting`
        those queued behind it then. Empty when no trace ran."""
    def close(self) -> None:
        """Stop accepting I/O (waits for in-flight operations, GIL released; so does
        the engine's collection). The mapping lives on until the last Slot is
        collected."""
    @property
    def closed(self) -> bool: ...
    @property
    def broken(self) -> str | None:
        """Why the engine broke (see EngineBrokenError), or None while it works."""
    def __enter__(self) -> Engine: ...
    def __exit__(self, *exc: object) -> None: ...

def xxh3_64(data: Buffer) -> int:
    """xxh3-64 of any contiguous buffer, GIL released."""

def prefix_hashes(tokens: list[int] | bytes, chunk_tokens: int, prev: int = 0) -> list[int]:
    """Chained 128-bit hashes of the full chunks of `tokens` (ints, or little-endian int64
    bytes) after the chunk whose hash is `prev`; the hashing runs without the GIL."""

def xxh3_runs(bufs: Sequence[Any], runs: Sequence[tuple[int, int, int, int]]) -> int:
    """xxh3-64 of the payload lying in `bufs` along `runs` (as for submit_read_into): the
    record header's hash, taken in place (GIL released)."""

def dio_alignment(path: str | PathLike[str]) -> tuple[int, int]:
    """(memory alignment, offset alignment) for O_DIRECT on `path`'s filesystem."""

@final
class PublishStall:
    """Fault double (tests only): publications held at one step; see `stall_publish`."""
    @property
    def hits(self) -> int: ...
    @property
    def threads(self) -> list[int]:
        """Kernel thread ids of the runners it held, in order."""
    def release(self) -> None: ...

def stall_publish(step: str, under: str) -> PublishStall:
    """Fault double of a stalled drive: every `Engine.publish` whose temp file is under
    `under` waits at `step` ("create", "write", "fdatasync", "rename", "dirsync"), just
    before its system call, until `release()`."""
