"""FileTier: a tier of record files in a directory, the part L2 and L3 share.

Each process keeps its own index (index.py), filled at open from names alone: a record's
header is read and checked at its first use, so opening costs no read per record.
Probes stat the file, so records written or removed by other processes sharing the
directory are seen. A record unlinked
(evicted) while a reader has it open stays readable to that reader; one unlinked
before the open is reported as ChunkMissing. Writes publish atomically (publish.py),
within the capacity (capacity.py); failed records go to quarantine (quarantine.py).
"""

from __future__ import annotations

import os
import time
import traceback
from abc import abstractmethod
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from bsr_io.errors import (
    ChunkCorrupt,
    ChunkError,
    ChunkMissing,
    ChunkReadError,
    ChunkWriteError,
    LayoutError,
    TierDown,
    proves_bad,
)
from bsr_io.model.keys import ChunkKey
from bsr_io.model.layout import KVLayout
from bsr_io.model.record import (
    HEADER_BYTES,
    OldRecordFormat,
    RecordFormatError,
    RecordHeader,
    decode_header,
)
from bsr_io.tiers.base import Payload, Tier, check_capacity, check_payload
from bsr_io.tiers.files.bounded import call_within
from bsr_io.tiers.files.capacity import Room
from bsr_io.tiers.files.index import (
    Held,
    RecordIndex,
    Slot,
    Unverified,
    check_record,
    scan_names,
    slot_path,
)
from bsr_io.tiers.files.listing import record_stat
from bsr_io.tiers.files.publish import copy_record, publish
from bsr_io.tiers.files.quarantine import Problem, Quarantine
from bsr_io.tiers.files.records import (
    Entry,
    RecordId,
    mkdir_private,
    open_record,
    read_header,
    record_path,
)
from bsr_io.tiers.files.warm import Pins, prefetch

PATHS_KEPT = 1 << 16  # record paths remembered per tier (a few MiB at most)


class FileTier(Tier):
    """A tier of record files under `root`; subclasses supply the payload I/O."""

    # How long a record's writes and sync may take together (subclasses take it as an
    # argument): a stalled device fails the save then instead of holding the caller.
    write_timeout_s: float = 30.0

    def __init__(
        self,
        root: str | os.PathLike[str],
        capacity_bytes: int | None,
        *,
        name: str,
        layout: KVLayout | None = None,
        evict_to: FileTier | None = None,
        read_only: bool = False,
    ) -> None:
        super().__init__(name)
        # read_only: a look that changes nothing on disk (`bsr-io store stats`): bad
        # records are left in place (not advertised), torn writes are not reaped.
        self.read_only = read_only
        check_capacity(name, capacity_bytes, HEADER_BYTES + layout.chunk_bytes if layout else None)
        self.capacity_bytes = capacity_bytes
        self.root = Path(os.path.abspath(root))
        self.chunks_dir = self.root / "chunks"
        self.quarantine_dir = self.root / "quarantine"
        self.evict_to = evict_to
        self._index = RecordIndex(self._lock)
        self._paths: dict[ChunkKey, Path] = {}
        self._room = Room(self._lock, capacity_bytes, self._index)
        self._quarantine = Quarantine(self.quarantine_dir, move=not read_only)
        self._pins = Pins()  # namespace directories held open: their paths stay cached
        self.problems: list[Problem] = []
        try:
            mkdir_private(self.chunks_dir)
        except OSError as exc:
            raise TierDown(
                f"cannot create or open store directory {self.root}", tier=name, cause=exc
            ) from exc
        if not os.access(self.chunks_dir, os.R_OK | os.X_OK):
            raise TierDown(f"store directory {self.chunks_dir} is not readable", tier=name)
        self.scan()

    def path_of(self, key: ChunkKey) -> Path:
        # A restore asks for each chunk's path several times (probe, open, touch); the
        # name is a pure function of the key, so it is built (and checked) once.
        path = self._paths.get(key)
        if path is None:
            if len(self._paths) >= PATHS_KEPT:
                self._paths.clear()
            path = self._paths[key] = record_path(self.chunks_dir, key)
        return path

    # -- index --------------------------------------------------------------------------
    def scan(self) -> None:
        """Rebuild the index from the directory's names (and, with a capacity, one stat
        each): no header is read, so opening a store costs the same at any size. Torn
        writes are removed; a record is checked at its first use (`contains`, a read,
        its eviction), and quarantined there if it fails."""
        sized = self.capacity_bytes is not None
        self._index.replace(scan_names(self.chunks_dir, self.name, sized, reap=not self.read_only))

    def check_listed(self) -> None:
        """Read and check the header of every record not checked since the open, as the
        views of every record need (`keys`, `headers`): records that fail their checks
        are quarantined, torn or vanished ones dropped. One header read per record."""
        checked: list[tuple[int, Slot]] = []
        for slot in self._index.listed():
            path = slot_path(self.chunks_dir, slot)
            entry = check_record(path, slot, self._withdraw_listed)
            if entry is None:
                self._index.forget_slot(slot)
            else:
                self._index.checked(slot, entry)
                checked.append((entry.mtime_ns, slot))
        if self.capacity_bytes is None:  # listed unstated: the ages came with the check
            checked.sort(key=lambda t: t[0])
            self._index.reorder_listed([s for _, s in checked])

    def prepare_probe(self, keys: Sequence[ChunkKey]) -> None:
        # Cold metadata: the request's record files are stated side by side first
        # (warm.py), so the probe's walk in order finds them in the kernel's caches.
        prefetch([self.path_of(k) for k in keys])

    def close(self) -> None:
        self._pins.close()
        super().close()

    def contains(self, key: ChunkKey, group: str | None = None) -> bool:
        try:  # the listing's rules, the opens' too: no link anywhere below chunks/
            st = record_stat(self.chunks_dir, key.namespace(), key.chunk_hash)
        except OSError as exc:
            path = self.path_of(key)
            raise TierDown(f"cannot stat {path}", key=key, tier=self.name, cause=exc) from exc
        if st is None:  # a save's usual answer: no path built for it
            self._index.forget(key)
            return False
        path = self.path_of(key)
        self._pins.pin(path.parent)
        entry = self._index.get(key)
        if entry is not None and (entry.ino, entry.mtime_ns) == (st.st_ino, st.st_mtime_ns):
            return True
        if self._quarantine.holds(st):
            return False
        # Listed at open and not checked yet, or written (or replaced) by another
        # process: adopt it after a header check.
        try:
            header = read_header(path)
        except FileNotFoundError:
            self._index.forget(key)
            return False
        except OldRecordFormat:
            self._index.forget(key)
            return False  # written by an older bsr-io: a miss, left alone
        except RecordFormatError as exc:
            self._withdraw(path, RecordId.of(st), key, f"unreadable header: {exc}")
            return False
        except OSError:
            return False  # an errno proves nothing about the record: not held for now
        problem = header.check(key)
        if problem is None and st.st_size != header.record_bytes:
            problem = f"file is {st.st_size} bytes, record is {header.record_bytes}"
        if problem:
            self._withdraw(path, RecordId.of(st, header), key, problem)
            return False
        self._index.remember(key, Entry.of(header, st))
        return True

    def keys(self) -> list[ChunkKey]:
        """The records' keys in LRU order (oldest first); checks the records not checked
        yet first (`check_listed`: a header read each)."""
        self.check_listed()
        return self._index.keys()

    def headers(self) -> list[RecordHeader]:
        """The records' headers, in LRU order (oldest first); checks as `keys` does."""
        self.check_listed()
        return [e.header for e in self._index.entries()]

    def stats(self) -> dict[str, Any]:
        """As Tier.stats; `records` counts those not checked yet too (`unverified` of
        them), `bytes` their file sizes (0 each where the tier has no capacity)."""
        with self._lock:
            out = self._stats(len(self._index), self._index.used, self.capacity_bytes)
            out["unverified"] = self._index.unverified
        out["root"] = str(self.root)
        return out

    # -- verification failures ----------------------------------------------------------
    def _withdraw(self, path: Path, record: RecordId, key: ChunkKey | None, reason: str) -> None:
        """Stop advertising `key` and quarantine the bad record `record` (only that file)."""
        if key is not None:
            self._index.forget(key)
        if self._quarantine.move_aside(path, record, reason):
            self.problems.append(Problem(str(path), reason, key))
            self._count(quarantined=1)

    def _withdraw_listed(self, path: Path, record: RecordId, reason: str) -> None:
        self._withdraw(path, record, None, reason)

    def _corrupt(self, key: ChunkKey, path: Path, record: RecordId, reason: str) -> ChunkCorrupt:
        self._withdraw(path, record, key, reason)
        return ChunkCorrupt(
            f"{reason}; record quarantined", key=key, tier=self.name, cause=str(path), record=record
        )

    def invalidate(self, key: ChunkKey, reason: str, *, record: object | None = None) -> None:
        """Withdraw `record`, the exact file that failed (`ChunkError.record`). A failure
        that proves nothing (`Unproven`: an errno, a timeout) withdraws nothing. Without
        a record (the failure came before any file was opened) only the index entry goes:
        the file at the path, if any, is not known to be bad and is checked again."""
        if not proves_bad(record):
            return
        if not isinstance(record, RecordId):
            self._index.forget(key)
            return
        self._withdraw(self.path_of(key), record, key, f"invalidated: {reason}")

    def quarantined_files(self) -> list[Path]:
        return self._quarantine.files()

    # -- writes -------------------------------------------------------------------------
    def remove(self, key: ChunkKey) -> bool:
        path = self.path_of(key)
        self._index.forget(key)
        try:
            os.unlink(path)
        except FileNotFoundError:
            return False
        return True

    def _evict(self, slot: Slot, entry: Held) -> None:
        self._count(evictions=1)
        path = slot_path(self.chunks_dir, slot)
        if self.evict_to is not None:
            if isinstance(entry, Unverified):  # never checked: the demotion is its first use
                checked = check_record(path, slot, self._withdraw_listed)
                if checked is None:
                    return  # quarantined, gone, or not ours to remove
                entry = checked
            try:
                self.evict_to.adopt(entry.header.key, path)
            except (ChunkError, OSError):
                pass  # demotion is best effort; the record is evicted either way
        try:
            os.unlink(path)
        except FileNotFoundError:
            pass

    def write(self, key: ChunkKey, payload: Payload, layout: KVLayout) -> bool:
        if key.layout_fingerprint != layout.fingerprint():
            raise LayoutError(
                f"chunk {key.short()} was keyed for another layout than {layout.name}"
            )
        check_capacity(self.name, self.capacity_bytes, HEADER_BYTES + layout.chunk_bytes)
        check_payload(payload, layout)  # bad input is refused before the disk is touched
        if self._stored(key):
            self._index.touch(key)
            return False
        # Held in a list the record writer empties, so a leased staging slot goes back
        # to the ring as soon as its bytes are written, not after the rename and fsync.
        staged = [self._stage(payload, layout)]
        nbytes = HEADER_BYTES + layout.chunk_bytes
        self._room.reserve(nbytes, self._evict)
        try:
            entry = self._publish(key, layout, staged)
        except BaseException as exc:
            _unpin(exc)
            raise
        finally:
            staged.clear()  # even on error
            self._room.release(nbytes)
        self._index.remember(key, entry)
        self._count(writes=1, bytes_written=entry.header.payload_len)
        return True

    def adopt(self, key: ChunkKey, src: Path) -> bool:
        """Copy a record file from another tier (demotion); the copy is verified on read."""
        header = read_header(src)
        if header.key != key:
            raise ChunkCorrupt("demoted record holds another key", key=key, tier=self.name)
        if self.contains(key):
            return False
        self._room.reserve(header.record_bytes, self._evict)
        try:
            _, st = publish(
                self.name,
                key,
                self.path_of(key),
                lambda fd, _tmp, by: self._copy_from(key, src, header, fd, by),
                self.write_timeout_s,
            )
        finally:
            self._room.release(header.record_bytes)
        self._index.remember(key, Entry.of(header, st))
        self._count(writes=1, bytes_written=header.payload_len)
        return True

    def _copy_from(
        self, key: ChunkKey, src: Path, header: RecordHeader, fd: int, deadline: float
    ) -> RecordHeader:
        def copy(fd: int, _stop: object) -> bool:
            # Only the source file and the doomed temp file: nothing of the caller's.
            src_fd, _ = open_record(src)
            try:
                return copy_record(src_fd, fd, header.record_bytes)
            finally:
                os.close(src_fd)

        try:
            whole = call_within(deadline - time.monotonic(), fd, copy)
        except TimeoutError as exc:
            raise ChunkWriteError(
                f"the copy of {src.name} did not end within {self.write_timeout_s} s "
                "(device stalled?); record not stored, earlier records intact",
                key=key,
                tier=self.name,
                cause=exc,
            ) from None
        if not whole:
            raise ChunkCorrupt("demoted record is truncated", key=key, tier=self.name)
        return header

    # -- what subclasses provide --------------------------------------------------------
    def _stored(self, key: ChunkKey) -> bool:
        """Whether a save of `key` finds it stored already (it then only touches it)."""
        return self.contains(key)

    @abstractmethod
    def _stage(self, payload: Payload, layout: KVLayout) -> Any:
        """Check `payload` and get it ready to write (before any file is created)."""

    def _publish(self, key: ChunkKey, layout: KVLayout, staged: list[Any]) -> Entry:
        """Publish the record of `staged` (its one item, taken by the writer) atomically,
        by `write_timeout_s` (ChunkWriteError past it, nothing published)."""
        header, st = publish(
            self.name,
            key,
            self.path_of(key),
            lambda fd, tmp, by: self._write_record(fd, tmp, key, layout, staged.pop(), by),
            self.write_timeout_s,
        )
        return Entry.of(header, st)

    def _write_record(
        self, fd: int, tmp: Path, key: ChunkKey, layout: KVLayout, staged: Any, deadline: float
    ) -> RecordHeader:
        """Write the header and payload to the new temp file `fd` and make them durable,
        by `deadline` (time.monotonic; ChunkWriteError past it); returns the header. For
        tiers that publish through `publish.py` (the default `_publish`)."""
        raise NotImplementedError(f"{type(self).__name__} publishes records its own way")

    # -- shared read checks -------------------------------------------------------------
    def _known_header(self, key: ChunkKey, st: os.stat_result) -> RecordHeader | None:
        """The indexed header of `key` if the open file is the one it was checked on.

        Saves a synchronous header read per chunk, which would queue behind the payload
        reads in flight. A file replaced or rewritten since (new inode or mtime) has its
        header read and checked again."""
        e = self._index.get(key)
        if e is None or (e.ino, e.mtime_ns, e.nbytes) != (st.st_ino, st.st_mtime_ns, st.st_size):
            return None
        return e.header

    def _open_checks(
        self, key: ChunkKey, path: Path, raw_header: bytes, st: os.stat_result
    ) -> RecordHeader:
        try:
            header = decode_header(raw_header)
        except OldRecordFormat as exc:
            self._index.forget(key)
            raise ChunkMissing(
                "record of an older format", key=key, tier=self.name, cause=exc
            ) from None
        except RecordFormatError as exc:
            raise self._corrupt(key, path, RecordId.of(st), f"bad header: {exc}") from None
        problem = header.check(key)
        if problem is None and st.st_size != header.record_bytes:
            problem = f"file is {st.st_size} bytes, record is {header.record_bytes} (truncated?)"
        if problem:
            raise self._corrupt(key, path, RecordId.of(st, header), problem)
        return header

    def _checked(self, key: ChunkKey, header: RecordHeader, st: os.stat_result) -> None:
        self._index.remember(key, Entry.of(header, st))

    def _touch(self, key: ChunkKey) -> None:
        self._index.touch(key)

    def _missing(self, key: ChunkKey, exc: OSError | None = None) -> ChunkError:
        self._index.forget(key)
        self._count(misses=1)
        if not self.chunks_dir.is_dir():
            return TierDown(
                f"store directory {self.chunks_dir} is gone", key=key, tier=self.name, cause=exc
            )
        return ChunkMissing("no record", key=key, tier=self.name, cause=exc)

    def _read_error(
        self, key: ChunkKey, path: Path, exc: OSError, record: RecordId | None = None
    ) -> ChunkError:
        if not self.chunks_dir.is_dir():
            return TierDown(
                f"store directory {self.chunks_dir} is gone", key=key, tier=self.name, cause=exc
            )
        return ChunkReadError(
            f"cannot read {path}", key=key, tier=self.name, cause=exc, record=record
        )


def _unpin(exc: BaseException) -> None:
    """Drop the locals of the ended frames an error and its causes carry: a view of the
    staging slot in one of them (the payload being written) would keep the slot out of
    the ring for as long as the caller keeps the error."""
    seen: set[int] = set()
    todo: list[object] = [exc]
    while todo:
        e = todo.pop()
        if not isinstance(e, BaseException) or id(e) in seen:
            continue
        seen.add(id(e))
        traceback.clear_frames(e.__traceback__)  # the running frames are left alone
        todo += [e.__cause__, e.__context__, getattr(e, "cause", None)]
