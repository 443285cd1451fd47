"""Hash threads: direct reads that have landed, hashed beside the caller's own hash.

A drive given a small state's reads all at once shares its bandwidth among them: they
all land together at the end, and hashed one after another on the caller's thread, every
chunk's hash would come after the last read (at 64 MiB, four 16 MiB hashes: a quarter of
the restore). The window hands reads that have landed ahead of the one it installs to
these threads, so the hashes run side by side. The threads are kept for the process
(none started per restore), at most `MAX_THREADS`, one fewer than the CPUs the first
caller may run on (they inherit its placement): none on a single CPU.
"""

from __future__ import annotations

import os
import threading
from concurrent.futures import Future, ThreadPoolExecutor

from bsr_io._core import xxh3_runs
from bsr_io.load.install import HostRuns

MAX_THREADS = 3

_lock = threading.Lock()
_pool: ThreadPoolExecutor | None = None
_width = -1  # threads in the pool; -1: not decided yet


def width() -> int:
    """How many hashes may run on the hash threads at once (0: none, hash in place)."""
    global _pool, _width
    if _width < 0:
        with _lock:
            if _width < 0:
                n = min(MAX_THREADS, len(os.sched_getaffinity(0)) - 1)
                if n > 0:
                    _pool = ThreadPoolExecutor(n, "bsr-hash")
                _width = max(0, n)
    return _width


def hash_later(where: HostRuns) -> Future[int] | None:
    """xxh3 of `where`'s bytes, on a hash thread; None when there are none. The bytes
    must be final (the read's wait returned) and stay readable until the future is done."""
    if width() == 0 or _pool is None:
        return None
    try:
        return _pool.submit(xxh3_runs, *where)
    except RuntimeError:
        return None  # the interpreter is shutting down: hashed in place
