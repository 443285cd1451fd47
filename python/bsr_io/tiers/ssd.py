"""L2: chunk records on local SSD, read and written through the engine (O_DIRECT)."""

from __future__ import annotations

import mmap
import os
import threading
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from bsr_io._core import (
    AlignmentError,
    DirectRead,
    Engine,
    File,
    KernelOwnedError,
    Pending,
    ShortReadError,
    Slot,
    WaitTimeoutError,
)
from bsr_io.errors import (
    BsrValueError,
    ChunkReadError,
    ChunkWriteError,
    DestinationUnusable,
    LayoutError,
    expect_type,
)
from bsr_io.model.keys import ChunkKey
from bsr_io.model.layout import KVLayout
from bsr_io.model.record import HEADER_BYTES, RecordHeader, make_header
from bsr_io.tiers.base import (
    ENGINE_ERRORS,
    DirectChunk,
    Payload,
    PendingChunk,
    check_slot_fits,
    payload_view,
    read_deadline,
)
from bsr_io.tiers.files import FileTier, RecordId
from bsr_io.tiers.files.bounded import run_within
from bsr_io.tiers.files.publish import write_error
from bsr_io.tiers.files.records import Entry, record_name, tmp_name

_local = threading.local()


def _header_buffer() -> mmap.mmap:
    # O_DIRECT needs an aligned buffer; an anonymous mapping is page-aligned.
    buf = getattr(_local, "buf", None)
    if buf is None:
        buf = _local.buf = mmap.mmap(-1, HEADER_BYTES)
    return buf


class SSDTier(FileTier):
    """Record files on a local drive; payloads move by the engine straight between the
    file and a staging slot, with no page cache.

    One record per file: opening and closing a file costs microseconds against
    milliseconds for reading a 16 MiB chunk (see the issue note for the measurement).

    A record is published in one native call (the engine's `publish`: creation, header
    and payload, fdatasync, rename, directory fsync), waited for `write_timeout_s` at
    most: a stalled drive fails the save (ChunkWriteError, nothing published) instead of
    holding the caller. `durable=False` leaves out the fdatasync and the directory's
    fsync, each a device flush: a power loss may then tear or unname a record, which
    the checksum every read verifies turns into a miss.
    """

    def __init__(
        self,
        root: str | os.PathLike[str],
        capacity_bytes: int | None,
        engine: Engine,
        *,
        layout: KVLayout | None = None,
        evict_to: FileTier | None = None,
        name: str = "L2",
        write_timeout_s: float = 30.0,
        durable: bool = True,
    ) -> None:
        expect_type(root, (str, os.PathLike), "root (the tier's directory)")
        if not write_timeout_s > 0:
            raise BsrValueError(f"write_timeout_s must be > 0 seconds, got {write_timeout_s}")
        self.engine = engine
        self.write_timeout_s = write_timeout_s
        self.durable = durable  # False: records published without their two flushes
        super().__init__(root, capacity_bytes, name=name, layout=layout, evict_to=evict_to)

    def _stage(self, payload: Payload, layout: KVLayout) -> tuple[Slot, bool]:
        """(the slot holding the payload, whether the tier leased it)."""
        n = layout.chunk_bytes
        if isinstance(payload, Slot):
            if len(payload) != n:
                raise LayoutError(
                    f"slot holds {len(payload)} bytes, a chunk of layout {layout.name} is {n}"
                )
            return payload, False
        view = payload_view(payload, layout)
        if n > self.engine.slot_bytes:
            raise LayoutError(
                f"{self.name}: chunk of {n} bytes does not fit the engine's "
                f"{self.engine.slot_bytes}-byte slots"
            )
        slot = self.engine.lease()
        slot.fill_from(view)
        slot.set_length(n)
        return slot, True

    def _publish(self, key: ChunkKey, layout: KVLayout, staged: list[Any]) -> Entry:
        # One native call (the engine's `publish`): the temp file's creation, header and
        # payload written straight from the slot, fdatasync, rename and the directory's
        # fsync, on a thread of the engine's, the GIL released once, all by the deadline.
        slot, leased = staged.pop()
        n = layout.chunk_bytes
        header = make_header(key, layout, slot.checksum(0, n))
        final = record_name(os.fspath(self.chunks_dir), key)  # text: the engine takes it as is
        tmp = tmp_name(final)
        try:
            dev, ino, mtime_ns, _ = self.engine.publish(
                slot,
                tmp,
                final,
                header.encode(),
                n,
                root=self.root,
                # A slot the tier leased goes back to the ring once its bytes are written.
                release=leased,
                durable=self.durable,
                timeout=self.write_timeout_s,
            )
        except WaitTimeoutError as exc:
            note = (
                " (it may yet publish it whole)" if exc.step.startswith(("rename", "dir")) else ""
            )
            raise ChunkWriteError(
                f"the {exc.step} of {os.path.basename(tmp)} did not end within "
                f"{self.write_timeout_s} s (device stalled?); record not stored{note}, "
                "earlier records intact",
                key=key,
                tier=self.name,
                cause=exc,
            ) from None
        except OSError as exc:
            raise write_error(self.name, key, Path(final), exc) from exc
        return Entry(header, ino, mtime_ns)

    defers_verify = True

    def _start(
        self, key: ChunkKey, engine: Engine, submit: Callable[[File, int], Any]
    ) -> tuple[File, Path, RecordId, RecordHeader, Any]:
        """Open `key`'s record, check its header, start the payload read with
        `submit(file, payload_len)`: (file, path, record, header, what submit returned).
        An AlignmentError from `submit` (a direct read the memory does not suit) passes
        through: the record is fine, the caller reads it another way."""
        path = self.path_of(key)
        st: os.stat_result | None = None
        try:
            if self._index.get(key) is None:
                # Not indexed: the header is read too. A stalled drive or mount can block
                # even the open (a path lookup it must read) and the fstat after it (a
                # network file system revalidates): all have the read's deadline.
                f, st = run_within(
                    read_deadline() - time.monotonic(),
                    lambda: _open_stat(engine, path, self.root),
                    late=lambda got: got[0].close(),
                )
            else:
                f = engine.open(path, root=self.root)  # the hot path: no thread hop
        except ENGINE_ERRORS:
            raise
        except FileNotFoundError as exc:
            raise self._missing(key, exc) from None
        except TimeoutError:
            late = TimeoutError("the open did not end by the read's deadline (device stalled?)")
            raise self._given_up(key, path, late) from None
        except OSError as exc:
            raise self._read_error(key, path, exc) from exc
        record: RecordId | None = None
        try:
            if st is None:
                st = os.fstat(f.fileno())
            record = RecordId.of(st)
            header = self._known_header(key, st)
            if header is None:
                raw = _read_header(engine, f, st.st_size)
                header = self._open_checks(key, path, raw, st)
                self._checked(key, header, st)
            record = RecordId.of(st, header)
            pending = submit(f, header.payload_len)
        except (*ENGINE_ERRORS, AlignmentError):
            f.close()
            raise
        except TimeoutError as exc:  # the header read
            f.close()
            raise self._given_up(key, path, exc) from None
        except OSError as exc:
            f.close()
            raise self._read_error(key, path, exc, record) from exc
        except BaseException:
            f.close()
            raise
        return f, path, record, header, pending

    def _given_up(self, key: ChunkKey, path: Path, late: TimeoutError) -> ChunkReadError:
        """The read error of a call on the drive given up at the read's deadline; it
        proves nothing against the record. No other call on the drive here (not even
        `_read_error`'s look at the directory): a stalled drive or mount holds that too."""
        return ChunkReadError(f"cannot read {path}", key=key, tier=self.name, cause=late)

    def _payload_wait(
        self, key: ChunkKey, path: Path, record: RecordId, f: File, wait: Callable[[], Any]
    ) -> Any:
        """The payload read's end (`wait()`), its errors as chunk errors; the file is
        closed once the read has ended."""
        try:
            out = wait()
        except TimeoutError:
            raise
        except KernelOwnedError as exc:
            f.close()
            raise DestinationUnusable(
                "destination blocks still owned by the kernel", key=key, tier=self.name, cause=exc
            ) from exc
        except ShortReadError as exc:
            f.close()
            raise self._corrupt(key, path, record, f"record truncated: {exc}") from exc
        except ENGINE_ERRORS:
            f.close()
            raise
        except OSError as exc:
            f.close()
            raise self._read_error(key, path, exc, record) from exc
        f.close()
        return out

    def submit_read(
        self, key: ChunkKey, engine: Engine | None = None, *, verify: bool = True
    ) -> PendingChunk:
        """Start the payload read; `verify=False` leaves the payload hash to the caller
        (the key, lengths and header checksum are still checked here)."""
        engine = engine or self.engine

        def submit(f: File, n: int) -> Pending:
            check_slot_fits(self.name, engine, key, n)
            return engine.submit_read(f, HEADER_BYTES, n)

        f, path, record, header, pending = self._start(key, engine, submit)
        n = header.payload_len

        def finish(timeout: float | None) -> Slot:
            slot: Slot = self._payload_wait(key, path, record, f, lambda: pending.wait(timeout))
            if verify and slot.checksum(0, n) != header.payload_xxh3:
                slot.release()  # back to the ring now: a kept exception must not hold it
                raise self._corrupt(key, path, record, "payload checksum mismatch")
            self._touch(key)
            self._count(hits=1, reads=1, bytes_read=n)
            return slot

        if verify:
            return PendingChunk(key, finish, pending.done, withdraw=pending.withdraw)
        return PendingChunk(
            key,
            finish,
            pending.done,
            expected_xxh3=header.payload_xxh3,
            reject=lambda why: self._corrupt(key, path, record, why),
            withdraw=pending.withdraw,
        )

    def submit_read_into(
        self,
        key: ChunkKey,
        engine: Engine | None,
        bufs: Sequence[Any],
        runs: Sequence[tuple[int, int, int, int]],
        *,
        inflight: int | None = None,
    ) -> DirectChunk:
        """Read the payload straight into `bufs` along `runs` (the destination's blocks,
        `host_runs`), no slot; the caller hashes it in place. AlignmentError when the
        memory does not suit O_DIRECT here (then read through a slot); a LayoutError
        when the runs do not cover exactly the record's payload. `inflight`: at most
        this many payload bytes in the kernel at once (`Engine.submit_read_into`)."""
        engine = engine or self.engine
        want = sum(r[3] for r in runs)

        def submit(f: File, n: int) -> DirectRead:
            if n != want:
                raise LayoutError(
                    f"{self.name}: chunk {key.short()} holds {n} payload bytes, the "
                    f"destination's runs {want}"
                )
            return engine.submit_read_into(
                f, HEADER_BYTES, list(bufs), list(runs), inflight=inflight
            )

        f, path, record, header, direct = self._start(key, engine, submit)
        n = header.payload_len

        def finish(timeout: float | None) -> None:
            self._payload_wait(key, path, record, f, lambda: direct.wait(timeout))
            self._touch(key)
            self._count(hits=1, reads=1, bytes_read=n)

        def hashed(timeout: float | None) -> tuple[int, float]:
            got: tuple[int, float] = self._payload_wait(
                key, path, record, f, lambda: direct.wait_xxh3(timeout)
            )
            self._touch(key)
            self._count(hits=1, reads=1, bytes_read=n)
            return got

        return DirectChunk(
            key,
            finish,
            direct.done,
            expected_xxh3=header.payload_xxh3,
            reject=lambda why: self._corrupt(key, path, record, why),
            # A read still queued in the engine at the caller's deadline is withdrawn
            # unsent: its blocks stay usable.
            abandon=direct.withdraw,
            returned=lambda: _memory_returned(direct),
            hashed=hashed,
        )

    def read_into(self, key: ChunkKey, engine: Engine | None = None) -> Slot:
        return self.submit_read(key, engine).wait()


def _open_stat(engine: Engine, path: Path, root: Path) -> tuple[File, os.stat_result]:
    f = engine.open(path, root=root)
    try:
        return f, os.fstat(f.fileno())
    except BaseException:
        f.close()
        raise


def _read_header(engine: Engine, f: File, size: int) -> bytes:
    """A record's header bytes (fewer when the file is shorter), read through the engine
    by the read's deadline (`read_deadline`): a stalled drive costs the chunk then, as a
    read error (TimeoutError, an OSError: it proves nothing against the record).

    Read straight into this thread's aligned buffer; one given up is left to the read
    (the kernel may still write it, the DirectRead keeps it) and the thread takes a new
    one."""
    buf = _header_buffer()
    want = min(size, HEADER_BYTES)
    read = engine.submit_read_into(f, 0, [buf], [(0, 0, 0, HEADER_BYTES)])
    try:
        read.wait(max(0.0, read_deadline() - time.monotonic()))
    except TimeoutError:
        _local.buf = None
        raise TimeoutError(
            f"the header read of {f.path} did not end by the read's deadline (device stalled?)"
        ) from None
    except ShortReadError:
        pass  # the file ends within the header: its checks say what is wrong
    return bytes(buf[:want])


def _memory_returned(direct: DirectRead) -> bool:
    """Whether the kernel gave a direct read's memory back: it ended, and not with
    KernelOwnedError (an engine break-down left it in the kernel's hands for good)."""
    if not direct.done():
        return False
    try:
        direct.wait(0)  # ended: returns (or raises) at once, nothing else happens
    except KernelOwnedError:
        return False
    except Exception:  # noqa: BLE001 - ended with an error: the memory is back
        return True
    return True
