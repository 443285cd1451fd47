"""The scheduler side's record catalog: which records exist, without I/O on vLLM's
scheduler thread.

A record directory is one model and context, one group layout and one rank
(`ChunkKey.namespace()`, `...-w{world}r{rank}`). The catalog keeps, per directory name
without its rank (a "base"), one map from chunk hash to a bitmask of the ranks that hold
it, so asking whether a prefix is held on every rank is one dictionary look-up per chunk,
not one per chunk and rank. It is built at start by one listing of the store's
directories (file names only, no header read), fed by the saves the workers confirm and
emptied of a request's records when its load fails. A background thread lists the
directories again every few seconds and swaps the maps in, so records written or removed
by other processes are seen. A stale entry costs one failed load (records are verified
when read), never wrong data.

A pool below the SSD tier (Mooncake) cannot be listed: saves written through to it are
added with `keep=True` and survive rescans (an SSD record evicted or deleted is still
served from the pool) until a failed load drops them.
"""

from __future__ import annotations

import os
import re
import threading
from collections.abc import Iterable, Sequence
from pathlib import Path

from bsr_io.tiers.files.records import NS_RE, STEM_RE, SUFFIX

Masks = dict[str, dict[int, int]]  # base -> chunk hash -> bitmask of the ranks holding it
_RANK_RE = re.compile(r"^(.*r)(\d+)$")


def _split(ns: str) -> tuple[str, int]:
    """A directory name as (base, rank bit); a name without a rank is rank 0."""
    m = _RANK_RE.match(ns)
    return (m.group(1), 1 << int(m.group(2))) if m else (ns, 1)


def _list(chunks_dirs: Sequence[Path]) -> Masks:
    out: Masks = {}
    for d in chunks_dirs:
        try:
            namespaces = list(os.scandir(d))
        except OSError:
            continue  # a tier that is down holds nothing for discovery
        for ns in namespaces:
            if not NS_RE.match(ns.name):
                continue
            try:
                names = os.listdir(ns.path)
            except OSError:
                continue
            base, bit = _split(ns.name)
            masks = out.setdefault(base, {})
            for name in names:
                stem = name[: -len(SUFFIX)]
                if name.endswith(SUFFIX) and STEM_RE.match(stem):
                    h = int(stem, 16)
                    masks[h] = masks.get(h, 0) | bit
    return out


def _apply(masks: Masks, add: bool, ns: str, hashes: frozenset[int]) -> None:
    base, bit = _split(ns)
    if add:
        m = masks.setdefault(base, {})
        for h in hashes:
            m[h] = m.get(h, 0) | bit
        return
    held = masks.get(base)
    if held is None:
        return  # a drop never makes an entry
    for h in hashes:
        if left := held.get(h, 0) & ~bit:
            held[h] = left
        else:
            held.pop(h, None)


class RecordCatalog:
    def __init__(self, roots: Iterable[str | os.PathLike[str]]) -> None:
        self._dirs = [Path(os.path.abspath(r)) / "chunks" for r in roots]
        self._lock = threading.Lock()
        self._masks: Masks = _list(self._dirs)
        # Changes made while a rescan runs, replayed onto its result before the swap.
        self._journal: list[tuple[bool, str, frozenset[int]]] | None = None
        self._kept: Masks = {}  # written through to a pool: no listing sees them
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self.rescans = 0
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
    def add(self, ns: str, hashes: Iterable[int], keep: bool = False) -> None:
        """`keep`: the records are also in a pool no rescan lists; they stay until dropped."""
        got = frozenset(hashes)
        if keep and got:
            with self._lock:
                _apply(self._kept, True, ns, got)
        self._change(True, ns, got)

    def drop(self, ns: str, hashes: Iterable[int]) -> None:
        got = frozenset(hashes)
        if got:
            with self._lock:
                _apply(self._kept, False, ns, got)
        self._change(False, ns, got)

    def _change(self, add: bool, ns: str, hashes: frozenset[int]) -> None:
        if not hashes:
            return
        with self._lock:
            _apply(self._masks, add, ns, hashes)
            self.version += 1
            if self._journal is not None:
                self._journal.append((add, ns, hashes))

    def rescan(self) -> None:
        with self._lock:
            self._journal = []
        fresh = _list(self._dirs)
        with self._lock:
            for base, kept in self._kept.items():
                masks = fresh.setdefault(base, {})
                for h, bits in kept.items():
                    masks[h] = masks.get(h, 0) | bits
            for add, ns, hashes in self._journal or []:
                _apply(fresh, add, ns, hashes)
            self._journal = None
            if fresh != self._masks:
                self.version += 1
            self._masks = fresh
            self.rescans += 1

    def start(self, interval_s: float) -> None:
        def loop() -> None:
            while not self._stop.wait(interval_s):
                try:
                    self.rescan()
                except Exception:  # noqa: BLE001 - a failed listing keeps the old sets
                    pass

        self._thread = threading.Thread(target=loop, name="bsr-vllm-catalog", daemon=True)
        self._thread.start()

    def close(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=5)
