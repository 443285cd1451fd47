"""L3: a lower tier in a second directory (standing for shared or network storage).

Same record format as L2, but plain buffered I/O: network filesystems often refuse
O_DIRECT, and this tier is read once per fallback, not on the hot path.
"""

from __future__ import annotations

import os
import threading
import time
from pathlib import Path
from typing import Any

from bsr_io._core import Engine, Slot, xxh3_64
from bsr_io.errors import BsrValueError, ChunkReadError, ChunkWriteError, expect_type
from bsr_io.model.keys import ChunkKey
from bsr_io.model.layout import KVLayout
from bsr_io.model.record import HEADER_BYTES, RecordHeader, make_header
from bsr_io.tiers.base import (
    ENGINE_ERRORS,
    Payload,
    PendingChunk,
    check_slot_fits,
    payload_view,
    read_deadline,
)
from bsr_io.tiers.files import FileTier, RecordId, open_record
from bsr_io.tiers.files.bounded import call_within, pwrite_all, run_within

# The least a read gets (see LowerTier.submit_read).
READ_FLOOR_S = 0.5


class LowerTier(FileTier):
    """Record files under `root`, read and written buffered; unbounded unless a capacity
    is given.

    A record's writes and its fdatasync run on a thread of their own and are waited for
    `write_timeout_s` at most, together (as L2's): a stalled mount fails the save
    (ChunkWriteError, nothing published, earlier records intact) instead of holding the
    caller. The look for a stored copy before it (two lstats, and a header read for a
    record another process wrote) has `write_timeout_s` of its own: a save waits twice
    that at most."""

    def __init__(
        self,
        root: str | os.PathLike[str],
        capacity_bytes: int | None = None,
        *,
        layout: KVLayout | None = None,
        name: str = "L3",
        write_timeout_s: float = 30.0,
        read_only: bool = False,
    ) -> None:
        expect_type(root, (str, os.PathLike), "root (the tier's directory)")
        if not write_timeout_s > 0:
            raise BsrValueError(f"write_timeout_s must be > 0 seconds, got {write_timeout_s}")
        self.write_timeout_s = write_timeout_s
        self._stuck = 0  # reads given up on whose file calls have not returned yet
        self._stuck_lock = threading.Lock()
        super().__init__(root, capacity_bytes, name=name, layout=layout, read_only=read_only)

    def _stored(self, key: ChunkKey) -> bool:
        try:
            return run_within(self.write_timeout_s, lambda: self.contains(key))
        except TimeoutError:
            # It goes on alone; what it finds, it records as a probe would.
            raise ChunkWriteError(
                f"the look for a stored copy of {key.short()} did not end within "
                f"{self.write_timeout_s} s (mount stalled?); record not stored, earlier "
                "records intact",
                key=key,
                tier=self.name,
                cause=TimeoutError("contains"),
            ) from None

    def _stage(self, payload: Payload, layout: KVLayout) -> memoryview:
        return payload_view(payload, layout)

    def _write_record(
        self,
        fd: int,
        tmp: Path,
        key: ChunkKey,
        layout: KVLayout,
        staged: Any,
        deadline: float,
    ) -> RecordHeader:
        view: memoryview = staged
        header = make_header(key, layout, xxh3_64(view))
        # Read by the closure from a list emptied on the way out: an error's traceback
        # keeps `write` (its frame's function), and a view it held would keep the
        # staging slot out of the ring as long as the caller keeps the error.
        payload = [view]

        def write(fd: int, stop: threading.Event) -> None:
            pwrite_all(fd, memoryview(header.encode()), 0, stop)
            pwrite_all(fd, payload[0], HEADER_BYTES, stop)
            if not stop.is_set():
                os.fdatasync(fd)

        try:
            call_within(deadline - time.monotonic(), fd, write)
        except TimeoutError as exc:
            raise ChunkWriteError(
                f"the write of {tmp.name} did not end within {self.write_timeout_s} s "
                "(mount stalled?); record not stored, earlier records intact",
                key=key,
                tier=self.name,
                cause=exc,
            ) from None
        finally:
            payload.clear()
        return header

    def submit_read(self, key: ChunkKey, engine: Engine) -> PendingChunk:
        """Read `key`'s record into a slot by the read's deadline (`read_deadline`): the
        buffered file calls (open, header, payload) block in the kernel for as long as a
        stalled mount likes, so they run on a thread of their own (bounded.py); past the
        deadline the chunk is a read error (nothing withdrawn) and the read goes on alone,
        stopping before its next call, its slot released when it returns.

        A read started with less than READ_FLOOR_S left (L3 serving, after the deadline,
        what a stalled tier above could not) gets READ_FLOOR_S, unless one of this tier's
        reads is still stuck: its mount stalled, the read fails at the deadline."""
        path = self.path_of(key)
        stop = threading.Event()
        state = {"ended": False, "counted": False}

        def work() -> tuple[Slot, int]:
            try:
                return self._read(key, path, engine, stop)
            finally:
                with self._stuck_lock:
                    state["ended"] = True
                    if state["counted"]:
                        self._stuck -= 1

        with self._stuck_lock:
            left = read_deadline() - time.monotonic()
            if self._stuck == 0:
                left = max(left, READ_FLOOR_S)
        try:
            slot, n = run_within(left, work, late=lambda got: got[0].release())
        except TimeoutError:
            stop.set()
            with self._stuck_lock:
                if not state["ended"]:
                    state["counted"] = True
                    self._stuck += 1
            # No call on the stalled mount here (not even _read_error's directory check).
            late = TimeoutError("the read did not end by the read's deadline (mount stalled?)")
            raise ChunkReadError(
                f"cannot read {path}", key=key, tier=self.name, cause=late
            ) from None
        self._touch(key)
        self._count(hits=1, reads=1, bytes_read=n)
        return PendingChunk.ready(key, slot)

    def _read(
        self, key: ChunkKey, path: Path, engine: Engine, stop: threading.Event
    ) -> tuple[Slot, int]:
        """`submit_read`'s file calls: the verified slot and its length."""
        try:
            fd, st = open_record(path)
        except FileNotFoundError as exc:
            raise self._missing(key, exc) from None
        except OSError as exc:
            raise self._read_error(key, path, exc) from exc
        record = RecordId.of(st)
        try:
            header = self._known_header(key, st)
            if header is None:
                raw = os.pread(fd, HEADER_BYTES, 0)
                header = self._open_checks(key, path, raw, st)
                self._checked(key, header, st)
            record = RecordId.of(st, header)
            n = header.payload_len
            check_slot_fits(self.name, engine, key, n)
            if stop.is_set():
                raise TimeoutError("read given up at its deadline")  # no slot for nobody
            slot = engine.lease()
            try:
                slot.set_length(n)
                done = _pread_into(fd, slot, HEADER_BYTES, stop)
                good = done == n and slot.checksum(0, n) == header.payload_xxh3
            except BaseException:
                slot.release()  # back to the ring now: a kept exception must not hold it
                raise
        except ENGINE_ERRORS:
            raise
        except TimeoutError:
            raise
        except OSError as exc:
            raise self._read_error(key, path, exc, record) from exc
        finally:
            os.close(fd)
        if not good:
            slot.release()
            why = "payload checksum mismatch" if done == n else "record truncated while reading"
            raise self._corrupt(key, path, record, why)
        return slot, n


def _pread_into(fd: int, slot: Slot, offset: int, stop: threading.Event) -> int:
    """Fill the slot's valid bytes from `fd` at `offset`; returns how many were read.
    Stops before the next call once `stop` is set (its reader gave up)."""
    done = 0
    with memoryview(slot) as raw, raw.cast("B") as view:
        while done < len(view):
            if stop.is_set():
                raise TimeoutError("read given up at its deadline")
            got = os.preadv(fd, [view[done:]], offset + done)
            if got == 0:
                break
            done += got
    return done
