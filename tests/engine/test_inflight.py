"""Operations that stay in flight: a FIFO with no reader (or no writer) keeps an
io_uring request pending for as long as the test wants, with no test double.
(pread/pwrite refuse FIFOs with ESPIPE, so these run on the io_uring backends.)"""

from __future__ import annotations

import errno
import os
import threading
import time
from pathlib import Path

import pytest

from bsr_io import Engine

MiB = 1 << 20


@pytest.fixture
def uring_backend(backend: str) -> str:
    if backend == "pread":
        pytest.skip("pread cannot block on a FIFO (ESPIPE)")
    return backend


@pytest.fixture
def fifo(tmp_path: Path) -> Path:
    path = tmp_path / "fifo"
    os.mkfifo(path)
    return path


def _drain(path: Path, nbytes: int) -> bytes:
    fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK)
    out = bytearray()
    deadline = time.monotonic() + 10
    try:
        while len(out) < nbytes and time.monotonic() < deadline:
            try:
                out += os.read(fd, 1 << 16)
            except BlockingIOError:
                time.sleep(0.005)
    finally:
        os.close(fd)
    return bytes(out)


def test_write_in_flight_timeout_and_guard(uring_backend: str, fifo: Path) -> None:
    eng = Engine(2, MiB, backend=uring_backend)
    f = eng.open(fifo, write=True, special=True)
    assert not f.direct  # FIFOs refuse O_DIRECT: buffered fallback
    slot = eng.lease()
    slot.fill_from(b"q" * MiB)
    pending = eng.submit_write(slot, f, 0)
    # A pipe holds 64 KiB: the rest of the write waits for a reader.
    with pytest.raises(TimeoutError) as exc:
        pending.wait(timeout=0.2)
    assert exc.value.errno == errno.ETIMEDOUT
    assert not pending.done()
    with pytest.raises(ValueError, match="write in flight"):
        slot.fill_from(b"x")
    with pytest.raises(ValueError, match="write in flight"):
        slot.set_length(10)
    assert eng.live_bytes() == eng.slot_bytes
    assert _drain(fifo, MiB) == b"q" * MiB
    assert pending.wait(timeout=10) is slot
    slot.fill_from(b"x")  # allowed again once the write is done
    del slot, pending
    assert eng.live_bytes() == 0


def test_read_in_flight_owns_its_slot(uring_backend: str, fifo: Path) -> None:
    eng = Engine(1, MiB, backend=uring_backend)
    f = eng.open(fifo, write=True, special=True)
    pending = eng.submit_read(f, 0, 4096)
    time.sleep(0.05)
    assert not pending.done()
    assert eng.free_slots() == 0 and eng.live_bytes() == eng.slot_bytes
    fd = os.open(fifo, os.O_WRONLY)
    os.write(fd, b"z" * 4096)
    os.close(fd)
    assert bytes(pending.wait(timeout=10)) == b"z" * 4096
    assert eng.free_slots() == 1


def test_close_waits_for_in_flight(uring_backend: str, fifo: Path) -> None:
    eng = Engine(1, MiB, backend=uring_backend)
    f = eng.open(fifo, write=True, special=True)
    slot = eng.lease()
    slot.fill_from(b"w" * MiB)
    pending = eng.submit_write(slot, f, 0)
    closed = threading.Event()
    t = threading.Thread(target=lambda: (eng.close(), closed.set()))
    t.start()
    time.sleep(0.2)
    assert not closed.is_set()  # close is waiting for the write
    assert _drain(fifo, MiB) == b"w" * MiB
    t.join(timeout=10)
    assert closed.is_set()
    assert pending.done() and pending.wait() is slot


def test_wait_releases_the_gil(uring_backend: str, fifo: Path) -> None:
    eng = Engine(1, MiB, backend=uring_backend)
    f = eng.open(fifo, write=True, special=True)
    pending = eng.submit_read(f, 0, 4096)
    result: list[bytes] = []
    waiter = threading.Thread(target=lambda: result.append(bytes(pending.wait(timeout=10))))
    waiter.start()
    # While the other thread waits inside the engine, this one keeps running Python.
    spins, deadline = 0, time.monotonic() + 0.3
    while time.monotonic() < deadline:
        spins += 1
    assert spins > 10_000 and waiter.is_alive()
    fd = os.open(fifo, os.O_WRONLY)
    os.write(fd, b"g" * 4096)
    os.close(fd)
    waiter.join(timeout=10)
    assert result == [b"g" * 4096]


def test_a_timed_out_wait_says_where_the_op_is(uring_backend: str, fifo: Path, tmp_path: Path):
    """In the kernel (the FIFO read, since when) or queued in the engine behind the only
    request the queue holds: a stalled device and a full queue read differently."""
    data = tmp_path / "data"
    data.write_bytes(b"d" * 8192)
    eng = Engine(2, MiB, backend=uring_backend, queue_depth=1)
    f = eng.open(fifo, write=True, special=True)
    hung = eng.submit_read(f, 0, 4096)
    time.sleep(0.05)
    queued = eng.submit_read(eng.open(data), 0, 4096)
    with pytest.raises(TimeoutError, match=r"read of .*fifo sent [0-9.]+ s ago, in the kernel for"):
        hung.wait(timeout=0.2)
    with pytest.raises(TimeoutError, match=r"read of .*data sent [0-9.]+ s ago, not yet handed"):
        queued.wait(timeout=0.2)
    fd = os.open(fifo, os.O_WRONLY)
    os.write(fd, b"z" * 4096)
    os.close(fd)
    assert bytes(hung.wait(timeout=10)) == b"z" * 4096
    assert bytes(queued.wait(timeout=10)) == b"d" * 4096


def test_a_read_is_not_held_behind_a_hung_one(uring_backend: str, fifo: Path, tmp_path: Path):
    """Room in the queue, a read of a file ends while a FIFO read hangs: the I/O thread,
    waiting for a completion, is woken for it. (Before, it waited for the FIFO.)"""
    data = tmp_path / "data"
    data.write_bytes(b"d" * 8192)
    eng = Engine(2, MiB, backend=uring_backend)
    hung = eng.submit_read(eng.open(fifo, write=True, special=True), 0, 4096)
    time.sleep(0.05)
    assert bytes(eng.submit_read(eng.open(data), 0, 4096).wait(timeout=10)) == b"d" * 4096
    assert not hung.done()
    fd = os.open(fifo, os.O_WRONLY)
    os.write(fd, b"z" * 4096)
    os.close(fd)
    assert bytes(hung.wait(timeout=10)) == b"z" * 4096
