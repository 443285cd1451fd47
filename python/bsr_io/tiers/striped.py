"""L2 over several drives: one record directory per drive, chunks placed by key.

Servers that keep long contexts have several NVMe drives; one directory is one drive's
bandwidth. `StripedSSDTier` keeps an `SSDTier` per directory (its own index, capacity,
eviction and quarantine) and places each chunk on drive `chunk_hash mod n`. A prefix's
chunks have unrelated hashes, so the W reads a window keeps in flight land on every
drive, and all of them stream at once through the one engine.

At start every directory must exist (a drive's mount point: a missing one is not
created on whatever filesystem lies beneath) and have room for a record and for its
capacity; anything else is an error naming the directory. At restore, an I/O error
or a vanished directory marks that drive failing: the chunk falls back to a lower tier
like any failed chunk, the record is not quarantined (the drive failed, not the
record), and for `recheck_s` the drive's chunks are neither advertised nor read, so
later chunks go to the lower tier at once instead of failing one by one. A payload
that fails its checksum is the record's fault and is quarantined on its drive.
"""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from bsr_io._core import Engine, Slot
from bsr_io.errors import BsrValueError, CapacityError, ChunkError, ChunkReadError, TierDown
from bsr_io.model.keys import ChunkKey
from bsr_io.model.layout import KVLayout
from bsr_io.model.record import HEADER_BYTES
from bsr_io.tiers.base import (
    ENGINE_ERRORS,
    DirectChunk,
    DirectUnavailable,
    Payload,
    PendingChunk,
    Tier,
)
from bsr_io.tiers.files import FileTier
from bsr_io.tiers.files.listing import held_bytes
from bsr_io.tiers.ssd import SSDTier

RECHECK_S = 30.0  # how long a failing drive is left out before it is tried again
# Errors that say the drive (not the record) failed.
DRIVE_ERRORS = (ChunkReadError, TierDown)


def _free_bytes(path: Path) -> int:
    st = os.statvfs(path)
    return st.f_bavail * st.f_frsize


def check_drive_dirs(
    name: str,
    roots: Sequence[Path],
    capacities: Sequence[int | None],
    layout: KVLayout | None,
) -> None:
    """Refuse, naming the directory, a list that cannot work: empty, repeated, missing,
    not a directory, not writable, without room for one record or for its capacity."""
    if not roots:
        raise BsrValueError(f"{name}: give at least one directory (one per drive)")
    if len(set(roots)) != len(roots):
        raise BsrValueError(f"{name}: a directory is listed twice: {[str(r) for r in roots]}")
    record = HEADER_BYTES + (layout.chunk_bytes if layout else 0)
    for root, cap in zip(roots, capacities, strict=True):
        if not root.is_dir():
            what = "is not a directory" if root.exists() else "does not exist"
            raise TierDown(
                f"{name}: drive directory {root} {what}; pass each drive's mount "
                "point (or a directory on it) that exists",
                tier=name,
            )
        if not os.access(root, os.R_OK | os.W_OK | os.X_OK):
            raise TierDown(f"{name}: drive directory {root} is not writable", tier=name)
        free = _free_bytes(root)
        if free < record:
            raise CapacityError(
                f"{name}: drive directory {root} is full: {free} bytes free, one record "
                f"takes {record}"
            )
        if cap is not None:
            held = _held_bytes(root)
            if cap > free + held:
                raise CapacityError(
                    f"{name}: capacity {cap} bytes for {root} exceeds its {free} free bytes "
                    f"plus the {held} bytes of records it holds; lower the capacity"
                )


def _held_bytes(root: Path) -> int:
    """The bytes of the records a drive directory holds, through the tier's listing (the
    one way anything learns what a store holds)."""
    return held_bytes(root / "chunks")


class StripedSSDTier(Tier):
    """An SSD tier over several directories, one per drive (see the module's doc)."""

    defers_verify = True

    def __init__(
        self,
        roots: Sequence[str | os.PathLike[str]],
        capacity_bytes: int | None | Sequence[int | None],
        engine: Engine,
        *,
        layout: KVLayout | None = None,
        evict_to: FileTier | None = None,
        name: str = "L2",
        recheck_s: float = RECHECK_S,
    ) -> None:
        super().__init__(name)
        self.roots = [Path(os.path.abspath(r)) for r in roots]
        if capacity_bytes is None or isinstance(capacity_bytes, int):
            caps: list[int | None] = [capacity_bytes] * len(self.roots)
        else:
            caps = list(capacity_bytes)
            if len(caps) != len(self.roots):
                raise BsrValueError(
                    f"{name}: {len(caps)} capacities for {len(self.roots)} directories"
                )
        check_drive_dirs(name, self.roots, caps, layout)
        self.engine = engine
        self.recheck_s = recheck_s
        # Each drive is a whole SSD tier of its own; errors it raises name it L2[i]. Reads
        # and writes go through `drives` (a test may wrap one in a fault double); file
        # paths come from the record directories themselves.
        self._files = [
            SSDTier(r, c, engine, layout=layout, evict_to=evict_to, name=f"{name}[{i}]")
            for i, (r, c) in enumerate(zip(self.roots, caps, strict=True))
        ]
        self.drives: list[Tier] = list(self._files)
        self._failing: dict[int, tuple[float, str]] = {}  # drive -> (since, why)
        self._fail_lock = threading.Lock()

    # -- placement and drive health -----------------------------------------------------
    def drive_of(self, key: ChunkKey) -> int:
        return key.chunk_hash % len(self.drives)

    def drives_dir(self, d: int, key: ChunkKey) -> Path:
        """Drive `d`'s directory of records of `key`'s namespace (model, layout, ranks)."""
        return self._files[d].path_of(key).parent

    def path_of(self, key: ChunkKey) -> Path:
        return self._files[self.drive_of(key)].path_of(key)

    def _failing_why(self, d: int) -> str | None:
        with self._fail_lock:
            entry = self._failing.get(d)
            if entry is None:
                return None
            if time.monotonic() - entry[0] >= self.recheck_s:
                del self._failing[d]  # time to try it again
                return None
            return entry[1]

    def _mark_failing(self, d: int, exc: BaseException) -> None:
        with self._fail_lock:
            self._failing.setdefault(d, (time.monotonic(), str(exc)))

    def failing_drives(self) -> dict[str, str]:
        """Directory -> why, for the drives left out now."""
        return {
            str(self.roots[d]): why
            for d in range(len(self.drives))
            if (why := self._failing_why(d)) is not None
        }

    def _drive_failed(self, d: int, key: ChunkKey, exc: ChunkError) -> ChunkError:
        """The error to raise for a read the drive failed: no record attached, so the
        window's invalidation forgets the index entry and quarantines nothing."""
        self._mark_failing(d, exc)
        return ChunkReadError(
            f"drive {self.roots[d]} failed: {exc}", key=key, tier=self.name, cause=exc
        )

    # -- discovery ------------------------------------------------------------------------
    def contains(self, key: ChunkKey, group: str | None = None) -> bool:
        d = self.drive_of(key)
        if self._failing_why(d) is not None:
            return False  # discovery then plans the chunk from a lower tier
        try:
            return self.drives[d].contains(key, group)
        except TierDown as exc:
            self._mark_failing(d, exc)
            return False

    # -- data -----------------------------------------------------------------------------
    def _readable_drive(self, key: ChunkKey) -> int:
        """The key's drive, or ChunkReadError while that drive is marked failing."""
        d = self.drive_of(key)
        why = self._failing_why(d)
        if why is not None:
            raise ChunkReadError(
                f"drive {self.roots[d]} is failing ({why})", key=key, tier=self.name
            )
        return d

    def submit_read(
        self, key: ChunkKey, engine: Engine | None = None, *, verify: bool = True
    ) -> PendingChunk:
        engine = engine or self.engine
        d = self._readable_drive(key)
        drive = self.drives[d]
        try:
            if drive.defers_verify:
                inner = drive.submit_read(key, engine, verify=verify)  # type: ignore[call-arg]
            else:
                inner = drive.submit_read(key, engine)
        except ENGINE_ERRORS:
            raise
        except DRIVE_ERRORS as exc:
            raise self._drive_failed(d, key, exc) from exc

        def finish(timeout: float | None) -> Slot:
            try:
                slot = inner.wait(timeout)
            except DRIVE_ERRORS as exc:
                raise self._drive_failed(d, key, exc) from exc
            self._count(hits=1, reads=1, bytes_read=len(slot))
            return slot

        if inner.expected_xxh3 is None:
            return PendingChunk(key, finish, inner.done)
        return PendingChunk(
            key, finish, inner.done, expected_xxh3=inner.expected_xxh3, reject=inner.reject
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
        """A direct read (see `SSDTier.submit_read_into`) from the key's drive."""
        engine = engine or self.engine
        d = self._readable_drive(key)
        drive = self.drives[d]
        if not isinstance(drive, SSDTier):
            raise DirectUnavailable(f"drive {d} reads through slots")
        try:
            inner = drive.submit_read_into(key, engine, bufs, runs, inflight=inflight)
        except DRIVE_ERRORS as exc:
            raise self._drive_failed(d, key, exc) from exc

        def finish(timeout: float | None) -> None:
            try:
                inner.wait(timeout)
            except DRIVE_ERRORS as exc:
                raise self._drive_failed(d, key, exc) from exc
            self._count(hits=1, reads=1, bytes_read=sum(r[3] for r in runs))

        def hashed(timeout: float | None) -> tuple[int, float]:
            try:
                got = inner.wait_hashed(timeout)
            except DRIVE_ERRORS as exc:
                raise self._drive_failed(d, key, exc) from exc
            assert got is not None  # an SSDTier's direct read hashes as it lands
            self._count(hits=1, reads=1, bytes_read=sum(r[3] for r in runs))
            return got

        return DirectChunk(
            key,
            finish,
            inner.done,
            expected_xxh3=inner.expected_xxh3,
            reject=inner.reject,
            abandon=inner.abandon,
            returned=inner.returned,
            hashed=hashed,
        )

    def read_into(self, key: ChunkKey, engine: Engine | None = None) -> Slot:
        return self.submit_read(key, engine).wait()

    def write(self, key: ChunkKey, payload: Payload, layout: KVLayout) -> bool:
        wrote = self.drives[self.drive_of(key)].write(key, payload, layout)
        if wrote:
            self._count(writes=1, bytes_written=layout.chunk_bytes)
        return wrote

    def adopt(self, key: ChunkKey, src: Path) -> bool:
        """Take a record demoted from an upper tier onto the key's drive."""
        return self._files[self.drive_of(key)].adopt(key, src)

    def remove(self, key: ChunkKey) -> bool:
        return self.drives[self.drive_of(key)].remove(key)

    def invalidate(self, key: ChunkKey, reason: str, *, record: object | None = None) -> None:
        drive = self.drives[self.drive_of(key)]
        try:
            if record is None:
                drive.invalidate(key, reason)
            else:
                drive.invalidate(key, reason, record=record)
        except TierDown as exc:
            self._mark_failing(self.drive_of(key), exc)

    def keys(self) -> list[ChunkKey]:
        """Every drive's keys, each drive's in its LRU order (oldest first)."""
        return [k for drive in self.drives for k in drive.keys()]

    def stats(self) -> dict[str, Any]:
        per = [drive.stats() for drive in self.drives]
        failing = self.failing_drives()
        for s, root in zip(per, self.roots, strict=True):
            s["failing"] = failing.get(str(root))
        caps = [s["capacity"] for s in per]
        out = self._stats(
            sum(s["records"] for s in per),
            sum(s["bytes"] for s in per),
            None if None in caps else sum(caps),
        )
        for k in ("evictions", "quarantined", "misses"):
            out[k] = sum(s.get(k, 0) for s in per)
        out["drives"] = per
        return out

    def quarantined_files(self) -> list[Path]:
        return [f for drive in self._files for f in drive.quarantined_files()]

    def close(self) -> None:
        for drive in self.drives:
            drive.close()
