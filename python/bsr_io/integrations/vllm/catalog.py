"""The scheduler side's record catalog: which records exist, without I/O on vLLM's
scheduler thread.

An in-memory set of chunk hashes per record directory (a directory is one model and
context, one group layout, one rank: `ChunkKey.namespace()`), built at start by one
listing of the store's directories (file names only, no header read), fed by the saves
the workers confirm and emptied of a request's records when its load fails. A
background thread lists the directories again every few seconds and swaps the sets in,
so records written or removed by other processes are seen. A stale entry costs one
failed load (records are verified when read), never wrong data.

A pool below the SSD tier (Mooncake) cannot be listed: saves written through to it are
added with `keep=True` and survive rescans (an SSD record evicted or deleted is still
served from the pool) until a failed load drops them.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Iterable, Sequence
from pathlib import Path

from bsr_io.tiers.files.records import NS_RE, STEM_RE, SUFFIX


def _list(chunks_dirs: Sequence[Path]) -> dict[str, set[int]]:
    out: dict[str, set[int]] = {}
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
            found = out.setdefault(ns.name, set())
            for name in names:
                stem = name[: -len(SUFFIX)]
                if name.endswith(SUFFIX) and STEM_RE.match(stem):
                    found.add(int(stem, 16))
    return out


class RecordCatalog:
    def __init__(self, roots: Iterable[str | os.PathLike[str]]) -> None:
        self._dirs = [Path(os.path.abspath(r)) / "chunks" for r in roots]
        self._lock = threading.Lock()
        self._sets: dict[str, set[int]] = _list(self._dirs)
        # Changes made while a rescan runs, replayed onto its result before the swap.
        self._journal: list[tuple[bool, str, frozenset[int]]] | None = None
        self._kept: dict[str, set[int]] = {}  # written through to a pool: no listing sees them
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self.rescans = 0
        self.version = 0  # bumped on every change: a memoized answer is stale after one

    # -- lookups (no system call; called on vLLM's scheduler thread) ---------------------
    def holds(self, ns: str, chunk_hash: int) -> bool:
        got = self._sets.get(ns)
        return got is not None and chunk_hash in got

    def leading(self, ns: str, hashes: Sequence[int], start: int, end: int,
                whole: frozenset[int] | None = None) -> int:  # fmt: skip
        """The largest m in [start, end] with hashes[start:m] all held in `ns`.
        `whole`: frozenset(hashes[start:end]), when the caller checks several
        directories (a set against a set reuses the stored hashes)."""
        got = self._sets.get(ns)
        if got is None or start >= end:
            return start
        if (whole if whole is not None else frozenset(hashes[start:end])) <= got:
            return end
        lo, hi = start, end - 1  # hashes[start:lo] held; hashes[start:hi+1] not
        while lo < hi:
            mid = (lo + hi + 1) // 2
            if got.issuperset(hashes[start:mid]):
                lo = mid
            else:
                hi = mid - 1
        return lo

    # -- feeding ---------------------------------------------------------------------
    def add(self, ns: str, hashes: Iterable[int], keep: bool = False) -> None:
        """`keep`: the records are also in a pool no rescan lists; they stay until dropped."""
        got = frozenset(hashes)
        if keep and got:
            with self._lock:
                self._apply(self._kept, True, ns, got)
        self._change(True, ns, got)

    def drop(self, ns: str, hashes: Iterable[int]) -> None:
        got = frozenset(hashes)
        if got:
            with self._lock:
                if ns in self._kept:
                    self._apply(self._kept, False, ns, got)
        self._change(False, ns, got)

    def _change(self, add: bool, ns: str, hashes: frozenset[int]) -> None:
        if not hashes:
            return
        with self._lock:
            self._apply(self._sets, add, ns, hashes)
            self.version += 1
            if self._journal is not None:
                self._journal.append((add, ns, hashes))

    @staticmethod
    def _apply(sets: dict[str, set[int]], add: bool, ns: str, hashes: frozenset[int]) -> None:
        # Copy-on-write: a lookup on another thread keeps iterating its own set.
        cur = sets.get(ns, set())
        sets[ns] = (cur | hashes) if add else (cur - hashes)

    def rescan(self) -> None:
        with self._lock:
            self._journal = []
        fresh = _list(self._dirs)
        with self._lock:
            for ns, kept in self._kept.items():
                self._apply(fresh, True, ns, frozenset(kept))
            for add, ns, hashes in self._journal or []:
                self._apply(fresh, add, ns, hashes)
            self._journal = None
            if fresh != self._sets:
                self.version += 1
            self._sets = fresh
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
