"""A store: tiers in order (fastest first) behind the tier interface.

Discovery asks each tier in order; a chunk's source is the first tier that holds it.
A read that fails verification in one tier is invalidated there and served by the
next tier that holds the chunk. Writes go to the first tier, or to all of them when
written through.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from typing import Any

from bsr_io._core import Engine, Slot
from bsr_io.errors import (
    BsrTypeError,
    BsrValueError,
    ChunkError,
    ChunkMissing,
    TierDown,
    Unproven,
    expect_type,
)
from bsr_io.model.keys import ChunkKey
from bsr_io.model.layout import KVLayout
from bsr_io.tiers.base import Payload, PendingChunk, Tier
from bsr_io.tiers.lower import LowerTier
from bsr_io.tiers.memory import MemoryTier
from bsr_io.tiers.ssd import SSDTier
from bsr_io.tiers.striped import StripedSSDTier


class Store(Tier):
    def __init__(self, tiers: Sequence[Tier], name: str = "store") -> None:
        super().__init__(name)
        self.tiers: list[Tier] = list(tiers)
        if not self.tiers:
            raise BsrValueError("a store needs at least one tier")
        names = [t.name for t in self.tiers]
        if len(set(names)) != len(names):
            raise BsrValueError(f"tier names must be unique, got {names}")

    def tier(self, name: str) -> Tier:
        for t in self.tiers:
            if t.name == name:
                return t
        raise KeyError(f"no tier {name!r}; tiers: {[t.name for t in self.tiers]}")

    def _source(self, key: ChunkKey, group: str | None, start: int = 0) -> int | None:
        for i in range(start, len(self.tiers)):
            try:
                if self.tiers[i].contains(key, group):
                    return i
            except TierDown:
                continue  # a tier that is down holds nothing for discovery
        return None

    def contains(self, key: ChunkKey, group: str | None = None) -> bool:
        return self._source(key, group) is not None

    def source_of(self, keys: Sequence[ChunkKey], group: str | None = None) -> list[int]:
        """Tier index of the first tier holding each leading key; stops at the first key
        no tier holds. Metadata only."""
        out = []
        for key in keys:
            src = self._source(key, group)
            if src is None:
                break
            out.append(src)
        return out

    def prepare_probe(self, keys: Sequence[ChunkKey]) -> None:
        for t in self.tiers:
            t.prepare_probe(keys)

    def probe(self, keys: Sequence[ChunkKey], group: str | None = None) -> int:
        return len(self.source_of(keys, group))

    def read_into(self, key: ChunkKey, engine: Engine) -> Slot:
        errors: list[ChunkError] = []
        start = 0
        while (src := self._source(key, None, start)) is not None:
            tier = self.tiers[src]
            try:
                slot = tier.read_into(key, engine)
                self._count(hits=1, reads=1, bytes_read=len(slot))
                return slot
            except ChunkError as exc:
                errors.append(exc)
            start = src + 1
        self._count(misses=1)
        if errors:
            last = errors[-1]
            # Each tier withdrew what it proved bad itself: nothing left to invalidate.
            raise type(last)(
                "no tier could deliver a verified copy: " + "; ".join(map(str, errors)),
                key=key,
                tier=self.name,
                record=Unproven(None, "handled by each tier"),
            )
        raise ChunkMissing("in no tier", key=key, tier=self.name)

    def submit_read(self, key: ChunkKey, engine: Engine) -> PendingChunk:
        """Reads through `read_into` (tier fallback needs the first result first)."""
        return PendingChunk.ready(key, self.read_into(key, engine))

    def write(
        self, key: ChunkKey, payload: Payload, layout: KVLayout, through: bool = True
    ) -> bool:
        """Write to the first tier, or to every tier when `through`. True if any tier
        stored a new record."""
        wrote = False
        for tier in self.tiers if through else self.tiers[:1]:
            wrote = tier.write(key, payload, layout) or wrote
        return wrote

    def remove(self, key: ChunkKey) -> bool:
        removed = False
        for tier in self.tiers:
            removed = tier.remove(key) or removed
        return removed

    def invalidate(self, key: ChunkKey, reason: str, *, record: object | None = None) -> None:
        for tier in self.tiers:
            if record is None:
                tier.invalidate(key, reason)
            else:
                tier.invalidate(key, reason, record=record)

    def keys(self) -> list[ChunkKey]:
        seen: dict[ChunkKey, None] = {}
        for tier in self.tiers:
            seen.update(dict.fromkeys(tier.keys()))
        return list(seen)

    def stats(self) -> dict[str, Any]:
        with self._lock:
            out: dict[str, Any] = dict(name=self.name, **self._counts)
        out["tiers"] = [t.stats() for t in self.tiers]
        return out

    def close(self) -> None:
        for tier in self.tiers:
            tier.close()


def open_store(
    engine: Engine,
    ssd_dir: str | os.PathLike[str] | Sequence[str | os.PathLike[str]],
    *,
    layout: KVLayout | None = None,
    l1_bytes: int | None = None,
    ssd_bytes: int | None = None,
    lower_dir: str | os.PathLike[str] | None = None,
    demote: bool = True,
) -> Store:
    """The usual composition: optional L1, L2 on `ssd_dir`, optional L3 on `lower_dir`
    (records evicted from L2 are demoted there when `demote`). A list of directories
    (one per drive) stripes L2 over them (`StripedSSDTier`; `ssd_bytes` per directory)."""
    expect_type(engine, Engine, "engine")
    expect_type(layout, (KVLayout, type(None)), "layout")
    dirs = [ssd_dir] if isinstance(ssd_dir, (str, os.PathLike)) else ssd_dir
    if not isinstance(dirs, Sequence) or not all(isinstance(d, (str, os.PathLike)) for d in dirs):
        raise BsrTypeError(
            f"ssd_dir must be a directory (str or path) or a list of them, got {ssd_dir!r}"
        )
    tiers: list[Tier] = []
    if l1_bytes:
        tiers.append(MemoryTier(l1_bytes, layout=layout))
    lower = LowerTier(lower_dir, layout=layout) if lower_dir is not None else None
    evict_to = lower if demote else None
    if isinstance(ssd_dir, (str, os.PathLike)):
        tiers.append(SSDTier(ssd_dir, ssd_bytes, engine, layout=layout, evict_to=evict_to))
    else:
        tiers.append(StripedSSDTier(ssd_dir, ssd_bytes, engine, layout=layout, evict_to=evict_to))
    if lower is not None:
        tiers.append(lower)
    return Store(tiers)
