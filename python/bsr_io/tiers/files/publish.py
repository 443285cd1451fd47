"""Atomic publication of a record file.

A record is written to a temp file in its final directory, made durable (fdatasync),
renamed over its final name and the directory fsynced: it is visible only once it is
complete. On any failure the temp file is removed and nothing is published.
"""

from __future__ import annotations

import errno
import os
from collections.abc import Callable
from pathlib import Path

from bsr_io.errors import ChunkError, ChunkWriteError
from bsr_io.model.keys import ChunkKey
from bsr_io.model.record import RecordHeader
from bsr_io.tiers.files.records import fsync_dir, mkdir_private, tmp_path

# Writes the whole record into the new temp file (fd, its path) durably; returns its header.
WriteRecord = Callable[[int, Path], RecordHeader]


def publish(
    tier: str, key: ChunkKey, final: Path, write: WriteRecord
) -> tuple[RecordHeader, os.stat_result]:
    """Publish the record `write` produces at `final`; (header, stat of the new file)."""
    tmp = tmp_path(final)
    try:
        mkdir_private(final.parent)
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o600)
        try:
            header = write(fd, tmp)
            st = os.fstat(fd)
        finally:
            os.close(fd)
        os.rename(tmp, final)
        fsync_dir(final.parent)
    except (OSError, ChunkError) as exc:
        try:
            os.unlink(tmp)
        except OSError:
            pass
        if isinstance(exc, ChunkError):
            raise
        raise write_error(tier, key, final, exc) from exc
    return header, st


def copy_record(src_fd: int, fd: int, nbytes: int) -> bool:
    """Copy `nbytes` from `src_fd` into `fd` and make them durable; False if the
    source ends first."""
    done = 0
    while done < nbytes:
        n = os.copy_file_range(src_fd, fd, nbytes - done)
        if n == 0:
            return False
        done += n
    os.fdatasync(fd)
    return True


def write_error(tier: str, key: ChunkKey, path: Path, exc: OSError) -> ChunkWriteError:
    if exc.errno == errno.ENOSPC:
        what = f"no space left on the device of {path.parent}"
    elif exc.errno in (errno.EACCES, errno.EPERM, errno.EROFS):
        what = f"directory {path.parent} is not writable"
    else:
        what = f"cannot write {path}"
    return ChunkWriteError(
        f"{what}; record not stored, earlier records intact", key=key, tier=tier, cause=exc
    )
