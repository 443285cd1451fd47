"""The one load and save path (`load_records`, `save_records`) every integration uses:
records of several sizes in one window, deadlines on hung reads, every bad record of a
failed load withdrawn, and asynchronous installs waited for before a slot is reused."""

from __future__ import annotations

import threading
import time

import numpy as np
import pytest
import torch

from bsr_io import Engine
from bsr_io.faults import Fault, FaultPlan
from bsr_io.load.kvcache import HostBuffers
from bsr_io.load.records import LoadOptions, load_records
from bsr_io.model.keys import ChunkKey
from bsr_io.model.layout import AllocatorGroup, KVLayout
from bsr_io.save.records import save_records
from bsr_io.tiers.ssd import SSDTier

BIG = KVLayout("big", (AllocatorGroup("a", torch.uint8, (1024,), 16),), 64)
SMALL = KVLayout("small", (AllocatorGroup("b", torch.uint8, (256,), 16),), 64)


def _records(n: int, seed: int = 0):
    """n keys alternating the two layouts (one request's groups), and their bytes."""
    rng = np.random.default_rng(seed)
    layouts = [BIG if i % 2 == 0 else SMALL for i in range(n)]
    keys = [ChunkKey("m", 1, 0, lay.fingerprint(), 1000 + i) for i, lay in enumerate(layouts)]
    data = [rng.integers(0, 256, lay.chunk_bytes, dtype=np.uint8) for lay in layouts]
    return keys, layouts, data


@pytest.fixture
def stored(tmp_path):
    engine = Engine(4, BIG.chunk_bytes)
    tier = SSDTier(tmp_path / "l2", None, engine)
    keys, layouts, data = _records(10)
    written = save_records(
        engine, tier, keys, layouts, HostBuffers(data), deadline=time.monotonic() + 30
    )
    assert written == 10
    yield engine, tier, keys, layouts, data
    tier.close()
    engine.close()


def _empty(layouts):
    return [np.zeros(lay.chunk_bytes, np.uint8) for lay in layouts]


def _load_all(engine, tier, keys, layouts):
    """Every record loaded into new host buffers: (the result, the buffers)."""
    out = _empty(layouts)
    sizes = [lay.chunk_bytes for lay in layouts]
    opts = LoadOptions(deadline=time.monotonic() + 30, sizes=sizes)
    return load_records(engine, [tier], keys, HostBuffers(out), opts), out


def test_records_of_two_sizes_load_in_one_window(stored):
    engine, tier, keys, layouts, data = stored
    res, out = _load_all(engine, tier, keys, layouts)
    assert res.complete, res.reason
    for got, want in zip(out, data, strict=True):
        assert np.array_equal(got, want)
    assert res.bytes_read == {"L2": sum(lay.chunk_bytes for lay in layouts)}
    # Saving again writes nothing: every record is held already.
    again = save_records(
        engine, tier, keys, layouts, HostBuffers(data), deadline=time.monotonic() + 30
    )
    assert again == 0


def test_a_missing_record_is_zero_before_any_read(stored):
    engine, tier, keys, layouts, data = stored
    tier.remove(keys[5])
    out = _empty(layouts)
    res = load_records(
        engine,
        [tier],
        keys,
        HostBuffers(out),
        LoadOptions(deadline=time.monotonic() + 30, sizes=[lay.chunk_bytes for lay in layouts]),
    )
    assert not res.complete and "record 5 of 10" in res.reason
    assert res.bytes_read == {}
    assert all(not b.any() for b in out)


def test_a_hung_read_ends_the_load_at_its_deadline_and_invalidates_nothing(stored):
    engine, tier, keys, layouts, data = stored
    # Fault double: chunk 3's read does not complete for 3 s (a stalled device).
    hung = FaultPlan([Fault("hang", chunks=[3], delay_s=3.0, times=1)]).wrap(tier, keys=keys)
    sizes = [lay.chunk_bytes for lay in layouts]
    t0 = time.monotonic()
    res = load_records(
        engine,
        [hung],
        keys,
        HostBuffers(_empty(layouts)),
        LoadOptions(deadline=t0 + 0.5, sizes=sizes),
    )
    took = time.monotonic() - t0
    assert not res.complete and res.timed_out, res.reason
    assert "chunk 3" in res.reason
    assert took < 2.5, f"the load waited {took:.2f} s for a read past its 0.5 s deadline"
    assert tier.stats()["quarantined"] == 0
    # Control: once the stall is over, the same records load complete on the same engine.
    time.sleep(max(0.0, 3.2 - (time.monotonic() - t0)))
    out = _empty(layouts)
    res = load_records(
        engine,
        [hung],
        keys,
        HostBuffers(out),
        LoadOptions(deadline=time.monotonic() + 30, sizes=sizes),
    )
    assert res.complete, res.reason
    assert all(np.array_equal(g, w) for g, w in zip(out, data, strict=True))


@pytest.mark.parametrize("keep_going", [False, True])
def test_a_failed_load_can_withdraw_every_bad_record(stored, keep_going):
    engine, tier, keys, layouts, data = stored
    bad = [2, 5, 8]
    corrupt = FaultPlan([Fault("corrupt", chunks=bad, times=3)]).wrap(tier, keys=keys)
    res = load_records(
        engine,
        [corrupt],
        keys,
        HostBuffers(_empty(layouts)),
        LoadOptions(
            deadline=time.monotonic() + 30,
            sizes=[lay.chunk_bytes for lay in layouts],
            keep_going=keep_going,
        ),
    )
    assert not res.complete
    # Without keep_going the load stops at the first bad record (the control).
    assert res.failed_chunks == (bad if keep_going else bad[:1])
    assert tier.stats()["quarantined"] == (3 if keep_going else 1)


class _LateCopies(HostBuffers):
    """A destination whose installs finish later (as a CUDA copy does): each returns a
    fence, and the test records when each fence was waited for."""

    def __init__(self, bufs, engine) -> None:
        super().__init__(bufs)
        self.engine = engine
        self.waited: list[int] = []
        self.live_at_wait: list[int] = []

    host_runs = None  # type: ignore[assignment]  # no fused path: installs return fences

    def install(self, chunk_index, payload):
        super().install(chunk_index, payload)
        dest = self

        class Fence:
            def synchronize(self) -> None:
                dest.waited.append(chunk_index)
                dest.live_at_wait.append(dest.engine.live_bytes())

        return Fence()


def test_asynchronous_installs_are_waited_for_before_their_slots_return(stored):
    engine, tier, keys, layouts, data = stored
    # Chunk 6 fails in every tier, so the run ends with installs still held.
    failing = FaultPlan([Fault("error", chunks=[6])]).wrap(tier, keys=keys)
    dest = _LateCopies(_empty(layouts), engine)
    res = load_records(
        engine,
        [failing],
        keys,
        dest,
        LoadOptions(deadline=time.monotonic() + 30, sizes=[lay.chunk_bytes for lay in layouts]),
    )
    assert not res.complete and res.failed_chunks == [6]
    # Every install issued (chunks 0-5) had its fence waited for, each while its slot was
    # still out of the ring, and the ring is whole again after the load.
    assert sorted(dest.waited) == [0, 1, 2, 3, 4, 5]
    assert all(live > 0 for live in dest.live_at_wait)
    assert engine.live_bytes() == 0


def test_staged_records_are_written_and_every_slot_returns(tmp_path):
    from bsr_io.save.records import write_staged

    engine = Engine(4, BIG.chunk_bytes)
    tier = SSDTier(tmp_path / "l2", None, engine)
    keys, layouts, data = _records(4, seed=3)
    slots = []
    for d in data:
        s = engine.lease()
        s.fill_from(d)
        s.set_length(d.nbytes)
        slots.append(s)
    # Record 1 is handed with the wrong layout: it fails alone, and its slot returns too.
    layouts[1] = BIG
    errors: dict[int, BaseException | None] = {}
    written = write_staged(
        tier, keys, layouts, slots, width=4, on_done=lambda i, e: errors.__setitem__(i, e)
    )
    del slots
    assert written == 3
    assert [i for i, e in errors.items() if e is not None] == [1]
    assert engine.live_bytes() == 0
    for i in (0, 2, 3):
        slot = tier.read_into(keys[i], engine)
        assert bytes(memoryview(slot)[: data[i].nbytes]) == data[i].tobytes()
        slot.release()
    assert not tier.contains(keys[1])
    tier.close()
    engine.close()


def test_a_paced_save_copies_a_record_only_once_its_pace_returns(tmp_path):
    """`pace` holds each record back until it returns (vLLM's CPU worker: until a
    forward runs); the control is the same save with nothing to wait for."""
    engine = Engine(4, BIG.chunk_bytes)
    tier = SSDTier(tmp_path / "l2", None, engine)
    keys, layouts, data = _records(6)
    go = threading.Event()
    paced = []

    def pace():
        paced.append(time.monotonic())
        go.wait(30)

    try:
        save = threading.Thread(
            target=save_records,
            args=(engine, tier, keys, layouts, HostBuffers(data)),
            kwargs={"deadline": time.monotonic() + 30, "width": 2, "pace": pace},
        )
        save.start()
        time.sleep(0.3)
        assert tier.probe(keys) == 0 and len(paced) == 2  # both writers wait; none wrote
        go.set()
        save.join(30)
        assert len(paced) == 6 and tier.probe(keys) == 6
        res, out = _load_all(engine, tier, keys, layouts)
        assert res.complete, res.reason
        assert all(np.array_equal(a, b) for a, b in zip(out, data, strict=True))
    finally:
        tier.close()
        engine.close()


def test_a_save_says_where_its_time_went(tmp_path, monkeypatch):
    """`phases` puts a slow step's time on that step: a host's pace, or the tier's write
    (made slow by a test double that sleeps in it), not on the others."""
    engine = Engine(4, BIG.chunk_bytes)
    tier = SSDTier(tmp_path / "l2", None, engine)
    keys, layouts, data = _records(6)
    step_s = 0.1

    def save(part: slice, pace=None) -> dict[str, float]:
        phases: dict[str, float] = {}
        n = save_records(
            engine, tier, keys[part], layouts[part], HostBuffers(data[part]),
            deadline=time.monotonic() + 30, width=2, pace=pace, phases=phases,
        )  # fmt: skip
        assert n == 3
        return phases

    paced = save(slice(0, 3), pace=lambda: time.sleep(step_s))
    assert paced["pace"] >= 3 * step_s and paced["write"] < 3 * step_s, paced
    assert set(paced) == {"pace", "slot", "copy", "write"}
    real_write = tier.write

    def slow_write(*args, **kw):  # test double: a drive that takes step_s per record
        time.sleep(step_s)
        return real_write(*args, **kw)

    monkeypatch.setattr(tier, "write", slow_write)
    slow = save(slice(3, 6))
    assert slow["write"] >= 3 * step_s and "pace" not in slow, slow
    assert slow["slot"] + slow["copy"] < 3 * step_s, slow
    tier.close()
    engine.close()


def test_saves_on_kept_writers_start_no_thread_and_report_each_failure(tmp_path):
    """`writers`: a host's kept threads write every record of every save (vLLM's CPU
    worker: no thread started and joined per save beside the forward); a failed record
    is reported alone, or raised without `on_done`. The control is the same saves
    without `writers`, which start threads of their own."""
    from concurrent.futures import ThreadPoolExecutor

    engine = Engine(4, BIG.chunk_bytes)
    tier = SSDTier(tmp_path / "l2", None, engine)
    keys, layouts, data = _records(12, seed=7)
    ran_on: set[int] = set()
    real_write = tier.write

    def write(*args, **kw):
        ran_on.add(threading.get_ident())
        return real_write(*args, **kw)

    tier.write = write  # type: ignore[method-assign]
    pool = ThreadPoolExecutor(2)
    both = threading.Barrier(2)  # warm: both threads started, and their idents known

    def ident(_: int) -> int:
        both.wait(10)
        return threading.get_ident()

    pooled = set(pool.map(ident, range(2)))
    try:
        started = threading.active_count()
        for part in (slice(0, 4), slice(4, 8)):
            n = save_records(
                engine, tier, keys[part], layouts[part], HostBuffers(data[part]),
                deadline=time.monotonic() + 30, writers=pool,
            )  # fmt: skip
            assert n == 4
        assert ran_on <= pooled and threading.active_count() == started
        # One record handed with the wrong layout fails alone; the others are stored.
        bad = [*layouts[8:12]]
        bad[1] = BIG if bad[1] is SMALL else SMALL
        errors: dict[int, BaseException | None] = {}
        n = save_records(
            engine, tier, keys[8:12], bad, HostBuffers(data[8:12]),
            deadline=time.monotonic() + 30, writers=pool,
            on_done=lambda i, e: errors.__setitem__(i, e),
        )  # fmt: skip
        assert n == 3 and [i for i, e in errors.items() if e is not None] == [1]
        with pytest.raises(Exception, match="layout"):
            save_records(
                engine, tier, keys[9:10], bad[1:2], HostBuffers(data[9:10]),
                deadline=time.monotonic() + 30, writers=pool,
            )  # fmt: skip
        # The control: without `writers` a save runs on threads it starts.
        ran_on.clear()
        tier.write = write  # type: ignore[method-assign]
        save_records(
            engine, tier, keys[:2], layouts[:2], HostBuffers(data[:2]),
            deadline=time.monotonic() + 30, width=2, skip_existing=False,
        )  # fmt: skip
        assert ran_on and not ran_on & pooled
        res, out = _load_all(engine, tier, keys[:9] + keys[10:], layouts[:9] + layouts[10:])
        assert res.complete, res.reason
        assert engine.live_bytes() == 0
    finally:
        pool.shutdown()
        tier.close()
        engine.close()
