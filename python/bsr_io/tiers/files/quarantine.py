"""Records that failed verification are moved aside, so no probe advertises them again:

    quarantine/<namespace>-<chunk hash>.<ns time>.chunk (+ .why)

Only the exact file that failed (its RecordId) is moved: a record republished at the
path meanwhile stays, and one renamed in between the check and the move is put back.
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass
from pathlib import Path

from bsr_io.model.keys import ChunkKey
from bsr_io.model.record import RecordFormatError
from bsr_io.tiers.files.listing import quarantined
from bsr_io.tiers.files.records import SUFFIX, RecordId, mkdir_private, read_header


@dataclass(frozen=True, slots=True)
class Problem:
    """A record that failed verification (and was quarantined)."""

    path: str
    reason: str
    key: ChunkKey | None


class Quarantine:
    """`move`: False for a look that changes nothing (`bsr-io store stats`): a bad record
    is then only remembered as bad, as one that cannot be moved is."""

    def __init__(self, directory: Path, *, move: bool = True) -> None:
        self.dir = directory
        self.move = move
        self._unmovable: set[tuple[int, int, int]] = set()  # bad files left in place

    def move_aside(self, path: Path, record: RecordId, reason: str) -> bool:
        """Withdraw `record`: move it here with a note of `reason`, or, where it cannot be
        moved (a read-only store), remember it as bad. False when there was nothing to
        withdraw (gone, or the file at `path` is no longer that record)."""
        try:
            if not _is_record(path, record):
                return False
            if not self.move:
                return self._leave(path, record)
            mkdir_private(self.dir)
            dest = self.dir / f"{path.parent.name}-{path.name.removesuffix(SUFFIX)}"
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
                return False
            fd = os.open(dest.with_suffix(".why"), os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
            try:
                os.write(fd, (reason + "\n").encode())
            finally:
                os.close(fd)
        except FileNotFoundError:
            return False
        except OSError:
            # Cannot move it: at least stop advertising it here.
            return self._leave(path, record)
        return True

    def _leave(self, path: Path, record: RecordId) -> bool:
        try:
            st = os.stat(path)
        except OSError:
            return False
        if record.same_file(st):
            self._unmovable.add((st.st_ino, st.st_mtime_ns, st.st_size))
        return True

    def holds(self, st: os.stat_result) -> bool:
        """Whether the file `st` describes is a bad record left in place."""
        return (st.st_ino, st.st_mtime_ns, st.st_size) in self._unmovable

    def files(self) -> list[Path]:
        return quarantined(self.dir)


def _is_record(path: Path, record: RecordId) -> bool:
    """Whether the file at `path` now is `record` (same inode and mtime, same header)."""
    st = os.stat(path, follow_symlinks=False)
    if not record.same_file(st):
        return False
    if record.header is None:
        return True
    try:
        return read_header(path) == record.header
    except (OSError, RecordFormatError):
        return True  # the same inode, now unreadable: still the record that failed
