"""The scheduler side's record catalog: which records every rank holds, without I/O on
vLLM's scheduler thread, and without ever listing a directory.

A record directory is one model and context, one group layout and one rank
(`ChunkKey.namespace()`, `...-w{world}r{rank}`). The catalog keeps, per directory name
without its rank (a "base"), one map from chunk hash to a bitmask of the ranks that hold
it, so asking whether a prefix is held on every rank is one dictionary look-up per chunk,
not one per chunk and rank.

It is fed only by the workers, which alone can list their own node's drive
(inventory.py): each worker's inventory arrives at start with vLLM's handshake metadata
and then, in bounded batches, with every step's worker metadata: what it found, what it
saved, what left its store. A rank that has not reported holds nothing. A report under a
new epoch (the worker restarted) first withdraws everything that worker reported, and
only that (it may have reported another rank's directory that other workers report
too); so does `forget` (a worker that stopped reporting). A failed load drops the
request's records here until the workers report again those they still hold. A stale
entry costs one failed load (records are verified when read), never wrong data.
"""

from __future__ import annotations

import re
import threading
from collections.abc import Iterable, Sequence

from bsr_io.integrations.vllm.metadata import Inventory

Masks = dict[str, dict[int, int]]  # base -> chunk hash -> bitmask of the ranks holding it
Reporters = dict[str, dict[int, int]]  # directory -> chunk hash -> bitmask of its reporters
_RANK_RE = re.compile(r"^(.*r)(\d+)$")


def _split(ns: str) -> tuple[str, int]:
    """A directory name as (base, rank bit); a name without a rank is rank 0."""
    m = _RANK_RE.match(ns)
    return (m.group(1), 1 << int(m.group(2))) if m else (ns, 1)


class RecordCatalog:
    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._masks: Masks = {}
        self._reporters: Reporters = {}
        self._epochs: dict[int, int] = {}  # worker rank -> the epoch of its reports
        self.version = 0  # bumped on every change: a memoized answer is stale after one

    # -- lookups (no system call; called on vLLM's scheduler thread) ---------------------
    # Changes mutate the maps in place under the lock; a lookup reads without it: single
    # dictionary reads are atomic, and a lookup racing a change sees it or not (a stale
    # answer costs a miss on the worker, never wrong data).
    def _need(self, dirs: Sequence[str]) -> list[tuple[dict[int, int], int]]:
        """Per base of `dirs`: its map and the mask of the ranks asked for."""
        need: dict[str, int] = {}
        for ns in dirs:
            base, bit = _split(ns)
            need[base] = need.get(base, 0) | bit
        return [(self._masks.get(base, {}), mask) for base, mask in need.items()]

    def holds(self, dirs: Sequence[str], chunk_hash: int) -> bool:
        """Whether every directory of `dirs` holds the chunk."""
        return all(m.get(chunk_hash, 0) & need == need for m, need in self._need(dirs))

    def leading(self, dirs: Sequence[str], hashes: Sequence[int], start: int, end: int) -> int:
        """The largest m in [start, end] with hashes[start:m] all held in every directory
        of `dirs`."""
        if start >= end:
            return start
        for masks, need in self._need(dirs):
            get, n = masks.get, start
            while n < end and get(hashes[n], 0) & need == need:
                n += 1
            end = n
        return end

    # -- feeding ---------------------------------------------------------------------
    # A directory's rank bit is set for a chunk while at least one worker reports the
    # record: workers report other ranks' directories too (a replicated group is stored
    # once, in rank 0's), so a worker's restart or silence withdraws exactly what that
    # worker reported, and a record another worker still reports stays.
    def _add(self, who: int, ns: str, hashes: frozenset[int]) -> None:
        base, bit = _split(ns)
        masks = self._masks.setdefault(base, {})
        by = self._reporters.setdefault(ns, {})
        for h in hashes:
            masks[h] = masks.get(h, 0) | bit
            by[h] = by.get(h, 0) | who

    def _remove(self, who: int, ns: str, hashes: Iterable[int]) -> None:
        """Withdraw the reports of the workers in mask `who`; a chunk nobody reports any
        more leaves the directory's rank bit."""
        by = self._reporters.get(ns)
        if by is None:
            return  # a removal never makes an entry
        base, bit = _split(ns)
        masks = self._masks.get(base, {})
        for h in hashes:
            if by.get(h, 0) & ~who:
                by[h] &= ~who
                continue
            by.pop(h, None)
            if left := masks.get(h, 0) & ~bit:
                masks[h] = left
            else:
                masks.pop(h, None)

    def _withdraw(self, worker: int) -> None:
        """Everything worker `worker` reported, and only that."""
        who = 1 << worker
        for ns, by in list(self._reporters.items()):
            self._remove(who, ns, [h for h, m in by.items() if m & who])

    def report(self, worker: int, inv: Inventory) -> None:
        """Apply worker `worker`'s report. Under a new epoch (the worker restarted and
        reports afresh) what it reported before is withdrawn first."""
        with self._lock:
            known = self._epochs.get(worker)
            changed = bool(inv.added or inv.removed)
            if known != inv.epoch:
                if known is not None:
                    self._withdraw(worker)
                    changed = True
                self._epochs[worker] = inv.epoch
            for ns, hashes in inv.removed.items():
                self._remove(1 << worker, ns, frozenset(hashes))
            for ns, hashes in inv.added.items():
                self._add(1 << worker, ns, frozenset(hashes))
            # Most steps' reports are empty: they leave the scheduler's memoized answers
            # standing, so a waiting request is not looked up again in every pass.
            if changed:
                self.version += 1

    def forget(self, worker: int) -> None:
        """Worker `worker` stopped reporting: what it reported is withdrawn until it
        reports under a new epoch."""
        with self._lock:
            if self._epochs.pop(worker, None) is not None:
                self._withdraw(worker)
                self.version += 1

    def reporting(self) -> set[int]:
        """The workers whose reports the catalog holds."""
        return set(self._epochs)

    def drop(self, ns: str, hashes: Iterable[int]) -> None:
        """Forget these records (a failed load met them), whoever reported them, until a
        worker reports them again."""
        got = frozenset(hashes)
        if not got:
            return
        with self._lock:
            self._remove(-1, ns, got)  # -1: every reporter's bit
            self.version += 1

    def entries(self) -> int:
        """(base, chunk) entries held: the catalog's size."""
        return sum(map(len, self._masks.values()))
