"""What one worker's own store holds, reported to the scheduler side in bounded batches.

Each rank's records live on its own node's drive, which no other process can list (the
paper's two nodes shared no file system). So the worker, never the scheduler, lists its
record directories: those of the key ranks it owns (`-w{world}r{rank}`), under the store
and the lower tier, file names only (a record's name is its chunk hash; no header is
read), through the store's one listing (tiers/files/listing.py): no link is followed
and only regular files count, the rules the loads open by, so nothing is offered that
a load would refuse. At start it lists them once; every `rescan_s` a thread lists them
again and queues what changed (a record evicted, quarantined or deleted by hand; one
written by another process sharing the directory). A save that lands while a listing
runs is never taken for a removal (fresh.py). Saves the worker confirms are queued at
once, and so are records written through to a pool, which no listing can see
("pinned": only a failed load removes them).

`take(limit)` hands out at most `limit` chunk hashes per call, one call per engine step:
the start listing first, then the changes in the order they happened (a change queued
while the start listing is still going out waits for it, so no removal overtakes the
addition it undoes). A store of a million records then neither stalls a step nor makes
one message large. Each start draws a new `epoch`; the scheduler side drops what it knew
of this worker's ranks when it sees a new one, so a restarted node reports afresh.
"""

from __future__ import annotations

import os
import secrets
import threading
from collections.abc import Iterable, Sequence
from pathlib import Path

from bsr_io.integrations.vllm.metadata import Inventory
from bsr_io.tiers.files.fresh import RecentChanges
from bsr_io.tiers.files.listing import Held, holds, list_store
from bsr_io.tiers.files.records import SUFFIX

__all__ = ["SUFFIX", "Held", "StoreInventory", "list_records"]


def list_records(
    chunks_dirs: Sequence[Path], suffixes: Iterable[str] | None = None, *, strict: bool = False
) -> Held:
    """The records under `chunks_dirs` (namespaces ending in one of `suffixes`; all when
    None), by the store's one listing (names only, no link followed, regular files): what
    a load can open. A directory that cannot be read holds nothing, or with `strict`
    raises OSError (a re-listing then keeps the view it had); an absent one holds nothing."""
    out: Held = {}
    for d in chunks_dirs:
        try:
            listed = list_store(d, suffixes)
        except OSError:
            if strict:
                raise
            continue
        for ns, hashes in listed.items():
            out.setdefault(ns, set()).update(hashes)
    return out


class StoreInventory:
    def __init__(self, roots: Iterable[str | os.PathLike[str]], suffixes: Iterable[str]) -> None:
        self._dirs = [Path(os.path.abspath(r)) / "chunks" for r in roots]
        self._suffixes = tuple(sorted(set(suffixes)))
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self.relists = 0
        self._pinned: Held = {}  # written through to a pool: kept across epochs and listings
        # Saves and drops made while a listing runs are applied on top of what it found.
        self._changes = RecentChanges()
        self._restart()

    def _restart(self) -> None:
        """A fresh epoch: everything held goes out again, from the first batch."""
        held, since = self._list(strict=False)
        with self._lock:
            self._merge(held, since)
            self.epoch = secrets.randbits(62)
            self._held = held
            # The start listing, sent in order: (dir, its hashes) and a cursor into it.
            self._sync = [(ns, sorted(h)) for ns, h in sorted(self._held.items()) if h]
            self._at = (0, 0)
            self._added: Held = {}
            self._removed: Held = {}

    # -- what changes ------------------------------------------------------------------
    def saved(self, ns: str, chunk_hash: int, pinned: bool = False) -> None:
        """The worker stored a record (`pinned`: also in a pool no listing sees)."""
        with self._lock:
            self._changes.note(ns, chunk_hash, True)
            self._held.setdefault(ns, set()).add(chunk_hash)
            if pinned:
                self._pinned.setdefault(ns, set()).add(chunk_hash)
            self._queue(ns, chunk_hash, True)

    def unpin(self, ns: str, chunk_hash: int) -> None:
        """No tier had a good copy of this record in a load: a pool copy is no longer
        vouched for, so the next recheck or listing reports it only if its file is here."""
        with self._lock:
            self._pinned.get(ns, set()).discard(chunk_hash)

    def recheck(self, ns: str, hashes: Iterable[int]) -> None:
        """The scheduler side dropped these after a failed load: report again those this
        store still holds by the listing's rules (a bad one was quarantined, so its file
        is gone; a link is not a record) or a pool holds for it."""
        if not ns.endswith(self._suffixes):
            return  # another rank's directory: never looked at here
        with self._lock:
            for h in hashes:
                present = any(holds(d, ns, h) for d in self._dirs)
                pinned = h in self._pinned.get(ns, ())
                if present or pinned:
                    self._queue(ns, h, True)
                else:
                    self._held.get(ns, set()).discard(h)
                    self._pinned.get(ns, set()).discard(h)
                    self._changes.note(ns, h, False)

    def relist(self) -> None:
        """List the directories again and queue what changed since the last listing. A
        directory that cannot be read now (an errno) raises: the view stays as it was."""
        fresh, since = self._list(strict=True)
        with self._lock:
            self._merge(fresh, since)
            for ns in set(self._held) | set(fresh):
                old, new = self._held.get(ns, set()), fresh.get(ns, set())
                for h in new - old:
                    self._queue(ns, h, True)
                for h in old - new:
                    self._queue(ns, h, False)
            self._held = fresh
            self.relists += 1

    def _list(self, strict: bool) -> tuple[Held, int]:
        """What the drive holds, and where this listing began (for `_merge`)."""
        since = self._changes.begin()
        try:
            return list_records(self._dirs, self._suffixes, strict=strict), since
        except BaseException:
            self._changes.end(since, None)
            raise

    def _merge(self, fresh: Held, since: int) -> None:
        """Apply to a listing begun at `since` the saves and drops made since, and add
        the pinned records; ends that listing. Called with the lock held."""
        self._changes.end(since, fresh)
        for ns, hashes in self._pinned.items():
            fresh.setdefault(ns, set()).update(hashes)

    def _queue(self, ns: str, h: int, add: bool) -> None:
        # The latest change of a record wins: a removal cancels a queued addition.
        into, out = (self._added, self._removed) if add else (self._removed, self._added)
        out.get(ns, set()).discard(h)
        into.setdefault(ns, set()).add(h)

    # -- what goes out -----------------------------------------------------------------
    def take(self, limit: int) -> Inventory:
        """The next report: at most `limit` chunk hashes (the start listing first)."""
        report = Inventory(self.epoch)
        left = limit
        with self._lock:
            i, j = self._at
            while left > 0 and i < len(self._sync):
                ns, hashes = self._sync[i]
                part = hashes[j : j + left]
                report.added.setdefault(ns, []).extend(part)
                left -= len(part)
                j += len(part)
                if j >= len(hashes):
                    i, j = i + 1, 0
            self._at = (i, j)
            report.synced = i >= len(self._sync)
            if not report.synced:
                return report
            for src, dst in ((self._removed, report.removed), (self._added, report.added)):
                for ns in list(src):
                    if left <= 0:
                        break
                    queued = src[ns]
                    while queued and left > 0:
                        dst.setdefault(ns, []).append(queued.pop())
                        left -= 1
                    if not queued:
                        del src[ns]
        return report

    def pending(self) -> int:
        """Chunk hashes not yet handed out."""
        with self._lock:
            i, j = self._at
            sync = sum(len(h) for _, h in self._sync[i:]) - j
            changes = sum(map(len, self._added.values())) + sum(map(len, self._removed.values()))
            return sync + changes

    def resync(self) -> None:
        """Report everything again under a new epoch (the scheduler side lost track)."""
        self._restart()

    # -- the re-listing thread ---------------------------------------------------------
    def start(self, interval_s: float) -> None:
        def loop() -> None:
            while not self._stop.wait(interval_s):
                try:
                    self.relist()
                except Exception:  # noqa: BLE001 - a failed listing keeps the old view
                    pass

        self._thread = threading.Thread(target=loop, name="bsr-vllm-inventory", daemon=True)
        self._thread.start()

    def close(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=5)
