"""Atomic publication of a record file.

A record is written to a temp file in its final directory, made durable (fdatasync),
renamed over its final name and the directory fsynced: it is visible only once it is
complete. On any failure the temp file is removed and nothing is published.

All of it has the record's deadline (the tier's `write_timeout_s`, from the start). The
file calls (creating the temp file, its fstat and close, the rename, the directory's
fsync, removing the temp file) block in the kernel as long as a stalled drive or mount
likes (on NFS and FUSE even an fstat or a close asks the server), so they run on a
thread of their own (bounded.py) and the save fails (ChunkWriteError) at the deadline,
the caller touching the file and directory no more. Two such calls per record, not one
per syscall: each hand-off to a thread costs about as much CPU as the syscalls it
carries (GIL hand-overs, wake-ups), so the rename takes the temp file's fstat and close
before it and the directory's fsync after it. That fsync is a group commit
(`DirSyncs`): records renamed in one directory while its fsync runs share the next one,
as a journal commits many transactions at once. (L2 records do all of it in one native
call instead: the engine's `publish`, used by `SSDTier`.)

A publication given up before its rename removes its temp file when the call it was in
returns. A rename given up on may still complete on its thread: it then publishes the
temp file, which was written whole and fdatasynced before the rename began (a record
like one another process wrote: found by the next scan or read, its header checked and
its payload verified on every read); one that fails there removes the temp file. A temp
file created after its caller gave up is removed.
"""

from __future__ import annotations

import errno
import os
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from bsr_io.errors import ChunkError, ChunkWriteError
from bsr_io.model.keys import ChunkKey
from bsr_io.model.record import RecordHeader
from bsr_io.tiers.files.bounded import run_within
from bsr_io.tiers.files.records import fsync_dir, mkdir_private, tmp_path

# Writes the whole record into the new temp file (fd, its path) durably, by the deadline
# (time.monotonic) it is given; returns its header.
WriteRecord = Callable[[int, Path, float], RecordHeader]
# How long removing a failed save's temp file is waited for at least (the deadline may
# be spent by then); past it the removal goes on alone.
CLEANUP_S = 0.5


@dataclass(slots=True)
class _DirState:
    cond: threading.Condition = field(default_factory=threading.Condition)
    renamed: int = 0  # renames done in the directory, counted before its fsync is asked
    synced: int = 0  # renames an fsync that began after them has made durable
    running: bool = False


class DirSyncs:
    """Group commit of directory fsyncs. `sync(dir)` returns once an fsync of `dir` that
    began after the caller's rename has succeeded: the caller's own, or one another
    caller started meanwhile and that covers it. While one runs, the renames that come in
    wait, and the first of them runs the next fsync for all. A failed fsync covers
    nobody: each caller it would have covered raises it or runs one of its own."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._dirs: dict[Path, _DirState] = {}

    def sync(self, path: Path) -> None:
        with self._lock:
            st = self._dirs.setdefault(path, _DirState())
        with st.cond:
            st.renamed += 1
            ticket = st.renamed
            while st.running:
                st.cond.wait()
            if st.synced >= ticket:
                return
            st.running = True
            covers = st.renamed  # every rename counted so far precedes this fsync
        done = False
        try:
            fsync_dir(path)
            done = True
        finally:
            with st.cond:
                st.running = False
                if done:
                    st.synced = max(st.synced, covers)
                st.cond.notify_all()


_dir_syncs = DirSyncs()


def publish(
    tier: str,
    key: ChunkKey,
    final: Path,
    write: WriteRecord,
    timeout: float,
) -> tuple[RecordHeader, os.stat_result]:
    """Publish the record `write` produces at `final` within `timeout` seconds; (header,
    stat of the new file). ChunkWriteError past it, nothing published by this call."""
    deadline = time.monotonic() + timeout
    tmp = tmp_path(final)
    try:
        fd = run_within(
            deadline - time.monotonic(),
            lambda: _create(final, tmp),
            late=lambda fd: _drop(fd, tmp),
        )
    except TimeoutError:
        raise _late(tier, key, final, "temp file's creation", timeout) from None
    except OSError as exc:
        raise write_error(tier, key, final, exc) from exc
    try:
        header = write(fd, tmp, deadline)
    except (OSError, ChunkError) as exc:
        _remove(tmp, max(CLEANUP_S, deadline - time.monotonic()), fd)
        if isinstance(exc, ChunkError):
            raise
        raise write_error(tier, key, final, exc) from exc
    except BaseException:
        _remove(tmp, CLEANUP_S, fd)
        raise
    stop = threading.Event()
    step = ["fstat"]
    try:
        st = run_within(deadline - time.monotonic(), lambda: _finish(fd, tmp, final, stop, step))
    except TimeoutError:
        stop.set()
        # Goes on alone: it removes the temp file if it fails or was given up before
        # the rename; a rename under way may still publish the whole record.
        note = " (it may yet publish it whole)" if step[0] == "rename" else ""
        raise _late(tier, key, final, step[0], timeout, note) from None
    except OSError as exc:
        raise write_error(tier, key, final, exc) from exc
    return header, st


def _create(final: Path, tmp: Path) -> int:
    mkdir_private(final.parent)
    return os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o600)


def _drop(fd: int, tmp: Path) -> None:
    """A temp file created after its caller gave up: nobody writes it."""
    os.close(fd)
    _unlink_quietly(tmp)


def _finish(
    fd: int, tmp: Path, final: Path, stop: threading.Event, step: list[str]
) -> os.stat_result:
    """The written temp file's fstat (its identity for the index) and close, its rename
    and the directory's fsync. The first two wait on some file systems as long as a
    stalled device likes (NFS flushes on both), so they are the runner's, not the
    caller's. `step` says where it is; `stop`, set when the caller gave up, ends it
    before the rename, the temp file removed."""
    try:
        try:
            st = os.fstat(fd)
            step[0] = "close"
        finally:
            os.close(fd)
    except OSError:
        _unlink_quietly(tmp)
        raise
    step[0] = "rename"  # before looking at `stop`: the caller reads it after setting it
    if stop.is_set():
        _unlink_quietly(tmp)
        raise TimeoutError("publication given up before its rename")
    try:
        os.rename(tmp, final)
    except OSError:
        _unlink_quietly(tmp)
        raise
    _dir_syncs.sync(final.parent)
    return st


def _remove(tmp: Path, timeout: float, fd: int | None = None) -> None:
    """Close `fd` (the temp file's, when given) and remove the temp file on a runner,
    waited for `timeout` at most: a close too may wait for a write still stalled."""

    def remove() -> None:
        if fd is not None:
            os.close(fd)
        _unlink_quietly(tmp)

    try:
        run_within(timeout, remove)
    except TimeoutError:
        pass  # goes on alone; a temp file left behind is never read as a record


def _unlink_quietly(tmp: Path) -> None:
    try:
        os.unlink(tmp)
    except OSError:
        pass


def _late(
    tier: str, key: ChunkKey, final: Path, what: str, timeout: float, note: str = ""
) -> ChunkWriteError:
    return ChunkWriteError(
        f"the {what} of {final.name} did not end within {timeout:.3g} s (device stalled?); "
        f"record not stored{note}, earlier records intact",
        key=key,
        tier=tier,
        cause=TimeoutError(what),
    )


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
