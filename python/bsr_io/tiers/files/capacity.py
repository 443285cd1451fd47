"""A file tier's capacity: the records it holds plus the writes in progress stay within
it; room is made by evicting the oldest records (demoted first where a lower tier
takes them)."""

from __future__ import annotations

import threading
from collections.abc import Callable

from bsr_io.tiers.files.index import Held, RecordIndex, Slot


class Room:
    def __init__(self, lock: threading.RLock, capacity: int | None, index: RecordIndex) -> None:
        self.capacity = capacity
        self._index = index
        self._cond = threading.Condition(lock)
        self._reserved = 0  # bytes of writes in progress, so concurrent writers fit too

    def reserve(self, nbytes: int, evict: Callable[[Slot, Held], None]) -> None:
        """Evict until `nbytes` more fit, and reserve them (the caller must `release`).
        `evict(slot, entry)` disposes of each record taken out of the index, outside the
        lock; a record not checked yet counts (and frees) its file's size."""
        while True:
            with self._cond:
                cap = self.capacity
                while (
                    cap is not None
                    and self._index.used + self._reserved + nbytes > cap
                    and not len(self._index)
                    and self._reserved
                ):
                    self._cond.wait()  # only writes in flight fill it: evict them once done
                if cap is None or self._index.used + self._reserved + nbytes <= cap:
                    self._reserved += nbytes
                    return
                oldest = self._index.pop_oldest()
                if oldest is None:  # nothing left to evict: a record fits on its own
                    self._reserved += nbytes
                    return
            evict(*oldest)

    def release(self, nbytes: int) -> None:
        with self._cond:
            self._reserved -= nbytes
            self._cond.notify_all()
