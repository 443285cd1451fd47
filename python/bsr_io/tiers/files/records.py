"""Record files on disk: their names, their identity and how one is opened.

Names are hex and digits only, so no user string ever becomes a path component:

    chunks/<model digest>-<layout fingerprint>-w<world>r<rank>/<chunk hash>.chunk
    chunks/<same>/.<chunk hash>.<host>.<pid>.<random>.tmp     a write in progress
"""

from __future__ import annotations

import errno
import hashlib
import os
import re
import socket
import stat
from dataclasses import dataclass
from pathlib import Path

from bsr_io.errors import BsrValueError
from bsr_io.model.keys import ChunkKey
from bsr_io.model.record import HEADER_BYTES, RecordHeader, decode_header

SUFFIX = ".chunk"
# Record format 2 (128-bit model digests and chunk hashes); format 1's 16-hex names
# match neither, so an older bsr-io's records are left alone: a miss, never an error.
NS_RE = re.compile(r"^[0-9a-f]{32}-[0-9a-f]{32}-w\d+r\d+$")
STEM_RE = re.compile(r"^[0-9a-f]{32}$")
TMP_RE = re.compile(r"^\.[0-9a-f]{32}\.([0-9a-f]{8})\.(\d+)\.[0-9a-f]+\.tmp$")
_HOST = hashlib.blake2b(socket.gethostname().encode(), digest_size=4).hexdigest()


def record_path(chunks_dir: Path, key: ChunkKey) -> Path:
    return Path(record_name(os.fspath(chunks_dir), key))


def record_name(chunks_dir: str, key: ChunkKey) -> str:
    """`record_path` as text: a save's hot path builds no pathlib object."""
    ns, stem = key.namespace(), key.file_stem()
    # Both are built from hex digests and ints; check anyway so that no future change
    # to ChunkKey can make a path that leaves the store.
    if not NS_RE.match(ns) or not STEM_RE.match(stem):
        raise BsrValueError(f"chunk key {key!r} does not give a safe file name")
    return f"{chunks_dir}/{ns}/{stem}{SUFFIX}"


def tmp_path(final: Path) -> Path:
    """A temp name beside `final` that names its writer (host, pid), for the scan."""
    return Path(tmp_name(os.fspath(final)))


def tmp_name(final: str) -> str:
    """`tmp_path` as text."""
    parent, name = os.path.split(final)
    stem = name.removesuffix(SUFFIX)
    return os.path.join(parent, f".{stem}.{_HOST}.{os.getpid()}.{os.urandom(6).hex()}.tmp")


@dataclass(slots=True)
class Entry:
    """What the index knows of one record file. The header was checked against the key
    when the file had this inode and mtime; reads trust it only while both still match."""

    header: RecordHeader
    ino: int
    mtime_ns: int

    @classmethod
    def of(cls, header: RecordHeader, st: os.stat_result) -> Entry:
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


_KINDS = {
    stat.S_IFIFO: "FIFO",
    stat.S_IFSOCK: "socket",
    stat.S_IFDIR: "directory",
    stat.S_IFCHR: "character device",
    stat.S_IFBLK: "block device",
}


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
            raise OSError(
                code, f"not a regular file but a {kind}; records are regular files", os.fspath(path)
            )
        os.set_blocking(fd, True)
    except BaseException:
        os.close(fd)
        raise
    return fd, st


def read_header(path: Path) -> RecordHeader:
    fd, _ = open_record(path)
    try:
        return decode_header(os.pread(fd, HEADER_BYTES, 0))
    finally:
        os.close(fd)


def mkdir_private(path: Path) -> None:
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


def fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
