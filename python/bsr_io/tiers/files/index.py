"""What a process knows of the records in a directory: the index (LRU order, sizes)
and the scan that rebuilds it from headers alone.

A process killed mid-write leaves only a temp file, which the scan removes when its
writer is dead (or the file is older than STALE_TMP_S).
"""

from __future__ import annotations

import os
import stat
import threading
import time
from collections import OrderedDict
from collections.abc import Callable
from pathlib import Path

from bsr_io.errors import TierDown
from bsr_io.model.keys import ChunkKey
from bsr_io.model.record import OldRecordFormat, RecordFormatError
from bsr_io.tiers.files.listing import namespaces, records
from bsr_io.tiers.files.records import _HOST, TMP_RE, Entry, RecordId, read_header

STALE_TMP_S = 3600.0  # a temp file this old is abandoned even if its pid looks alive


class RecordIndex:
    """Records by key, oldest use first, and the bytes they take; guarded by the
    tier's lock (re-entrant, so callers may hold it across several calls)."""

    def __init__(self, lock: threading.RLock) -> None:
        self._lock = lock
        self._entries: OrderedDict[ChunkKey, Entry] = OrderedDict()
        self.used = 0

    def __len__(self) -> int:
        with self._lock:
            return len(self._entries)

    def get(self, key: ChunkKey) -> Entry | None:
        with self._lock:
            return self._entries.get(key)

    def keys(self) -> list[ChunkKey]:
        with self._lock:
            return list(self._entries)

    def entries(self) -> list[Entry]:
        with self._lock:
            return list(self._entries.values())

    def forget(self, key: ChunkKey) -> Entry | None:
        with self._lock:
            entry = self._entries.pop(key, None)
            if entry is not None:
                self.used -= entry.nbytes
            return entry

    def remember(self, key: ChunkKey, entry: Entry) -> None:
        with self._lock:
            self.forget(key)
            self._entries[key] = entry
            self.used += entry.nbytes

    def touch(self, key: ChunkKey) -> None:
        with self._lock:
            if key in self._entries:
                self._entries.move_to_end(key)

    def pop_oldest(self) -> tuple[ChunkKey, Entry] | None:
        with self._lock:
            if not self._entries:
                return None
            key, entry = self._entries.popitem(last=False)
            self.used -= entry.nbytes
            return key, entry

    def replace(self, found: list[tuple[ChunkKey, Entry]]) -> None:
        with self._lock:
            self._entries = OrderedDict(found)
            self.used = sum(e.nbytes for e in self._entries.values())


# What the scan does with a record that fails its header checks: (path, identity, why).
OnBad = Callable[[Path, RecordId, str], None]


def scan_records(chunks_dir: Path, tier: str, on_bad: OnBad) -> list[tuple[ChunkKey, Entry]]:
    """Every record under `chunks_dir`, oldest first, from headers only; torn writes are
    removed, records that fail their header checks go to `on_bad`. The names come from
    the store's one listing (listing.py), so the tier holds what every other view lists."""
    found: list[tuple[float, ChunkKey, Entry]] = []
    try:
        names = namespaces(chunks_dir)
    except OSError as exc:
        raise TierDown(f"cannot list {chunks_dir}", tier=tier, cause=exc) from exc
    for ns in names:
        try:
            listed = list(records(chunks_dir / ns, on_tmp=_reap_tmp))
        except OSError:
            continue  # unreadable now: not indexed, checked again by the next probe
        for stem, path in listed:
            try:
                st = os.lstat(path)
            except OSError:
                continue  # removed meanwhile, or not ours to look at
            if not stat.S_ISREG(st.st_mode):
                continue  # replaced by a link or anything else since it was listed
            try:
                header = read_header(path)
            except (FileNotFoundError, OldRecordFormat):
                continue  # removed meanwhile, or an older bsr-io's record: not indexed
            except RecordFormatError as exc:
                on_bad(path, RecordId.of(st), f"unreadable header: {exc}")
                continue
            except OSError:
                continue  # an errno proves nothing: not indexed now, checked again later
            problem = None
            if header.key.namespace() != ns or header.key.file_stem() != stem:
                problem = f"file holds the record of another key ({header.key.short()})"
            elif st.st_size != header.record_bytes:
                problem = f"file is {st.st_size} bytes, record is {header.record_bytes}"
            if problem:
                on_bad(path, RecordId.of(st, header), problem)
                continue
            found.append((st.st_mtime, header.key, Entry.of(header, st)))
    found.sort(key=lambda t: t[0])
    return [(k, e) for _, k, e in found]


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _reap_tmp(path: Path) -> None:
    m = TMP_RE.match(path.name)
    if m is None:
        return
    try:
        age = time.time() - os.lstat(path).st_mtime
        writer_dead = m.group(1) == _HOST and not _pid_alive(int(m.group(2)))
        if writer_dead or age > STALE_TMP_S:
            os.unlink(path)
    except OSError:
        pass  # gone already, or not ours to remove
