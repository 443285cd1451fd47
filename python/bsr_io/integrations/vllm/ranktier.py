"""The SSD tier as one tensor-parallel worker saves into it: its own rank's records only.

Every TP rank's records live in their own `-w<W>r<R>` directories of one store
directory. Each worker enforces `store_bytes` for its own rank alone: its index (LRU
order, bytes used, eviction) holds only records whose key names this rank, so one
rank's saves never evict another rank's records, and no worker acts on a stale view of
what the others wrote. The cap is per rank: a store shared by TP ranks holds at most
tp x store_bytes (rank 0 also holds the records of groups every rank shares).

Recency: records a load restored and records vLLM's own prefix cache served (the
scheduler tells the worker their chunk hashes) are touched in this index, in memory,
without reading a byte, so the chunks in use are the last to be evicted.
"""

from __future__ import annotations

import os
from collections.abc import Iterable

from bsr_io._core import Engine
from bsr_io.model.keys import ChunkKey
from bsr_io.tiers.files.tier import FileTier
from bsr_io.tiers.ssd import SSDTier


class RankTier(SSDTier):
    def __init__(
        self,
        root: str | os.PathLike[str],
        capacity_bytes: int | None,
        engine: Engine,
        *,
        world_size: int,
        ranks: Iterable[int],
        evict_to: FileTier | None = None,
        durable: bool = True,
        write_timeout_s: float = 30.0,
    ) -> None:
        # The key ranks this worker writes (its own; rank 0 also the shared groups' 0).
        self._owned = frozenset(f"-w{world_size}r{r}" for r in ranks)
        super().__init__(
            root,
            capacity_bytes,
            engine,
            evict_to=evict_to,
            durable=durable,
            write_timeout_s=write_timeout_s,
        )

    def owns(self, key: ChunkKey) -> bool:
        return f"-w{key.world_size}r{key.rank}" in self._owned

    def scan(self) -> None:
        """The directory's records of this worker's ranks, oldest first (others ignored)."""
        super().scan()  # names only: a record's rank is in its directory's name
        self._index.retain(lambda ns: ns.endswith(tuple(self._owned)))

    def touch(self, keys: Iterable[ChunkKey]) -> int:
        """Mark `keys`' records as just used (those this index holds); returns how many.
        Memory only: no system call."""
        n = 0
        with self._lock:
            for key in keys:
                if self._index.holds(key):  # checked or only listed so far
                    self._index.touch(key)
                    n += 1
        return n
