"""Pool reads straight into the destination's blocks, and the data threads' priority,
against a real pool (mooncake_master + a storage node on loopback).

The tests run in an interpreter of their own (`test_in_its_own_interpreter`): Mooncake
0.3.13's client cannot join a pool from a process whose earlier clients belonged to a
pool that has since stopped (setup hangs, holding the GIL), so this module's pools must
not share a process with test_mooncake_tier.py's."""

from __future__ import annotations

import multiprocessing as mp
import os
import signal
import subprocess
import sys
import time
import traceback

import mooncake_fixtures as mf
import numpy as np
import pytest

from bsr_io import Engine
from bsr_io.cli.synthetic import synthetic_chunk, synthetic_tokens
from bsr_io.errors import ChunkReadError, DestinationUnusable, LayoutError
from bsr_io.load.kvcache import PagedKVCache
from bsr_io.model.keys import chunk_keys
from bsr_io.model.layout import preset
from bsr_io.model.record import HEADER_BYTES
from bsr_io.restore import Restorer
from bsr_io.store import Store
from bsr_io.tiers import LowerTier
from bsr_io.tiers.base import DirectUnavailable
from bsr_io.tiers.mooncake import MooncakeConfig

mf.require_mooncake()
from bsr_io.tiers.mooncake import MooncakeTier  # noqa: E402

_loopback_ns, netns, pool, fresh_pool = mf._loopback_ns, mf.netns, mf.pool, mf.fresh_pool
INNER = "BSR_IO_TEST_INNER"
# Skipped before any fixture starts a pool, unless this is the module's own interpreter.
inner = pytest.mark.skipif(not os.environ.get(INNER), reason="runs in its own interpreter")


@pytest.mark.skipif(bool(os.environ.get(INNER)), reason="the outer run")
def test_in_its_own_interpreter():
    proc = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", __file__],
        env={**os.environ, INNER: "1"},
        capture_output=True,
        text=True,
        timeout=600,
    )
    last = proc.stdout.strip().splitlines()[-1] if proc.stdout.strip() else ""
    # Every test of the module ran there (the one skipped is this one).
    assert proc.returncode == 0 and " passed" in last and "1 skipped" in last, proc.stdout[-4000:]


LAYOUT = preset("tiny", chunk_tokens=256)
N = LAYOUT.chunk_bytes
_seeds = iter(range(5000, 10**6))


def saved(tier: MooncakeTier, chunks: int, lower: LowerTier | None = None):
    """(tokens, seed, keys) of a state written to the pool (and to `lower`)."""
    seed = next(_seeds)
    tokens = synthetic_tokens(seed, chunks * LAYOUT.chunk_tokens)
    keys = chunk_keys(tokens, LAYOUT, "mc")
    for i, k in enumerate(keys):
        assert tier.write(k, synthetic_chunk(LAYOUT, seed, i), LAYOUT) is True
        if lower is not None:
            lower.write(k, synthetic_chunk(LAYOUT, seed, i), LAYOUT)
    return tokens, seed, keys


def put_raw(tier: MooncakeTier, key, data: bytes) -> None:
    name = tier.object_name(key)
    assert tier.client.remove(name, True) == 0
    arr = np.frombuffer(bytearray(data), dtype=np.uint8)
    assert tier.client.batch_put_from([name], [arr.ctypes.data], [arr.size]) == [0]


def record_bytes(tmp_path, key, seed: int, i: int) -> bytes:
    lower = LowerTier(tmp_path / "records")
    lower.write(key, synthetic_chunk(LAYOUT, seed, i), LAYOUT)
    return lower.path_of(key).read_bytes()


@inner
@pytest.mark.parametrize("how", ["direct", "slots", "tier_off"])
def test_a_restore_reads_the_pool_straight_into_the_destination(pool, how):
    """Direct: no slot is leased (RWS 0) and every chunk lands verified; the control is the
    same restore through the slots (the destination refuses, or the tier's config does),
    which stages the window."""
    tier = MooncakeTier(pool.config(timeout_s=5.0, direct_reads=how != "tier_off"), layout=LAYOUT)
    tokens, seed, keys = saved(tier, 6)
    with Engine(2, N) as engine:
        r = Restorer(Store([tier]), LAYOUT, window=2, engine=engine, model="mc")
        dest = PagedKVCache.allocate(LAYOUT, len(tokens))
        assert dest.direct_reads
        dest.direct_reads = how != "slots"
        res = r.restore(r.probe(tokens), dest)
        assert res.complete and res.committed_chunks == 6, res.reason
        for i in range(6):
            assert dest.chunk_bytes(i) == synthetic_chunk(LAYOUT, seed, i).tobytes()
        if how == "direct":
            assert res.timings["direct_chunks"] == 6 and res.rws_peak_bytes == 0
        else:
            assert res.timings["direct_chunks"] == 0
            assert res.rws_peak_bytes == 2 * engine.slot_bytes
    assert tier.stats()["header_buffers_out"] == 0
    tier.close()


@inner
@pytest.mark.parametrize("kind", ["flipped", "foreign_key", "short", "missing"])
@pytest.mark.parametrize("fallback", [True, False])
def test_a_bad_object_read_in_place_is_caught_and_never_committed(pool, tmp_path, kind, fallback):
    """Chunk 2's object is bad (a payload bit flipped, another key's record, cut short) or
    gone after the probe. Read straight into the destination it is caught (the in-place
    hash, the header, the size, or the pool's own miss), a bad object is removed from the
    pool, and the chunk is read again from the lower tier into the same blocks; with no
    lower tier the restore commits nothing."""
    tier = MooncakeTier(pool.config(timeout_s=5.0), layout=LAYOUT)
    lower = LowerTier(tmp_path / "lower", name="L4") if fallback else None
    tokens, seed, keys = saved(tier, 4, lower)
    good = record_bytes(tmp_path, keys[2], seed, 2)
    with Engine(2, N) as engine:
        tiers = [tier] if lower is None else [tier, lower]
        r = Restorer(Store(tiers), LAYOUT, window=2, engine=engine, model="mc")
        plan = r.probe(tokens)
        assert plan.hit_chunks == 4 and plan.sources == [0] * 4
        if kind == "missing":  # another client removes it between probe and read
            assert tier.client.remove(tier.object_name(keys[2]), True) == 0
        else:
            other = record_bytes(tmp_path, keys[3], seed, 3)
            put_raw(
                tier,
                keys[2],
                {
                    "flipped": good[:-1] + bytes([good[-1] ^ 1]),
                    "foreign_key": other,
                    "short": good[: HEADER_BYTES + N // 2],
                }[kind],
            )
        dest = PagedKVCache.allocate(LAYOUT, len(tokens))
        res = r.restore(plan, dest)
        if fallback:
            assert res.complete, res.reason
            assert res.source_tiers == ["L3", "L3", lower.name, "L3"]
            assert [f["chunk"] for f in res.fallbacks] == [2]
            assert res.timings["direct_chunks"] >= 3
            for i in range(4):
                assert dest.chunk_bytes(i) == synthetic_chunk(LAYOUT, seed, i).tobytes()
        else:
            assert res.outcome == "zero" and res.committed_chunks == 0
            assert res.failed_chunks == [2]
    if kind != "missing":
        assert tier.stats()["quarantined"] == 1
    check = MooncakeTier(pool.config(), layout=LAYOUT)
    assert not check.contains(keys[2])  # a bad object is gone from the pool
    assert check.probe(keys[:2]) == 2  # the good ones stay
    check.close()
    assert tier.stats()["header_buffers_out"] == 0
    tier.close()


@inner
def test_a_direct_read_past_the_deadline_returns_then_and_a_queued_one_never_runs(fresh_pool):
    """The storage node stalls mid-read (SIGSTOP), with one data thread. The running
    direct read returns at its deadline with DestinationUnusable (the pool may still
    write its blocks: the caller must not reuse them); the one queued behind it is
    abandoned at its own deadline, never runs and leaves its blocks untouched
    (ChunkReadError: a fallback may read into them). Before, the running read was
    waited for until the transfer gave up, and the queued one ran after it. The object
    stays (a stall proves nothing against it).

    Runs in a process of its own: after a transfer that outlived its deadline, Mooncake
    0.3.13's client leaves this process unable to join another pool (a later `setup()`
    hangs), which would take down every Mooncake test after this one."""
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    cfg = fresh_pool.config(timeout_s=1.5, down_s=0, io_threads=1)
    proc = ctx.Process(target=_stalled_direct_read, args=(cfg, fresh_pool.node.pid, out))
    proc.start()
    try:
        verdict = out.get(timeout=180)
    finally:
        proc.join(30)
        if proc.is_alive():
            proc.kill()
    assert verdict == "ok", verdict


def _stalled_direct_read(cfg: MooncakeConfig, node_pid: int, out) -> None:
    try:
        _stalled_direct_read_checks(cfg, node_pid)
        out.put("ok")
    except BaseException:  # noqa: BLE001 - the parent asserts on the text
        out.put(traceback.format_exc())
    finally:
        out.close()
        out.join_thread()
        os._exit(0)  # before Mooncake's client aborts at exit (its pool is still up)


def _stalled_direct_read_checks(cfg: MooncakeConfig, node_pid: int) -> None:
    tier = MooncakeTier(cfg, layout=LAYOUT)
    tokens, seed, keys = saved(tier, 2)
    dest = np.zeros(N, dtype=np.uint8)
    queued_dest = np.full(N, 0xAB, dtype=np.uint8)
    os.kill(node_pid, signal.SIGSTOP)
    try:
        running = tier.submit_read_into(keys[0], None, [dest], [(0, 0, 0, N)])
        queued = tier.submit_read_into(keys[1], None, [queued_dest], [(0, 0, 0, N)])
        t0 = time.monotonic()
        first = _wait(running)
        took = time.monotonic() - t0
        assert isinstance(first, DestinationUnusable), repr(first)
        assert "may still be written" in str(first)
        assert 1.3 < took < 3.0, took
        second = _wait(queued)
        assert isinstance(second, ChunkReadError) and "never started" in str(second), second
        assert time.monotonic() - t0 < 3.5
        assert (queued_dest == 0xAB).all()  # never touched
    finally:
        os.kill(node_pid, signal.SIGCONT)
    assert tier.stats()["timeouts"] == 2 and tier.stats()["quarantined"] == 0
    # The running call returns once the node answers: its header buffer comes back then.
    deadline = time.monotonic() + 60
    while tier.stats()["header_buffers_out"] and time.monotonic() < deadline:
        time.sleep(0.1)
    assert tier.stats()["header_buffers_out"] == 0
    fresh = np.zeros(N, dtype=np.uint8)
    again = tier.submit_read_into(keys[0], None, [fresh], [(0, 0, 0, N)])
    again.wait()  # the object is still there, and reads whole once the node answers
    assert fresh.tobytes() == synthetic_chunk(LAYOUT, seed, 0).tobytes()
    tier.close()


def _wait(direct) -> BaseException | None:
    try:
        direct.wait()
    except BaseException as exc:  # noqa: BLE001 - handed to the test
        return exc
    return None


@inner
def test_direct_reads_off_or_runs_that_miss_the_payload(pool):
    tier = MooncakeTier(pool.config(direct_reads=False), layout=LAYOUT)
    tokens, seed, keys = saved(tier, 1)
    dest = np.zeros(N, dtype=np.uint8)
    with pytest.raises(DirectUnavailable):
        tier.submit_read_into(keys[0], None, [dest], [(0, 0, 0, N)])
    tier.close()
    tier = MooncakeTier(pool.config(), layout=LAYOUT)
    for runs in ([(0, 0, 0, N - 8)], [(0, 8, 0, N)], [(0, 0, 0, N // 2), (0, N // 2, 8, N // 2)]):
        with pytest.raises(LayoutError):
            tier.submit_read_into(keys[0], None, [dest], runs)
    with pytest.raises(LayoutError, match="writable"):
        tier.submit_read_into(keys[0], None, [np.zeros(N, np.uint8)[::-1]], [(0, 0, 0, N)])
    assert tier.stats()["header_buffers_out"] == 0
    tier.close()


def _policy(tid: int) -> int | None:
    try:
        return os.sched_getscheduler(tid)
    except OSError:
        return None  # ended meanwhile


@inner
@pytest.mark.parametrize("priority", ["idle", "normal"])
def test_only_the_data_call_threads_are_lowered(pool, priority):
    """Mooncake's client busy-polls in the thread that calls it: the tier's data threads
    run at `io_priority`, while the threads Mooncake starts for its transfers (which move
    the bytes) keep the process's priority, also after the first transfers. Control: at
    "normal" the data threads are not lowered either."""
    tier = MooncakeTier(pool.config(io_priority=priority, io_threads=2), layout=LAYOUT)
    tokens, seed, keys = saved(tier, 3)
    with Engine(2, N) as engine:
        r = Restorer(Store([tier]), LAYOUT, window=2, engine=engine, model="mc")
        dest = PagedKVCache.allocate(LAYOUT, len(tokens))
        assert r.restore(r.probe(tokens), dest).complete
        slots = Restorer(Store([tier]), LAYOUT, window=2, engine=engine, model="mc")
        dest.direct_reads = False
        assert slots.restore(slots.probe(tokens), dest).complete
    data = set(tier._data.native_ids)
    assert len(data) == 2
    idle = {int(t) for t in os.listdir("/proc/self/task") if _policy(int(t)) == os.SCHED_IDLE}
    if priority == "idle":
        assert idle == data
    else:
        assert not idle & data
    assert not idle - data  # nothing else in the process (Mooncake's threads) was lowered
    tier.close()


def test_config_keys_for_priority_and_direct_reads():
    base = {"master": "h:1", "metadata_server": "http://h:2/metadata"}
    c = MooncakeConfig.from_dict({**base, "io_priority": "idle", "direct_reads": "false"})
    assert (c.io_priority, c.direct_reads) == ("idle", False)
    assert MooncakeConfig.from_extra_config(c.to_extra_config()) == c
    d = MooncakeConfig.from_dict(base)
    assert (d.io_priority, d.direct_reads, d.io_threads) == ("low", True, 2)
    with pytest.raises(ValueError, match="io_priority"):
        MooncakeConfig.from_dict({**base, "io_priority": "high"})
    with pytest.raises(ValueError, match="direct_reads"):
        MooncakeConfig.from_dict({**base, "direct_reads": "maybe"})
