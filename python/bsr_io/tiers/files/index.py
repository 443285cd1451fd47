"""What a process knows of the records in a directory: the index (LRU order, sizes)
and the scan that fills it from the store's listing, names only.

Opening a store reads no record's header, so it costs the same for 10^3 records as for
10^6: the scan lists names (and stats each file when a capacity needs its size and
age), and each listed record stays `Unverified` until its first use (a probe, a read,
an eviction) reads and checks its header; `FileTier.check_listed` checks the rest at
once for the views that need every header (`bsr-io store stats|verify`). A process
killed mid-write leaves only a temp file, which the scan removes when its writer is
dead (or the file is older than STALE_TMP_S).
"""

from __future__ import annotations

import functools
import os
import stat
import threading
import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from bsr_io.errors import TierDown
from bsr_io.model.keys import ChunkKey
from bsr_io.model.record import OldRecordFormat, RecordFormatError
from bsr_io.tiers.files.listing import namespaces, record_stats
from bsr_io.tiers.files.records import _HOST, SUFFIX, TMP_RE, Entry, RecordId, read_header

STALE_TMP_S = 3600.0  # a temp file this old is abandoned even if its pid looks alive

Slot = tuple[str, int]  # a record's name: (namespace, chunk hash)


@functools.lru_cache(maxsize=1 << 16)
def slot_of(key: ChunkKey) -> Slot:
    """The name `key`'s record has (cached: the namespace hashes the model name)."""
    return key.namespace(), key.chunk_hash


def slot_path(chunks_dir: Path, slot: Slot) -> Path:
    return chunks_dir / slot[0] / f"{slot[1]:032x}{SUFFIX}"


@dataclass(slots=True)
class Unverified:
    """A record the scan listed whose header nobody has read yet: it counts its file's
    size (0 where the tier has no capacity and did not stat it) and its age (mtime)."""

    nbytes: int
    mtime_ns: int = 0


Held = Entry | Unverified


class RecordIndex:
    """Records by name, oldest use first, and the bytes they take; guarded by the
    tier's lock (re-entrant, so callers may hold it across several calls). Checked
    records are `Entry`s and are looked up by key; listed ones are `Unverified`."""

    def __init__(self, lock: threading.RLock) -> None:
        self._lock = lock
        self._entries: OrderedDict[Slot, Held] = OrderedDict()
        self.used = 0
        self.unverified = 0  # how many of the entries are Unverified

    def __len__(self) -> int:
        with self._lock:
            return len(self._entries)

    def get(self, key: ChunkKey) -> Entry | None:
        """The checked entry of `key` (None for a record only listed so far)."""
        with self._lock:
            e = self._entries.get(slot_of(key))
            return e if isinstance(e, Entry) and e.header.key == key else None

    def holds(self, key: ChunkKey) -> bool:
        """Whether the index has `key`'s record, checked or only listed."""
        with self._lock:
            return slot_of(key) in self._entries

    def keys(self) -> list[ChunkKey]:
        """The checked records' keys, oldest use first."""
        return [e.header.key for e in self.entries()]

    def entries(self) -> list[Entry]:
        with self._lock:
            return [e for e in self._entries.values() if isinstance(e, Entry)]

    def listed(self) -> list[Slot]:
        """The records not checked yet, oldest use first."""
        with self._lock:
            return [s for s, e in self._entries.items() if isinstance(e, Unverified)]

    def _pop(self, slot: Slot) -> Held | None:
        entry = self._entries.pop(slot, None)
        if entry is not None:
            self.used -= entry.nbytes
            self.unverified -= isinstance(entry, Unverified)
        return entry

    def forget(self, key: ChunkKey) -> Held | None:
        with self._lock:
            return self._pop(slot_of(key))

    def forget_slot(self, slot: Slot) -> None:
        with self._lock:
            self._pop(slot)

    def remember(self, key: ChunkKey, entry: Entry) -> None:
        """Index `key`'s checked record as the newest; a record only listed so far
        keeps its place (its first check is no use of it)."""
        slot = slot_of(key)
        with self._lock:
            if isinstance(self._entries.get(slot), Unverified):
                self.checked(slot, entry)
                return
            self._pop(slot)
            self._entries[slot] = entry
            self.used += entry.nbytes

    def checked(self, slot: Slot, entry: Entry) -> None:
        """Replace the listed record at `slot` with its checked entry, in its place."""
        with self._lock:
            old = self._entries.get(slot)
            if old is None:
                return  # forgotten meanwhile (evicted, removed)
            self.used += entry.nbytes - old.nbytes
            self.unverified -= isinstance(old, Unverified)
            self._entries[slot] = entry  # an existing key keeps its position

    def touch(self, key: ChunkKey) -> None:
        with self._lock:
            slot = slot_of(key)
            if slot in self._entries:
                self._entries.move_to_end(slot)

    def pop_oldest(self) -> tuple[Slot, Held] | None:
        with self._lock:
            if not self._entries:
                return None
            slot = next(iter(self._entries))
            entry = self._pop(slot)
            assert entry is not None
            return slot, entry

    def replace(self, found: list[tuple[Slot, Held]]) -> None:
        with self._lock:
            self._entries = OrderedDict(found)
            self.used = sum(e.nbytes for e in self._entries.values())
            self.unverified = sum(isinstance(e, Unverified) for e in self._entries.values())

    def retain(self, keep: Callable[[str], bool]) -> None:
        """Keep only the records of the namespaces `keep` accepts."""
        with self._lock:
            self.replace([(s, e) for s, e in self._entries.items() if keep(s[0])])

    def reorder_listed(self, order: list[Slot]) -> None:
        """Put the listed-then-checked records `order` (oldest first) back into the
        places they held, in that order: a tier that did not stat its records at the
        scan learns their ages at the check, and lists them oldest first after it."""
        with self._lock:
            todo = iter(order)
            pos = set(order)
            items = [(next(todo), None) if s in pos else (s, e) for s, e in self._entries.items()]
            self._entries = OrderedDict((s, self._entries[s] if e is None else e) for s, e in items)


# What a check does with a record that fails it: (path, identity, why).
OnBad = Callable[[Path, RecordId, str], None]


def scan_names(
    chunks_dir: Path, tier: str, sized: bool, *, reap: bool = True
) -> list[tuple[Slot, Held]]:
    """Every record under `chunks_dir`, by name, Unverified: no header is read. `sized`:
    each is stated for its size and age and listed oldest first (a capacity needs
    them); else the listing's own data suffices (names, file types) and sizes are 0.
    Torn writes are removed (unless not `reap`). The names come from the store's one listing
    (listing.py), so the tier holds what every other view lists."""
    found: list[tuple[Slot, Held]] = []
    try:
        names = namespaces(chunks_dir)
    except OSError as exc:
        raise TierDown(f"cannot list {chunks_dir}", tier=tier, cause=exc) from exc
    for ns in names:
        try:
            listed = list(record_stats(chunks_dir / ns, _reap_tmp if reap else None, sized=sized))
        except OSError:
            continue  # unreadable now: not indexed, checked again by the next probe
        if sized:
            found += [
                ((ns, int(h, 16)), Unverified(st.st_size, st.st_mtime_ns)) for h, st in listed if st
            ]
        else:
            found += [((ns, int(h, 16)), Unverified(0)) for h, _ in listed]
    if sized:
        found.sort(key=lambda t: t[1].mtime_ns)  # oldest first
    return found


def check_record(path: Path, slot: Slot, on_bad: OnBad) -> Entry | None:
    """Read and check the header of the record at `path`, named `slot`: its entry, or
    None where it is gone, not a regular file, an older bsr-io's or unreadable now (an
    errno proves nothing), or fails its checks (then it goes to `on_bad`)."""
    try:
        st = os.lstat(path)
    except OSError:
        return None  # removed meanwhile, or not ours to look at
    if not stat.S_ISREG(st.st_mode):
        return None  # replaced by a link or anything else since it was listed
    try:
        header = read_header(path)
    except (FileNotFoundError, OldRecordFormat):
        return None  # removed meanwhile, or an older bsr-io's record: not indexed
    except RecordFormatError as exc:
        on_bad(path, RecordId.of(st), f"unreadable header: {exc}")
        return None
    except OSError:
        return None  # an errno proves nothing: not indexed now, checked again later
    problem = None
    if slot_of(header.key) != slot:
        problem = f"file holds the record of another key ({header.key.short()})"
    elif st.st_size != header.record_bytes:
        problem = f"file is {st.st_size} bytes, record is {header.record_bytes}"
    if problem:
        on_bad(path, RecordId.of(st, header), problem)
        return None
    return Entry.of(header, st)


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
