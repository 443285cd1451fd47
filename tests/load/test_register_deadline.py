"""Registering a destination's memory with the ring, while a request hangs.

The engine's I/O thread registers memory between its waits for completions. Before the
thread could be woken (rust/core/src/backend/wake.rs), it took commands only when a
completion came, so a request the kernel never completes (a hung device) held every
registration behind it, and the wait for one had to end at a deadline. Now a
registration is taken at once, hung request or not; the deadline stays for a thread held
in a system call, which the Rust test
`a_registration_behind_a_hung_request_times_out_and_never_happens` provokes with a
thread deaf to wakes. A run behind the hung request still ends at its read deadline: its
reads wait for the only lane, and say so ("not yet handed to the kernel"); never sent,
they are withdrawn, and the destination stays usable.

The hang is real: the engine's only lane is held by a read of a FIFO nobody writes
(tests/load/test_header_read_deadline.py holds it the same way). Engine, tier and window
are the real ones.
"""

from __future__ import annotations

import threading
import time

import pytest
from layouts import ALIGNED
from stalls import lane_held

from bsr_io import Engine
from bsr_io.cli.synthetic import fill_state, synthetic_chunk
from bsr_io.load.kvcache import PagedKVCache
from bsr_io.load.memory import registered, registrations
from bsr_io.load.window import Window
from bsr_io.tiers import SSDTier

# Blocks of 4 KiB: every run suits O_DIRECT, so a direct window reads straight into them.
LAYOUT = ALIGNED
CHUNKS = 3
DEADLINE_S = 1.0
SLACK_S = 1.5


def _holds_state(dest: PagedKVCache) -> bool:
    return all(
        dest.chunk_bytes(i) == synthetic_chunk(LAYOUT, 1, i).tobytes() for i in range(CHUNKS)
    )


def _bufs(dest: PagedKVCache) -> list:  # type: ignore[type-arg]
    return [b for b in dest._host_bytes if b is not None]


def test_an_owners_registration_is_taken_while_a_request_hangs(backend, tmp_path):
    if backend == "pread":
        pytest.skip("the pread pool registers nothing (and a FIFO cannot hold it)")
    with Engine(2, LAYOUT.chunk_bytes, backend=backend, queue_depth=1) as engine:
        if not engine.features["registered_memory"]:
            pytest.skip("this kernel's ring takes no caller memory")
        dest = PagedKVCache.allocate(LAYOUT, LAYOUT.chunk_tokens * CHUNKS)
        got: list = []  # type: ignore[type-arg]

        def register() -> None:
            try:
                got.append(dest.register(engine, timeout=DEADLINE_S))
            except TimeoutError as exc:
                got.append(exc)

        with lane_held(engine, tmp_path):
            worker = threading.Thread(target=register, daemon=True)
            worker.start()
            worker.join(DEADLINE_S + SLACK_S)
            assert not worker.is_alive(), "registering still waits (no deadline)"
            # Before wakes this was a TimeoutError: the thread waited for the FIFO.
            reg = got[0]
            assert not isinstance(reg, BaseException), reg
            assert reg.entries(engine) >= 1 and registered(engine, _bufs(dest)) is reg


def test_a_run_behind_a_hung_request_ends_at_its_deadline(backend, tmp_path):
    if backend == "pread":
        pytest.skip("the pread pool registers nothing (and a FIFO cannot hold it)")
    root = tmp_path / "l2"
    with Engine(4, LAYOUT.chunk_bytes, backend=backend, queue_depth=1) as engine:
        if not engine.features["registered_memory"]:
            pytest.skip("this kernel's ring takes no caller memory")
        l2 = SSDTier(root, None, engine, layout=LAYOUT)
        _, keys = fill_state(l2, LAYOUT, LAYOUT.chunk_tokens * CHUNKS, seed=1)
        window = Window(engine, [l2], LAYOUT.chunk_bytes, direct=True)
        dest = PagedKVCache.allocate(LAYOUT, LAYOUT.chunk_tokens * CHUNKS)  # not registered
        made = registrations(engine)
        got: list = []  # type: ignore[type-arg]

        def run() -> None:
            t0 = time.monotonic()
            report = window.run(keys, [0] * CHUNKS, dest, read_deadline=t0 + DEADLINE_S)
            got.append((report, time.monotonic() - t0))

        with lane_held(engine, tmp_path):
            worker = threading.Thread(target=run, daemon=True)
            worker.start()
            worker.join(DEADLINE_S + SLACK_S)
            assert not worker.is_alive(), "the run still waits (no deadline)"
            report, took = got[0]
            # Registered at once; the direct reads waited for the lane and, never sent,
            # were withdrawn at the deadline: no block is unusable, nothing installed,
            # nothing quarantined.
            assert registrations(engine) == made + 1
            assert registered(engine, _bufs(dest)) is not None
            assert report.timed_out and report.installed == 0, report
            assert report.direct == 0 and report.unusable == [], report
            assert "not yet handed to the kernel" in report.error, report.error
            assert "Errno" not in report.error and "timed out waiting" not in report.error
            assert l2.stats()["quarantined"] == 0
        # The lane free, a run into the same destination (usable: no read it gave up can
        # write it) registers nothing new and reads straight in.
        report = window.run(keys, [0] * CHUNKS, dest, read_deadline=time.monotonic() + 10)
        assert report.installed == CHUNKS and report.direct == CHUNKS, report
        assert registered(engine, _bufs(dest)) is not None and _holds_state(dest)


def test_a_slot_run_behind_a_hung_request_gives_its_slots_back(backend, tmp_path):
    """Its reads, queued behind the hung one, are withdrawn at the deadline: every slot
    but the hung read's is back in the ring at once (they waited for the kernel before,
    and a next run found none free)."""
    if backend == "pread":
        pytest.skip("a FIFO cannot hold the pread pool")
    with Engine(4, LAYOUT.chunk_bytes, backend=backend, queue_depth=1) as engine:
        l2 = SSDTier(tmp_path / "l2", None, engine, layout=LAYOUT)
        _, keys = fill_state(l2, LAYOUT, LAYOUT.chunk_tokens * CHUNKS, seed=1)
        window = Window(engine, [l2], LAYOUT.chunk_bytes, direct=False)
        dest = PagedKVCache.allocate(LAYOUT, LAYOUT.chunk_tokens * CHUNKS)
        with lane_held(engine, tmp_path):
            report = window.run(
                keys, [0] * CHUNKS, dest, read_deadline=time.monotonic() + DEADLINE_S
            )
            assert report.timed_out and report.installed == 0, report
            assert engine.free_slots() == engine.window - 1  # the hung read's alone
        report = window.run(keys, [0] * CHUNKS, dest, read_deadline=time.monotonic() + 10)
        assert report.installed == CHUNKS and _holds_state(dest), report
