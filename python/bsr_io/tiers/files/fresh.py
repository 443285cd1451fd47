"""Keeping a view of what a store holds fresh: listings again and again, with the
process's own saves and drops in between never undone by a listing that ran meanwhile.

A listing reads a directory at one moment and is applied at a later one. A record the
process saved between the two is on the drive but missing from the listing; applied
as it is, the listing would report it removed until the next one (a miss on a record
that exists, the pattern of a shared prefix written and asked for at once). So each
listing notes where it began in `RecentChanges`, and the changes the process made
since are applied on top of what it found. Used by the vLLM worker's inventory and by
`NamespaceView`, the per-rank view an integration answers `exists` from.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Sequence
from pathlib import Path

from bsr_io.tiers.files.listing import Held, chunk_hashes

logger = logging.getLogger("bsr_io")


class RecentChanges:
    """What the process itself changed (saved, dropped) while listings were running."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._gen = 0  # changes noted so far
        self._running: list[int] = []  # where each running listing began
        self._changes: dict[tuple[str, int], tuple[int, bool]] = {}  # -> (gen, held)

    def begin(self) -> int:
        """A listing starts now; pass what this returns to `end`."""
        with self._lock:
            self._running.append(self._gen)
            return self._gen

    def note(self, ns: str, chunk_hash: int, held: bool) -> None:
        """The process saved (`held`) or dropped this record."""
        with self._lock:
            self._gen += 1
            if self._running:  # none running: no listing can undo it
                self._changes[(ns, chunk_hash)] = (self._gen, held)

    def end(self, since: int, found: Held | None) -> None:
        """Apply to `found`, what the listing begun at `since` found, every change made
        after it began (the latest of each record's), and end that listing; None: the
        listing failed, nothing to apply."""
        with self._lock:
            if found is not None:
                for (ns, h), (gen, held) in self._changes.items():
                    if gen <= since:
                        continue
                    if held:
                        found.setdefault(ns, set()).add(h)
                    else:
                        found.get(ns, set()).discard(h)
            self._running.remove(since)
            # Kept: only what a listing still running may need.
            oldest = min(self._running, default=self._gen)
            self._changes = {k: v for k, v in self._changes.items() if v[0] > oldest}


class NamespaceView:
    """The chunk hashes of one namespace's records (a rank's, of one model and layout)
    across a store's chunks directories (striped drives, the lower tier), listed by the
    store's one listing and listed again every `interval_s` by `start`'s thread: records
    written by another process (a storage-writer rank) are seen within one interval.
    `saved` and `forget` change the view at once; a record saved `pinned` (also in a
    pool no listing sees) stays across listings until `forget`. Membership is a set
    look-up: no system call on the caller's thread."""

    def __init__(self, chunks_dirs: Sequence[Path], ns: str) -> None:
        self.ns = ns
        self._dirs = list(chunks_dirs)
        self._lock = threading.Lock()
        self._changes = RecentChanges()
        self._held: set[int] = set()
        self._pinned: set[int] = set()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self.refreshes = 0
        self.refreshed_at = 0.0  # time.monotonic() of the last listing applied
        self.refresh()

    def refresh(self) -> None:
        """List again now. An errno raises and leaves the view as it was."""
        since = self._changes.begin()
        found: Held = {self.ns: set()}
        try:
            for d in self._dirs:
                found[self.ns] |= chunk_hashes(d / self.ns)
        except BaseException:
            self._changes.end(since, None)
            raise
        with self._lock:
            self._changes.end(since, found)
            self._held = found[self.ns] | self._pinned
            self.refreshes += 1
            self.refreshed_at = time.monotonic()

    def saved(self, chunk_hash: int, pinned: bool = False) -> None:
        with self._lock:
            self._held.add(chunk_hash)
            if pinned:
                self._pinned.add(chunk_hash)
            self._changes.note(self.ns, chunk_hash, True)

    def forget(self, chunk_hash: int) -> None:
        """No tier delivered it: not offered until a listing finds it again."""
        with self._lock:
            self._held.discard(chunk_hash)
            self._pinned.discard(chunk_hash)
            self._changes.note(self.ns, chunk_hash, False)

    def clear(self) -> None:
        with self._lock:
            for h in self._held:
                self._changes.note(self.ns, h, False)
            self._held, self._pinned = set(), set()

    def hashes(self) -> frozenset[int]:
        with self._lock:
            return frozenset(self._held)

    def __contains__(self, chunk_hash: object) -> bool:
        with self._lock:
            return chunk_hash in self._held

    def __len__(self) -> int:
        with self._lock:
            return len(self._held)

    def leading(self, hashes: Sequence[int]) -> int:
        """How many of `hashes`, from the first, the view holds."""
        with self._lock:
            for i, h in enumerate(hashes):
                if h not in self._held:
                    return i
            return len(hashes)

    def start(self, interval_s: float) -> None:
        """List again every `interval_s` on a thread of its own (until `close`)."""
        if not interval_s > 0:
            raise ValueError(f"interval_s must be a positive number of seconds, not {interval_s}")

        def loop() -> None:
            while not self._stop.wait(interval_s):
                try:
                    self.refresh()
                except OSError as exc:  # the view stays as it was; tried again next time
                    logger.warning("bsr-io: cannot list %s (%s); view kept", self.ns, exc)

        self._thread = threading.Thread(target=loop, name="bsr-namespace-view", daemon=True)
        self._thread.start()

    def close(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=5)
