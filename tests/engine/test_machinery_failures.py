"""The engine when its own machinery fails: a ring that stops
working breaks the engine and fails every operation instead of retrying forever;
dropping an engine never holds the GIL while it waits for in-flight I/O; a window
larger than memory is refused before anything is mapped.

Real faults on a real engine: the ring's descriptor is pointed at /dev/null (so
io_uring_enter fails for real), a FIFO keeps a read in flight, the window asks for
twice the memory there is. (A panicking I/O thread and the pread pool's worker
panic need a fault double; they are tested in Rust, bsr-io-core's unit tests.)
"""

from __future__ import annotations

import errno
import os
import re
import subprocess
import threading
import time
from itertools import pairwise
from pathlib import Path

import pytest

from bsr_io import (
    BsrIoError,
    Engine,
    EngineBrokenError,
    EngineClosedError,
    KernelOwnedError,
    NoFreeSlot,
    NoMemoryError,
)
from bsr_io.cli.synthetic import fill_state, synthetic_chunk
from bsr_io.errors import ChunkError
from bsr_io.load.kvcache import PagedKVCache
from bsr_io.model.layout import preset
from bsr_io.restore import Restorer
from bsr_io.store import open_store

SLOT = 256 << 10


def _ring_fds() -> set[int]:
    """Descriptors of this process that are io_uring instances."""
    found = set()
    for name in os.listdir("/proc/self/fd"):
        try:
            if os.readlink(f"/proc/self/fd/{name}") == "anon_inode:[io_uring]":
                found.add(int(name))
        except OSError:
            pass  # closed meanwhile (listdir's own descriptor)
    return found


def _ring_engine(backend: str, window: int, slot_bytes: int) -> tuple[Engine, int]:
    """An io_uring engine and its ring's descriptor."""
    if backend == "pread":
        pytest.skip("no ring on the pread pool (its worker panic: Rust unit tests)")
    before = _ring_fds()
    engine = Engine(window, slot_bytes, backend=backend)
    (ring,) = _ring_fds() - before
    return engine, ring


def _break_ring(ring: int) -> None:
    """The fault, for real: the ring's descriptor now names /dev/null, so the I/O
    thread's next io_uring_enter fails with EOPNOTSUPP (not an io_uring)."""
    null = os.open(os.devnull, os.O_RDONLY)
    try:
        os.dup2(null, ring)
    finally:
        os.close(null)


# -- a ring that fails breaks the engine -----------------------------------------------
def test_a_failing_ring_fails_the_read_and_every_later_submit(backend: str, tmp_path: Path):
    data = os.urandom(4 * SLOT)
    (tmp_path / "data").write_bytes(data)
    engine, ring = _ring_engine(backend, 4, SLOT)
    f = engine.open(tmp_path / "data")
    # Control: the same read works before the fault.
    with engine.read(f, 0, SLOT) as slot:
        assert bytes(memoryview(slot)) == data[:SLOT]
    assert engine.broken is None
    _break_ring(ring)
    pending = engine.submit_read(f, SLOT, SLOT)
    # Before the fix the thread retried the failing enter forever: this wait timed out.
    with pytest.raises(EngineBrokenError) as exc:
        pending.wait(10)
    err = exc.value
    assert err.errno == errno.EOPNOTSUPP, err
    assert "io_uring_enter failed" in str(err)
    assert isinstance(err, BsrIoError)
    assert not isinstance(err, (EngineClosedError, NoFreeSlot, ChunkError))
    # The kernel never took that read (the enter failed): its slot is back at once.
    del pending
    assert engine.free_slots() == 4
    # Every later submit, lease or open is refused with the same cause, at once.
    for call in (lambda: engine.submit_read(f, 0, SLOT), engine.lease):
        with pytest.raises(EngineBrokenError) as later:
            call()
        assert later.value.errno == errno.EOPNOTSUPP
    with pytest.raises(EngineBrokenError):
        engine.open(tmp_path / "data")
    assert engine.broken is not None and "io_uring_enter failed" in engine.broken
    t0 = time.monotonic()
    engine.close()  # the thread stopped already: close never waits on it
    assert time.monotonic() - t0 < 5
    with pytest.raises(EngineClosedError):
        engine.lease()


LAYOUT = preset("tiny")
CHUNKS = 8


def test_a_broken_engine_is_not_a_bad_chunk(backend: str, tmp_path: Path):
    """A restore on an engine whose ring broke raises EngineBrokenError to the caller
    and quarantines nothing: the records restore on a new engine."""
    engine, ring = _ring_engine(backend, 3, LAYOUT.chunk_bytes)
    store = open_store(engine, tmp_path / "l2", layout=LAYOUT)
    tokens, _ = fill_state(store.tier("L2"), LAYOUT, CHUNKS * 16, seed=7, model="m")
    r = Restorer(store, LAYOUT, window=3, engine=engine, model="m", timeout_s=10.0)
    plan = r.probe(tokens)
    assert plan.hit_chunks == CHUNKS
    _break_ring(ring)
    with pytest.raises(EngineBrokenError):
        r.restore(plan, PagedKVCache.allocate(LAYOUT, CHUNKS * 16))
    l2 = store.tier("L2")
    assert l2.quarantined_files() == [] and l2.stats()["quarantined"] == 0
    engine.close()
    # Control: the same records, a new engine, the same restore: complete and right.
    with Engine(3, LAYOUT.chunk_bytes, backend=backend) as fresh:
        store = open_store(fresh, tmp_path / "l2", layout=LAYOUT)
        r = Restorer(store, LAYOUT, window=3, engine=fresh, model="m", timeout_s=10.0)
        dest = PagedKVCache.allocate(LAYOUT, CHUNKS * 16)
        res = r.restore(r.probe(tokens), dest)
        assert res.complete, res.reason
        for i in range(CHUNKS):
            assert dest.chunk_bytes(i) == synthetic_chunk(LAYOUT, 7, i).tobytes()


# -- dropping an engine lets the other threads run -------------------------------------
def test_dropping_an_engine_with_a_read_in_flight_releases_the_gil(backend: str, tmp_path: Path):
    """The last reference to an engine goes away on one thread while a read is in
    flight (a FIFO its writer fills 1.5 s later): the drop waits for the read, and
    another Python thread keeps running meanwhile. Holding the GIL through the join
    froze every thread for the whole wait."""
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)
    engine, _ = _ring_engine(backend, 1, 4096)  # a FIFO read stays in flight on io_uring
    f = engine.open(fifo, special=True)
    ready, started = tmp_path / "writer-ready", tmp_path / "drop-started"
    # The writer is another process: it needs no GIL of ours to end the wait. It writes
    # 1.5 s after the drop starts (not after it is ready), so a slow machine cannot
    # shorten the drop.
    script = (
        f'exec 3>"{fifo}"; touch "{ready}"; i=0; '
        f'while [ ! -e "{started}" ] && [ $i -lt 3000 ]; do sleep 0.01; i=$((i+1)); done; '
        "sleep 1.5; head -c 4096 /dev/zero >&3"
    )
    writer = subprocess.Popen(["sh", "-c", script])
    try:
        deadline = time.monotonic() + 10
        while not ready.exists():  # a writer holds the FIFO open: the read will wait
            assert time.monotonic() < deadline, "the FIFO writer did not start"
            time.sleep(0.01)
        pending = engine.submit_read(f, 0, 4096)
        owner = [engine]
        del engine
        beats: list[float] = []
        dropping = threading.Event()
        dropped = threading.Event()
        window: list[float] = []

        def heartbeat() -> None:
            while not dropped.is_set():
                if dropping.is_set():
                    beats.append(time.monotonic())
                time.sleep(0.001)

        def drop() -> None:
            dropping.set()
            t0 = time.monotonic()
            started.touch()
            owner.clear()  # the last reference: the engine is collected here
            window.extend([t0, time.monotonic()])
            dropped.set()

        beat = threading.Thread(target=heartbeat)
        beat.start()
        dropper = threading.Thread(target=drop)
        dropper.start()
        dropper.join(30)
        beat.join(30)
        assert not dropper.is_alive() and not beat.is_alive()
    finally:
        writer.wait(30)
    start, end = window
    # Control: the drop did wait for the in-flight read (else there was nothing to see).
    assert end - start > 1.0, f"the drop took {end - start:.3f}s"
    stamps = [start] + [t for t in beats if start <= t <= end] + [end]
    longest = max(b - a for a, b in pairwise(stamps))
    assert longest < 0.5 * (end - start), (
        f"no other thread ran for {longest:.3f}s of the {end - start:.3f}s drop"
    )
    slot = pending.wait(10)  # the read itself completed, with the writer's bytes
    assert bytes(memoryview(slot)) == bytes(4096)
    slot.release()


# -- a window larger than memory -------------------------------------------------------
def _meminfo(field: str) -> int:
    for line in Path("/proc/meminfo").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) * 1024
    raise AssertionError(f"{field} not in /proc/meminfo")


def _vm_peak() -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmPeak:"):
            return int(line.split()[1]) * 1024
    raise AssertionError("VmPeak not in /proc/self/status")


def test_a_window_larger_than_memory_is_refused_before_mapping():
    available = _meminfo("MemAvailable")
    slot_bytes = 1 << 30
    window = 2 * available // slot_bytes + 1  # twice what there is
    asked = window * slot_bytes
    peak = _vm_peak()
    with pytest.raises(NoMemoryError) as exc:
        Engine(window, slot_bytes)
    err = exc.value
    assert isinstance(err, BsrIoError) and err.errno == errno.ENOMEM
    text = str(err)
    assert f"needs {asked} bytes" in text, text
    seen = re.search(r"only (\d+) bytes", text)
    assert seen is not None, text
    # The figure it names is this machine's (what others took meanwhile aside).
    assert abs(int(seen.group(1)) - available) < available // 4, text
    # Refused before mapping: the address space never grew by the arena.
    assert _vm_peak() - peak < asked // 2
    # Control: a window that fits is mapped, populated and works.
    with Engine(4, 1 << 20) as engine:
        assert engine.arena_bytes == 4 << 20
        with engine.lease() as slot:
            slot.fill_from(b"x" * 4096)


# -- a break-down with a direct read in the kernel's hands --------------------------------
def test_a_break_down_never_hands_back_blocks_the_kernel_still_holds(backend, tmp_path):
    """The ring breaks while a direct read from a FIFO (a source that never answers) is
    in the kernel: its wait raises KernelOwnedError ("destination blocks still owned by
    the kernel"), and the destination stays exported for good (a bytearray with an
    export cannot be resized). Before, the waiter got EngineBrokenError and the buffer
    was handed back while the kernel could still write it. Control: a direct read that
    ended hands its buffer back."""
    if backend == "pread":
        pytest.skip("no ring on the pread pool (a stuck pread worker never ends its read)")
    before = _ring_fds()
    engine = Engine(1, 4096, backend=backend, request_bytes=4096)
    (ring,) = _ring_fds() - before
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)
    src = engine.open(fifo, special=True)
    writer = os.open(fifo, os.O_WRONLY)
    # Control: a direct read that ends gives its buffer back.
    (tmp_path / "data").write_bytes(bytes(range(256)) * 16)
    plain = engine.open(tmp_path / "data", direct=False)
    back = bytearray(4096)
    engine.submit_read_into(plain, 0, [back], [(0, 0, 0, 4096)]).wait(10)
    back.extend(b"x")  # no export left
    # Two requests: both go to the kernel, which holds them (nobody writes the FIFO).
    dest = bytearray(8192)
    direct = engine.submit_read_into(src, 0, [dest], [(0, 0, 0, 8192)])
    time.sleep(0.3)
    _break_ring(ring)
    # Wake the I/O thread: one request ends short and is pushed again, its enter fails
    # (the engine breaks down); the other request stays with the kernel.
    os.write(writer, b"\7" * 100)
    with pytest.raises(KernelOwnedError) as exc:
        direct.wait(10)
    assert isinstance(exc.value, EngineBrokenError)
    assert "destination blocks still owned by the kernel" in str(exc.value)
    assert direct.done()
    del direct
    with pytest.raises(BufferError):
        dest.extend(b"x")  # still exported: never handed back
    os.close(writer)
    engine.close()
