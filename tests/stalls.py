"""Stalls for the deadline tests: a real wait that never ends until the test lets it.

- `lane_held`: the engine's only I/O lane busy with a read of a FIFO nobody writes (a
  real kernel wait, not a double), for the waits that queue behind it.
- `stalled`: a fault double of `os.<name>` that blocks the calls a predicate picks (a
  tier's temp files, its record files) until the block ends.
- `ends_within`: runs the work under test on a thread and fails the test when it is
  still blocked past the limit: a wait with no deadline.
"""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest

from bsr_io import Engine


@contextmanager
def lane_held(engine: Engine, tmp_path: Path) -> Iterator[None]:
    """The engine's only lane busy with a read of a FIFO until the block ends."""
    fifo = tmp_path / "stall"
    os.mkfifo(fifo)
    src = engine.open(fifo, special=True)
    writer = os.open(fifo, os.O_RDWR)
    stuck = engine.submit_read(src, 0, 4096)
    time.sleep(0.2)
    try:
        yield
    finally:
        os.write(writer, bytes(4096))
        stuck.wait(10).release()
        os.close(writer)


def fd_path(fd: int) -> str:
    """What descriptor `fd` is open on ("" if nothing)."""
    try:
        return os.readlink(f"/proc/self/fd/{fd}")
    except OSError:
        return ""


class Stall:
    """Fault double of `os.<name>`: a call whose first argument `ours` picks blocks until
    released (later calls pass)."""

    def __init__(self, name: str, ours: Callable[[Any], bool]) -> None:
        self.real = getattr(os, name)
        self.ours = ours
        self.released = threading.Event()
        self.hits = 0

    def __call__(self, first: Any, *args: Any, **kw: Any) -> Any:
        if not self.released.is_set() and self.ours(first):
            self.hits += 1
            self.released.wait(60)
        return self.real(first, *args, **kw)


@contextmanager
def stalled(
    monkeypatch: pytest.MonkeyPatch, name: str, ours: Callable[[Any], bool]
) -> Iterator[Stall]:
    stall = Stall(name, ours)
    monkeypatch.setattr(os, name, stall)
    try:
        yield stall
    finally:
        stall.released.set()
        time.sleep(0.3)  # the stalled call returns on its own thread
        monkeypatch.undo()


def ends_within(work: Callable[[], Any], seconds: float, what: str) -> tuple[float, Any]:
    """Run `work` on a thread: (seconds it took, what it returned or raised). Fails the
    test when it is still blocked after `seconds` (a wait with no limit)."""
    got: list[Any] = []

    def body() -> None:
        try:
            got.append(work())
        except BaseException as exc:  # noqa: BLE001 - checked by the caller
            got.append(exc)

    t0 = time.monotonic()
    worker = threading.Thread(target=body, daemon=True)
    worker.start()
    worker.join(seconds)
    took = time.monotonic() - t0
    assert not worker.is_alive(), f"the {what} still waits {took:.1f} s in (no deadline)"
    return took, got[0]
