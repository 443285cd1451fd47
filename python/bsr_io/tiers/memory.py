"""L1: chunk records in host memory, byte capacity, LRU eviction."""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass
from typing import Any

from bsr_io._core import Engine, xxh3_64
from bsr_io.errors import ChunkCorrupt, ChunkMissing, proves_bad
from bsr_io.model.keys import ChunkKey
from bsr_io.model.layout import KVLayout
from bsr_io.tiers.base import (
    Payload,
    PendingChunk,
    Tier,
    check_capacity,
    check_slot_fits,
    payload_view,
)


@dataclass(slots=True)
class _Entry:
    data: bytearray
    xxh3: int


class MemoryTier(Tier):
    """Chunks kept as private byte copies; the least recently used go first when full.

    Reads copy into an engine slot and check the checksum taken at write time, so a
    stray write into the copy is caught like a bad disk block.
    """

    def __init__(
        self,
        capacity_bytes: int,
        *,
        layout: KVLayout | None = None,
        name: str = "L1",
    ) -> None:
        super().__init__(name)
        check_capacity(name, capacity_bytes, layout.chunk_bytes if layout else None)
        self.capacity_bytes = capacity_bytes
        self._entries: OrderedDict[ChunkKey, _Entry] = OrderedDict()
        self._used = 0

    def contains(self, key: ChunkKey, group: str | None = None) -> bool:
        with self._lock:
            return key in self._entries

    def submit_read(self, key: ChunkKey, engine: Engine) -> PendingChunk:
        with self._lock:
            entry = self._entries.get(key)
            if entry is None:
                self._count(misses=1)
                raise ChunkMissing("not in memory", key=key, tier=self.name)
            self._entries.move_to_end(key)
        n = len(entry.data)
        check_slot_fits(self.name, engine, key, n)
        slot = engine.lease()
        slot.fill_from(entry.data)
        slot.set_length(n)
        if slot.checksum(0, n) != entry.xxh3:
            slot.release()  # back to the ring now: a kept exception must not hold it
            self.invalidate(key, "payload checksum mismatch in memory", record=entry)
            raise ChunkCorrupt("payload checksum mismatch", key=key, tier=self.name, record=entry)
        self._count(hits=1, reads=1, bytes_read=n)
        return PendingChunk.ready(key, slot)

    def write(self, key: ChunkKey, payload: Payload, layout: KVLayout) -> bool:
        view = payload_view(payload, layout)
        check_capacity(self.name, self.capacity_bytes, view.nbytes)
        with self._lock:
            if key in self._entries:
                self._entries.move_to_end(key)
                return False
        data = bytearray(view)  # copy outside the lock; a chunk can be tens of MiB
        entry = _Entry(data, xxh3_64(data))
        with self._lock:
            if key in self._entries:
                return False
            while self._used + len(data) > self.capacity_bytes:
                _, old = self._entries.popitem(last=False)
                self._used -= len(old.data)
                self._counts["evictions"] += 1
            self._entries[key] = entry
            self._used += len(data)
            self._counts["writes"] += 1
            self._counts["bytes_written"] += len(data)
        return True

    def remove(self, key: ChunkKey) -> bool:
        return self._drop(key)

    def invalidate(self, key: ChunkKey, reason: str, *, record: object | None = None) -> None:
        """Drop `record` (the failing read's entry, `ChunkError.record`) if it is still
        the one held at `key`; a copy written there since the read is good and stays.
        Without a record, whatever `key` holds goes; an `Unproven` failure drops nothing."""
        if proves_bad(record) and self._drop(key, only=record):
            self._count(quarantined=1)

    def _drop(self, key: ChunkKey, only: object | None = None) -> bool:
        """Remove what `key` holds (only if it is `only`, when given)."""
        with self._lock:
            entry = self._entries.get(key)
            if entry is None or (only is not None and entry is not only):
                return False
            del self._entries[key]
            self._used -= len(entry.data)
            return True

    def keys(self) -> list[ChunkKey]:
        with self._lock:
            return list(self._entries)

    def stats(self) -> dict[str, Any]:
        with self._lock:
            return self._stats(len(self._entries), self._used, self.capacity_bytes)
