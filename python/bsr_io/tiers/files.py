"""Record files in a directory: the part L2 and L3 share.

Layout under `root` (directories 0700, files 0600, names are hex and digits only, so
no user string ever becomes a path component):

    chunks/<model digest>-<layout fingerprint>-w<world>r<rank>/<chunk hash>.chunk
    chunks/<same>/.<chunk hash>.<host>.<pid>.<random>.tmp     a write in progress
    quarantine/<namespace>-<chunk hash>.<ns time>.chunk (+ .why)  failed verification

A record is written to a temp file in its final directory, made durable (fdatasync),
renamed over its final name and the directory fsynced: it is visible only once it is
complete. A process killed mid-write leaves only a temp file, which the next scan
removes when its writer is dead. Each process keeps its own index (LRU order, sizes);
probes stat the file, so records written or removed by other processes sharing the
directory are seen. A record unlinked (evicted) while a reader has it open stays
readable to that reader; one unlinked before the open is reported as ChunkMissing.
"""

from __future__ import annotations

import errno
import hashlib
import os
import re
import secrets
import socket
import stat
import threading
import time
from abc import abstractmethod
from collections import OrderedDict
from dataclasses import dataclass
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
)
from bsr_io.keys import ChunkKey
from bsr_io.layout import KVLayout
from bsr_io.record import HEADER_BYTES, RecordFormatError, RecordHeader, decode_header
from bsr_io.tiers.base import Payload, Tier, check_capacity, check_payload

SUFFIX = ".chunk"
_NS_RE = re.compile(r"^[0-9a-f]{16}-[0-9a-f]{32}-w\d+r\d+$")
_STEM_RE = re.compile(r"^[0-9a-f]{16}$")
_TMP_RE = re.compile(r"^\.[0-9a-f]{16}\.([0-9a-f]{8})\.(\d+)\.[0-9a-f]+\.tmp$")
STALE_TMP_S = 3600.0  # a temp file this old is abandoned even if its pid looks alive
_HOST = hashlib.blake2b(socket.gethostname().encode(), digest_size=4).hexdigest()


@dataclass(slots=True)
class _Entry:
    """What the index knows of one record file. The header was checked against the key
    when the file had this inode and mtime; reads trust it only while both still match."""

    header: RecordHeader
    ino: int
    mtime_ns: int

    @classmethod
    def of(cls, header: RecordHeader, st: os.stat_result) -> _Entry:
        return cls(header, st.st_ino, st.st_mtime_ns)

    @property
    def nbytes(self) -> int:
        return self.header.record_bytes


@dataclass(frozen=True, slots=True)
class RecordId:
    """One record file as it was when it failed: inode (with device and mtime, since
    inode numbers are reused) and, once read, its header. Invalidation compares it with
    what is at the path now, so a record republished meanwhile is left alone."""

    dev: int
    ino: int
    mtime_ns: int
    header: RecordHeader | None = None

    @classmethod
    def of(cls, st: os.stat_result, header: RecordHeader | None = None) -> RecordId:
        return cls(st.st_dev, st.st_ino, st.st_mtime_ns, header)

    def same_file(self, st: os.stat_result) -> bool:
        return (self.dev, self.ino, self.mtime_ns) == (st.st_dev, st.st_ino, st.st_mtime_ns)


def open_record(path: str | os.PathLike[str]) -> tuple[int, os.stat_result]:
    """(fd, fstat) of the regular file at `path`, opened for reading.

    Opened non-blocking, so a FIFO (or a device) put at a record's path cannot block
    the open, and refused unless it is a regular file before any byte is read; links
    are refused by O_NOFOLLOW. Raises OSError (EISDIR, EINVAL) naming what it found."""
    fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC | os.O_NOFOLLOW | os.O_NONBLOCK)
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            kind = _KINDS.get(stat.S_IFMT(st.st_mode), "special file")
            code = errno.EISDIR if stat.S_ISDIR(st.st_mode) else errno.EINVAL
            raise OSError(code, f"not a regular file but a {kind}; records are regular files",
                          os.fspath(path))  # fmt: skip
        os.set_blocking(fd, True)
    except BaseException:
        os.close(fd)
        raise
    return fd, st


_KINDS = {
    stat.S_IFIFO: "FIFO",
    stat.S_IFSOCK: "socket",
    stat.S_IFDIR: "directory",
    stat.S_IFCHR: "character device",
    stat.S_IFBLK: "block device",
}


@dataclass(frozen=True, slots=True)
class Problem:
    """A record that failed verification (and was quarantined)."""

    path: str
    reason: str
    key: ChunkKey | None


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _mkdir(path: Path) -> None:
    # parents=True would create missing parents with the umask's mode; make each 0700.
    missing = []
    p = path
    while not p.exists():
        missing.append(p)
        p = p.parent
    for d in reversed(missing):
        try:
            d.mkdir(mode=0o700)
        except FileExistsError:
            pass


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _write_error(name: str, key: ChunkKey, path: Path, exc: OSError) -> ChunkWriteError:
    if exc.errno == errno.ENOSPC:
        what = f"no space left on the device of {path.parent}"
    elif exc.errno in (errno.EACCES, errno.EPERM, errno.EROFS):
        what = f"directory {path.parent} is not writable"
    else:
        what = f"cannot write {path}"
    return ChunkWriteError(
        f"{what}; record not stored, earlier records intact", key=key, tier=name, cause=exc
    )


class FileTier(Tier):
    """A tier of record files under `root`; subclasses supply the payload I/O."""

    def __init__(
        self,
        root: str | os.PathLike[str],
        capacity_bytes: int | None,
        *,
        name: str,
        layout: KVLayout | None = None,
        evict_to: FileTier | None = None,
    ) -> None:
        super().__init__(name)
        check_capacity(name, capacity_bytes, HEADER_BYTES + layout.chunk_bytes if layout else None)
        self.capacity_bytes = capacity_bytes
        self.root = Path(os.path.abspath(root))
        self.chunks_dir = self.root / "chunks"
        self.quarantine_dir = self.root / "quarantine"
        self.evict_to = evict_to
        self._index: OrderedDict[ChunkKey, _Entry] = OrderedDict()
        self._used = 0
        self._reserved = 0  # bytes of writes in progress, so concurrent writers fit too
        self._room = threading.Condition(self._lock)
        self._unmovable: set[tuple[int, int, int]] = set()  # bad files we could not move
        self.problems: list[Problem] = []
        try:
            _mkdir(self.chunks_dir)
        except OSError as exc:
            raise TierDown(f"cannot create or open store directory {self.root}", tier=name,
                           cause=exc) from exc  # fmt: skip
        if not os.access(self.chunks_dir, os.R_OK | os.X_OK):
            raise TierDown(f"store directory {self.chunks_dir} is not readable", tier=name)
        self.scan()

    # -- paths --------------------------------------------------------------------------
    def path_of(self, key: ChunkKey) -> Path:
        ns, stem = key.namespace(), key.file_stem()
        # Both are built from hex digests and ints; check anyway so that no future change
        # to ChunkKey can make a path that leaves the store.
        if not _NS_RE.match(ns) or not _STEM_RE.match(stem):
            raise ValueError(f"chunk key {key!r} does not give a safe file name")
        return self.chunks_dir / ns / (stem + SUFFIX)

    def _tmp_path(self, final: Path) -> Path:
        stem = final.name.removesuffix(SUFFIX)
        return final.parent / f".{stem}.{_HOST}.{os.getpid()}.{secrets.token_hex(6)}.tmp"

    # -- index --------------------------------------------------------------------------
    def scan(self) -> None:
        """Rebuild the index from the directory: headers only; torn writes are removed,
        records that fail their header checks are quarantined."""
        found: list[tuple[float, ChunkKey, _Entry]] = []
        try:
            namespaces = list(os.scandir(self.chunks_dir))
        except OSError as exc:
            raise TierDown(f"cannot list {self.chunks_dir}", tier=self.name, cause=exc) from exc
        for ns in namespaces:
            if not ns.is_dir(follow_symlinks=False) or not _NS_RE.match(ns.name):
                continue  # not ours: leave it alone
            for f in os.scandir(ns.path):
                m = _TMP_RE.match(f.name)
                if m:
                    self._reap_tmp(f, m)
                    continue
                stem = f.name.removesuffix(SUFFIX)
                if not f.name.endswith(SUFFIX) or not _STEM_RE.match(stem):
                    continue
                path = Path(f.path)
                if not f.is_file(follow_symlinks=False):
                    continue  # a link or anything else is not a record we wrote
                try:
                    st = f.stat(follow_symlinks=False)
                except OSError:
                    continue  # removed meanwhile, or not ours to look at
                try:
                    header = self._read_header_path(path)
                except FileNotFoundError:
                    continue  # removed meanwhile by another process
                except (OSError, RecordFormatError) as exc:
                    self._quarantine(path, RecordId.of(st), None, f"unreadable header: {exc}")
                    continue
                problem = None
                if header.key.namespace() != ns.name or header.key.file_stem() != stem:
                    problem = f"file holds the record of another key ({header.key.short()})"
                elif st.st_size != header.record_bytes:
                    problem = f"file is {st.st_size} bytes, record is {header.record_bytes}"
                if problem:
                    self._quarantine(path, RecordId.of(st, header), None, problem)
                    continue
                found.append((st.st_mtime, header.key, _Entry.of(header, st)))
        found.sort(key=lambda t: t[0])
        with self._lock:
            self._index = OrderedDict((k, e) for _, k, e in found)
            self._used = sum(e.nbytes for e in self._index.values())

    def _reap_tmp(self, f: os.DirEntry[str], m: re.Match[str]) -> None:
        try:
            age = time.time() - f.stat(follow_symlinks=False).st_mtime
            writer_dead = m.group(1) == _HOST and not _pid_alive(int(m.group(2)))
            if writer_dead or age > STALE_TMP_S:
                os.unlink(f.path)
        except OSError:
            pass  # gone already, or not ours to remove

    def _read_header_path(self, path: Path) -> RecordHeader:
        fd, _ = open_record(path)
        try:
            return decode_header(os.pread(fd, HEADER_BYTES, 0))
        finally:
            os.close(fd)

    def _forget(self, key: ChunkKey) -> _Entry | None:
        with self._lock:
            entry = self._index.pop(key, None)
            if entry is not None:
                self._used -= entry.nbytes
            return entry

    def _remember(self, key: ChunkKey, entry: _Entry) -> None:
        with self._lock:
            self._forget(key)
            self._index[key] = entry
            self._used += entry.nbytes

    def _touch(self, key: ChunkKey) -> None:
        with self._lock:
            if key in self._index:
                self._index.move_to_end(key)

    def contains(self, key: ChunkKey, group: str | None = None) -> bool:
        path = self.path_of(key)
        try:
            st = os.lstat(path)
        except FileNotFoundError:
            self._forget(key)
            return False
        except OSError as exc:
            raise TierDown(f"cannot stat {path}", key=key, tier=self.name, cause=exc) from exc
        if not stat.S_ISREG(st.st_mode):
            self._forget(key)
            return False  # records are regular files, never links
        with self._lock:
            entry = self._index.get(key)
            if entry is not None and (entry.ino, entry.mtime_ns) == (st.st_ino, st.st_mtime_ns):
                return True
            if (st.st_ino, st.st_mtime_ns, st.st_size) in self._unmovable:
                return False
        # Written (or replaced) by another process: adopt it after a header check.
        try:
            header = self._read_header_path(path)
        except FileNotFoundError:
            return False
        except (OSError, RecordFormatError) as exc:
            self._quarantine(path, RecordId.of(st), key, f"unreadable header: {exc}")
            return False
        problem = header.check(key)
        if problem is None and st.st_size != header.record_bytes:
            problem = f"file is {st.st_size} bytes, record is {header.record_bytes}"
        if problem:
            self._quarantine(path, RecordId.of(st, header), key, problem)
            return False
        self._remember(key, _Entry.of(header, st))
        return True

    def keys(self) -> list[ChunkKey]:
        with self._lock:
            return list(self._index)

    def stats(self) -> dict[str, Any]:
        with self._lock:
            out = self._stats(len(self._index), self._used, self.capacity_bytes)
        out["root"] = str(self.root)
        return out

    # -- verification failures ----------------------------------------------------------
    def _quarantine(self, path: Path, record: RecordId, key: ChunkKey | None, reason: str) -> None:
        """Move the bad record `record` aside so no probe advertises it again; a file
        that is not that record (republished meanwhile) is left where it is."""
        if key is not None:
            self._forget(key)
        try:
            if not self._is_record(path, record):
                return
            _mkdir(self.quarantine_dir)
            dest = self.quarantine_dir / f"{path.parent.name}-{path.name.removesuffix(SUFFIX)}"
            dest = dest.with_name(f"{dest.name}.{time.time_ns()}{SUFFIX}")
            os.rename(path, dest)
            if not record.same_file(os.stat(dest)):
                # Replaced between the check and the rename: put the newcomer back,
                # unless yet another record took the name (link never replaces).
                try:
                    os.link(dest, path)
                except FileExistsError:
                    pass
                os.unlink(dest)
                return
            fd = os.open(dest.with_suffix(".why"), os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
            try:
                os.write(fd, (reason + "\n").encode())
            finally:
                os.close(fd)
        except FileNotFoundError:
            return
        except OSError:
            # Cannot move it (read-only store): at least stop advertising it here.
            try:
                st = os.stat(path)
                if record.same_file(st):
                    self._unmovable.add((st.st_ino, st.st_mtime_ns, st.st_size))
            except OSError:
                return
        self.problems.append(Problem(str(path), reason, key))
        self._count(quarantined=1)

    def _is_record(self, path: Path, record: RecordId) -> bool:
        """Whether the file at `path` now is `record` (same inode and mtime, same header)."""
        st = os.stat(path, follow_symlinks=False)
        if not record.same_file(st):
            return False
        if record.header is None:
            return True
        try:
            return self._read_header_path(path) == record.header
        except (OSError, RecordFormatError):
            return True  # the same inode, now unreadable: still the record that failed

    def _corrupt(self, key: ChunkKey, path: Path, record: RecordId, reason: str) -> ChunkCorrupt:
        self._quarantine(path, record, key, reason)
        return ChunkCorrupt(f"{reason}; record quarantined", key=key, tier=self.name,
                            cause=str(path), record=record)  # fmt: skip

    def invalidate(self, key: ChunkKey, reason: str, *, record: object | None = None) -> None:
        """Withdraw `record`, the exact file that failed (`ChunkError.record`). Without
        one (the failure came before any file was opened) only the index entry goes:
        the file at the path, if any, is not known to be bad and is checked again."""
        if not isinstance(record, RecordId):
            self._forget(key)
            return
        self._quarantine(self.path_of(key), record, key, f"invalidated: {reason}")

    def quarantined_files(self) -> list[Path]:
        try:
            return sorted(self.quarantine_dir.glob("*" + SUFFIX))
        except OSError:
            return []

    # -- writes -------------------------------------------------------------------------
    def remove(self, key: ChunkKey) -> bool:
        path = self.path_of(key)
        self._forget(key)
        try:
            os.unlink(path)
        except FileNotFoundError:
            return False
        return True

    def _make_room(self, nbytes: int) -> None:
        """Evict until `nbytes` more fit, and reserve them (the caller must `_release`)."""
        while True:
            with self._room:
                cap = self.capacity_bytes
                while (
                    cap is not None
                    and self._used + self._reserved + nbytes > cap
                    and not self._index
                    and self._reserved
                ):
                    self._room.wait()  # only writes in flight fill it: evict them once done
                if cap is None or self._used + self._reserved + nbytes <= cap or not self._index:
                    self._reserved += nbytes
                    return
                key, entry = self._index.popitem(last=False)
                self._used -= entry.nbytes
                self._counts["evictions"] += 1
            path = self.path_of(key)
            if self.evict_to is not None:
                try:
                    self.evict_to.adopt(key, path)
                except (ChunkError, OSError):
                    pass  # demotion is best effort; the record is evicted either way
            try:
                os.unlink(path)
            except FileNotFoundError:
                pass

    def _release(self, nbytes: int) -> None:
        with self._room:
            self._reserved -= nbytes
            self._room.notify_all()

    def write(self, key: ChunkKey, payload: Payload, layout: KVLayout) -> bool:
        if key.layout_fingerprint != layout.fingerprint():
            raise LayoutError(
                f"chunk {key.short()} was keyed for another layout than {layout.name}"
            )
        check_capacity(self.name, self.capacity_bytes, HEADER_BYTES + layout.chunk_bytes)
        check_payload(payload, layout)  # bad input is refused before the disk is touched
        if self.contains(key):
            self._touch(key)
            return False
        staged = self._stage(payload, layout)
        nbytes = HEADER_BYTES + layout.chunk_bytes
        self._make_room(nbytes)
        try:
            return self._publish(key, layout, staged)
        finally:
            staged = None  # a leased staging slot goes back to the ring even on error
            self._release(nbytes)

    def _publish(self, key: ChunkKey, layout: KVLayout, staged: Any) -> bool:
        final = self.path_of(key)
        tmp = self._tmp_path(final)
        try:
            _mkdir(final.parent)
            fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o600)
            try:
                header = self._write_record(fd, tmp, key, layout, staged)
                staged = None  # release a leased slot now, not when the caller drops us
                st = os.fstat(fd)
            finally:
                os.close(fd)
            os.rename(tmp, final)
            _fsync_dir(final.parent)
        except OSError as exc:
            staged = None
            try:
                os.unlink(tmp)
            except OSError:
                pass
            raise _write_error(self.name, key, final, exc) from exc
        self._remember(key, _Entry.of(header, st))
        self._count(writes=1, bytes_written=header.payload_len)
        return True

    def adopt(self, key: ChunkKey, src: Path) -> bool:
        """Copy a record file from another tier (demotion); the copy is verified on read."""
        header = self._read_header_path(src)
        if header.key != key:
            raise ChunkCorrupt("demoted record holds another key", key=key, tier=self.name)
        if self.contains(key):
            return False
        self._make_room(header.record_bytes)
        try:
            return self._copy_in(key, src, header)
        finally:
            self._release(header.record_bytes)

    def _copy_in(self, key: ChunkKey, src: Path, header: RecordHeader) -> bool:
        final = self.path_of(key)
        tmp = self._tmp_path(final)
        try:
            _mkdir(final.parent)
            src_fd, _ = open_record(src)
            with os.fdopen(src_fd, "rb") as fin:
                fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o600)
                try:
                    done = 0
                    while done < header.record_bytes:
                        n = os.copy_file_range(fin.fileno(), fd, header.record_bytes - done)
                        if n == 0:
                            raise ChunkCorrupt("demoted record is truncated", key=key,
                                               tier=self.name)  # fmt: skip
                        done += n
                    os.fdatasync(fd)
                    st = os.fstat(fd)
                finally:
                    os.close(fd)
            os.rename(tmp, final)
            _fsync_dir(final.parent)
        except (OSError, ChunkError) as exc:
            try:
                os.unlink(tmp)
            except OSError:
                pass
            if isinstance(exc, ChunkError):
                raise
            raise _write_error(self.name, key, final, exc) from exc
        self._remember(key, _Entry.of(header, st))
        self._count(writes=1, bytes_written=header.payload_len)
        return True

    # -- what subclasses provide --------------------------------------------------------
    @abstractmethod
    def _stage(self, payload: Payload, layout: KVLayout) -> Any:
        """Check `payload` and get it ready to write (before any file is created)."""

    @abstractmethod
    def _write_record(
        self, fd: int, tmp: Path, key: ChunkKey, layout: KVLayout, staged: Any
    ) -> RecordHeader:
        """Write header and payload to the new temp file `fd` and make them durable."""

    # -- shared read checks -------------------------------------------------------------
    def _known_header(self, key: ChunkKey, st: os.stat_result) -> RecordHeader | None:
        """The indexed header of `key` if the open file is the one it was checked on.

        Saves a synchronous header read per chunk, which would queue behind the payload
        reads in flight. A file replaced or rewritten since (new inode or mtime) has its
        header read and checked again."""
        with self._lock:
            e = self._index.get(key)
        if e is None or (e.ino, e.mtime_ns, e.nbytes) != (st.st_ino, st.st_mtime_ns, st.st_size):
            return None
        return e.header

    def _open_checks(self, key: ChunkKey, path: Path, raw_header: bytes,
                     st: os.stat_result) -> RecordHeader:  # fmt: skip
        try:
            header = decode_header(raw_header)
        except RecordFormatError as exc:
            raise self._corrupt(key, path, RecordId.of(st), f"bad header: {exc}") from None
        problem = header.check(key)
        if problem is None and st.st_size != header.record_bytes:
            problem = f"file is {st.st_size} bytes, record is {header.record_bytes} (truncated?)"
        if problem:
            raise self._corrupt(key, path, RecordId.of(st, header), problem)
        return header

    def _checked(self, key: ChunkKey, header: RecordHeader, st: os.stat_result) -> None:
        self._remember(key, _Entry.of(header, st))

    def _missing(self, key: ChunkKey, exc: OSError | None = None) -> ChunkError:
        self._forget(key)
        self._count(misses=1)
        if not self.chunks_dir.is_dir():
            return TierDown(f"store directory {self.chunks_dir} is gone", key=key,
                            tier=self.name, cause=exc)  # fmt: skip
        return ChunkMissing("no record", key=key, tier=self.name, cause=exc)

    def _read_error(
        self, key: ChunkKey, path: Path, exc: OSError, record: RecordId | None = None
    ) -> ChunkError:
        if not self.chunks_dir.is_dir():
            return TierDown(f"store directory {self.chunks_dir} is gone", key=key,
                            tier=self.name, cause=exc)  # fmt: skip
        return ChunkReadError(f"cannot read {path}", key=key, tier=self.name, cause=exc,
                              record=record)  # fmt: skip
