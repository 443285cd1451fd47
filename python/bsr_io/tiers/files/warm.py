"""Keeping a probe's metadata reads off the restore's critical path.

A probe stats one record file per chunk, each by its full path. With the kernel's
caches cold (evicted under memory pressure, or dropped by a cold-cache bench), every
component of that path is a directory block and an inode read from the drive, one
after the other, and each record's inode another: tens of milliseconds before the
first payload byte is asked for, on a drive that reads a 16 MiB chunk in four.

- `Pins` holds each namespace directory open (O_PATH): the kernel keeps a dentry that
  is in use, and its parents, so the path walk down to a namespace stays in memory for
  as long as the tier lives; only the record's own name and inode can be cold.
- `prefetch` stats a request's record files on a few threads before the probe walks
  them in order, so the drive serves those cold reads side by side, not one by one.
Both are only speed-ups: the probe's own stat decides, by the listing's rules.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

THREADS = 8  # stats in flight at once: enough to keep a drive's queue busy
# Below this many records, they share an inode-table block or two (16 inodes of 256
# bytes per 4 KiB block): nothing to read side by side, and threads only cost.
PREFETCH_FROM = 16
_pool: ThreadPoolExecutor | None = None
_pool_lock = threading.Lock()


def _executor() -> ThreadPoolExecutor:
    global _pool
    with _pool_lock:
        if _pool is None:
            _pool = ThreadPoolExecutor(THREADS, thread_name_prefix="bsr-stat")
        return _pool


def _stat_all(paths: Sequence[Path]) -> None:
    for p in paths:
        try:
            os.lstat(p)
        except OSError:
            pass  # a miss, or an errno the probe's own stat reports


def prefetch(paths: Sequence[Path]) -> None:
    """Stat `paths` on up to THREADS threads, each a stride of them, and wait: their
    metadata is then in the kernel's caches for the probe's walk. Fewer than
    PREFETCH_FROM: nothing, the probe's own stats read the block or two there is."""
    if len(paths) < PREFETCH_FROM:
        return
    n = min(THREADS, len(paths))
    jobs = [_executor().submit(_stat_all, paths[i::n]) for i in range(n)]
    for j in jobs:
        j.result()


class Pins:
    """Namespace directories held open (O_PATH), so their path stays in the dentry
    cache; closed with `close` (or when collected)."""

    def __init__(self) -> None:
        self._fds: dict[Path, int] = {}
        self._lock = threading.Lock()

    def pin(self, directory: Path) -> None:
        """Hold `directory` open, once; a link or a missing directory is not held."""
        if directory in self._fds:
            return
        try:
            fd = os.open(directory, os.O_PATH | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)
        except OSError:
            return
        with self._lock:
            if directory in self._fds:
                os.close(fd)
            else:
                self._fds[directory] = fd

    def __len__(self) -> int:
        return len(self._fds)

    def close(self) -> None:
        with self._lock:
            fds, self._fds = self._fds, {}
        for fd in fds.values():
            os.close(fd)

    def __del__(self) -> None:
        self.close()
