"""Client calls with deadlines: Mooncake's error codes, and the pool of threads that runs
every call of the client so that a silent storage node costs a deadline, never a hang.

The pool is a `concurrent.futures.ThreadPoolExecutor` whose threads are daemons left out
of the executor's exit-time join, so a call stuck in Mooncake cannot hold up exit. Each
call is a `Call` over its `Future`:

- the waiter asks `Future.result(timeout)`; past the deadline it gets `CallTimeout` and
  `abandon()`s the call;
- a call still queued at its deadline is cancelled: it never runs, and the memory it
  would have touched is let go at once (a `Transfer` also reports itself ended);
- a call already running at its deadline keeps that memory until it returns; then its
  done callback, on the worker thread, lets it go. A slot in that memory goes back to
  the ring only then: never while the pool may still write it.
"""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Callable, MutableMapping
from concurrent import futures
from concurrent.futures import thread as futures_thread
from typing import Any

from bsr_io.model.keys import ChunkKey

# Mooncake's ErrorCode values (mooncake-store/include/types.h) the tier tells apart.
NO_HANDLE = -200  # no available handle: pool full, or no storage node
INVALID_PARAMS = -600  # e.g. buffer sizes that do not add up to the object's size
NOT_FOUND = -704
HAS_LEASE = -706
LEASE_EXPIRED = -707
TRANSFER_FAIL = -800
RPC_FAIL = -900
RPC_TIMEOUT = -901
_NAMES = {
    NO_HANDLE: "NO_AVAILABLE_HANDLE",
    INVALID_PARAMS: "INVALID_PARAMS",
    NOT_FOUND: "OBJECT_NOT_FOUND",
    HAS_LEASE: "OBJECT_HAS_LEASE",
    LEASE_EXPIRED: "LEASE_EXPIRED",
    TRANSFER_FAIL: "TRANSFER_FAIL",
    RPC_FAIL: "RPC_FAIL",
    RPC_TIMEOUT: "RPC_TIMEOUT",
}


def code_name(rc: int) -> str:
    return f"{_NAMES.get(rc, 'error')} ({rc})"


class CallTimeout(Exception):
    """A pool call passed its deadline (the call itself may still be running)."""


class Transfer:
    """A client call that targets registered memory; `ended` runs once, when it
    returned or when it will never run."""

    def __init__(self, fn: Callable[..., Any], ended: Callable[[], None]) -> None:
        self.fn, self._ended = fn, ended

    def __call__(self, *args: Any) -> Any:
        try:
            return self.fn(*args)
        finally:
            self._ended()

    def skip(self) -> None:
        self._ended()


class Call:
    """One client call on a worker thread. `hold` keeps the memory the call may touch
    (a slot or a view of one, a header buffer, a payload) alive until the call has
    returned; then the waiter takes it back, or, when the waiter gave up, `after(hold)`
    gives it back (header buffers, registrations) and it is let go. A slot in `hold`
    goes back to the ring only then: never while the pool may touch it."""

    __slots__ = ("fn", "future", "hold", "after", "abandoned", "_finished", "_lock")

    def __init__(
        self,
        fn: Callable[..., Any],
        future: futures.Future[Any],
        hold: tuple[Any, ...],
        after: Callable[[tuple[Any, ...]], None] | None = None,
    ) -> None:
        self.fn, self.future, self.hold, self.after = fn, future, hold, after
        self.abandoned = False
        self._finished = False
        self._lock = threading.Lock()
        future.add_done_callback(self._on_done)

    def done(self) -> bool:
        """Whether the call has returned (or will never run)."""
        return self.future.done()

    def _on_done(self, future: futures.Future[Any]) -> None:
        """The call returned, raised or was cancelled (on the worker thread, or on the
        abandoning one for a cancelled call): an abandoned call lets go of its memory."""
        if future.cancelled() and isinstance(self.fn, Transfer):
            self.fn.skip()
        with self._lock:
            self._finished = True
            orphan = self.abandoned
        if orphan:
            self._let_go()  # nobody waits: give the memory back now

    def wait(self, timeout: float | None) -> Any:
        try:
            return self.future.result(timeout)
        except futures.TimeoutError:
            raise CallTimeout from None

    def wait_by(self, deadline: float, timeout: float | None, key: ChunkKey) -> Any:
        """`wait` for a read due by `deadline`: TimeoutError (still in flight, ask again)
        when the caller's own `timeout` ends first, CallTimeout once the deadline passes."""
        left = deadline - time.monotonic()
        try:
            return self.wait(max(0.0, left if timeout is None else min(timeout, left)))
        except CallTimeout:
            if timeout is not None and timeout < left:
                raise TimeoutError(f"chunk {key.short()} still in flight") from None
            raise

    def take(self) -> tuple[Any, ...]:
        """The memory the call held (once it has returned); the waiter gives it back."""
        with self._lock:
            hold, self.hold, self.after = self.hold, (), None
        return hold

    def abandon(self) -> bool:
        """Give up waiting. A call not yet started never runs and lets go of its memory
        (True: it never touched it); a running one lets go when it returns (False)."""
        with self._lock:
            self.abandoned = True
            orphan = self._finished
        if orphan:
            self._let_go()
            return self.future.cancelled()
        # When still queued, its done callback lets go now.
        return self.future.cancel()

    def _let_go(self) -> None:
        with self._lock:
            hold, self.hold = self.hold, ()
            after, self.after = self.after, None
        if after is not None:
            try:
                after(hold)
            except Exception:  # noqa: BLE001, S110 - best effort on a worker thread
                pass
        del hold


def lower_thread_priority(how: str) -> None:
    """Lower the calling thread's CPU priority ("low": nice 19, "idle": SCHED_IDLE;
    "normal" leaves it). Linux applies both per thread. Best effort: a platform that
    refuses keeps the thread as it is."""
    tid = threading.get_native_id()
    try:
        if how == "low":
            os.setpriority(os.PRIO_PROCESS, tid, 19)
        elif how == "idle":
            os.sched_setscheduler(tid, os.SCHED_IDLE, os.sched_param(0))
    except (OSError, AttributeError):
        pass


class Workers:
    """`n` daemon threads named "<name>-<i>" running client calls, so a stuck call
    cannot hold up exit.

    `priority` (see `lower_thread_priority`) is set in each thread before its first
    call. Threads Mooncake starts itself (its transfer engine's) are started by
    `setup`, on another thread, and keep that thread's priority."""

    def __init__(self, n: int, name: str, priority: str = "normal") -> None:
        self._name, self._priority = name, priority
        self.native_ids: list[int] = []
        self._pool = futures.ThreadPoolExecutor(n, name, initializer=self._started)
        # The threads start now, from a daemon thread, so they are daemons too (a thread
        # inherits it), and each holds a call until all have started, so there are n.
        starter = threading.Thread(target=self._start, args=(n,), name=f"{name}-start")
        starter.daemon = True
        starter.start()
        starter.join()
        # concurrent.futures joins its threads at exit: not these (see the class doc).
        queues = getattr(futures_thread, "_threads_queues", None)
        if isinstance(queues, MutableMapping):
            for t in self._pool._threads:
                queues.pop(t, None)

    def _start(self, n: int) -> None:
        go = threading.Event()
        held = [self._pool.submit(go.wait) for _ in range(n)]
        go.set()
        futures.wait(held)

    def _started(self) -> None:
        me = threading.current_thread()
        me.name = f"{self._name}-{me.name.rpartition('_')[2]}"
        self.native_ids.append(threading.get_native_id())
        lower_thread_priority(self._priority)

    def submit(
        self,
        fn: Callable[..., Any],
        *args: Any,
        hold: tuple[Any, ...] = (),
        after: Callable[[tuple[Any, ...]], None] | None = None,
    ) -> Call:
        future: futures.Future[Any]
        try:
            future = self._pool.submit(fn, *args)
        except RuntimeError:  # stopped (or the interpreter is exiting): it never runs
            future = futures.Future()
        return Call(fn, future, hold, after)

    def stop(self) -> None:
        """Calls already queued still run; then the threads end."""
        self._pool.shutdown(wait=False)
