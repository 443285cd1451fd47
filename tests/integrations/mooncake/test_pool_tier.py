"""The Mooncake tier against a real pool (mooncake_master + a storage node on loopback):
the Tier contract, verification of what the pool hands back, and failure mapping."""

from __future__ import annotations

import os
import signal
import socket
import threading
import time

import mooncake_fixtures as mf
import numpy as np
import psutil
import pytest
import torch

from bsr_io import Engine, NoFreeSlot
from bsr_io.cli.synthetic import synthetic_chunk, synthetic_tokens
from bsr_io.engine import give_back
from bsr_io.errors import (
    CapacityError,
    ChunkCorrupt,
    ChunkMissing,
    ChunkReadError,
    ChunkWriteError,
    LayoutError,
    TierDown,
)
from bsr_io.load.kvcache import PagedKVCache
from bsr_io.model.keys import chunk_keys
from bsr_io.model.layout import preset
from bsr_io.model.record import HEADER_BYTES
from bsr_io.restore import Restorer
from bsr_io.store import Store
from bsr_io.tiers import LowerTier
from bsr_io.tiers.mooncake import MooncakeConfig

mf.require_mooncake()
from bsr_io.tiers.mooncake import MooncakeTier  # noqa: E402

_loopback_ns, netns, pool, fresh_pool = mf._loopback_ns, mf.netns, mf.pool, mf.fresh_pool

LAYOUT = preset("tiny", chunk_tokens=256)
N = LAYOUT.chunk_bytes
_seeds = iter(range(1000, 10**6))


def state(chunks: int = 4, model: str = "mc"):
    """Fresh keys (a new seed each call, so tests sharing the pool never collide)."""
    seed = next(_seeds)
    keys = chunk_keys(synthetic_tokens(seed, chunks * LAYOUT.chunk_tokens), LAYOUT, model)
    return seed, keys


def fill(tier, chunks: int = 4):
    seed, keys = state(chunks)
    for i, k in enumerate(keys):
        assert tier.write(k, synthetic_chunk(LAYOUT, seed, i), LAYOUT) is True
    return seed, keys


def raw_object(tier: MooncakeTier, key, size: int) -> bytes:
    buf = np.zeros(size, dtype=np.uint8)
    got = tier.client.batch_get_into([tier.object_name(key)], [buf.ctypes.data], [size])
    assert got == [size]
    return buf.tobytes()


def put_raw(tier: MooncakeTier, key, data: bytes) -> None:
    arr = np.frombuffer(bytearray(data), dtype=np.uint8)
    rc = tier.client.batch_put_from([tier.object_name(key)], [arr.ctypes.data], [arr.size])
    assert rc == [0]


@pytest.fixture
def tier(pool):
    t = MooncakeTier(pool.config(timeout_s=5.0), layout=LAYOUT)
    yield t
    t.close()


@pytest.fixture
def engine():
    with Engine(2, N) as e:
        yield e


def test_everything_stays_on_loopback(pool, tier, netns):
    """Every socket of the pool and of this process is on 127.0.0.1 (in the loopback-only
    namespace when root, where lo is the only interface)."""
    if netns:
        assert [name for _, name in socket.if_nameindex()] == ["lo"]
    seed, keys = fill(tier, 1)
    for pid in [*pool.pids(), os.getpid()]:
        for c in psutil.Process(pid).net_connections(kind="inet"):
            if c.raddr:
                assert c.raddr.ip in ("127.0.0.1", "::1", "::ffff:127.0.0.1"), (pid, c)
            assert c.laddr.ip in ("127.0.0.1", "0.0.0.0", "::", "::1", "::ffff:127.0.0.1"), c


def test_write_read_roundtrip_and_write_once(tier, engine):
    seed, keys = fill(tier, 3)
    for i, k in enumerate(keys):
        slot = tier.read_into(k, engine)
        assert len(slot) == N
        assert bytes(memoryview(slot)) == synthetic_chunk(LAYOUT, seed, i).tobytes()
        del slot
    # Write-once: a second write of a held key is "already held" and changes nothing.
    assert tier.write(keys[0], synthetic_chunk(LAYOUT, seed + 1, 0), LAYOUT) is False
    slot = tier.read_into(keys[0], engine)
    assert bytes(memoryview(slot)) == synthetic_chunk(LAYOUT, seed, 0).tobytes()
    del slot
    assert tier.keys()[-1] == keys[0]  # LRU: the key read last is newest
    st = tier.stats()
    assert st["writes"] >= 3 and st["reads"] >= 4 and st["bytes_read"] >= 4 * N


def test_object_holds_the_record_file_bytes(tier, tmp_path):
    seed, keys = fill(tier, 1)
    lower = LowerTier(tmp_path / "l3")
    lower.write(keys[0], synthetic_chunk(LAYOUT, seed, 0), LAYOUT)
    assert raw_object(tier, keys[0], HEADER_BYTES + N) == lower.path_of(keys[0]).read_bytes()


def test_reads_land_in_engine_slots_within_the_window(tier):
    seed, keys = fill(tier, 4)
    with Engine(2, N) as eng:
        eng.reset_peak()
        pending = [tier.submit_read(k, eng) for k in keys[:2]]
        # Both slots are owned by reads in flight: the window is the bound.
        with pytest.raises(NoFreeSlot):
            tier.submit_read(keys[2], eng)
        slots = [p.wait() for p in pending]
        lo, hi = eng.arena_address, eng.arena_address + eng.arena_bytes
        assert all(lo <= s.address < hi for s in slots)
        assert eng.peak_bytes() == 2 * eng.slot_bytes
        del slots, pending


def test_probe_is_one_existence_check_and_reads_nothing(tier):
    seed, keys = fill(tier, 6)
    gone = keys[4]
    tier.remove(gone)
    before = tier.stats()
    assert tier.probe(keys) == 4
    after = tier.stats()
    assert after["exist_calls"] - before["exist_calls"] == 1
    assert after["bytes_read"] == before["bytes_read"]
    assert tier.contains(keys[0]) and not tier.contains(gone)
    assert tier.probe([]) == 0


def test_restorer_discovery_asks_the_pool_once(pool, engine):
    """Discovery's per-chunk questions are answered from one batched check; the control
    (no snapshot) asks once per chunk, so the count can tell them apart."""
    seed, keys = state(6)
    calls = {}
    for snapshot_s in (1.0, 0.0):
        t = MooncakeTier(pool.config(snapshot_s=snapshot_s), layout=LAYOUT)
        r = Restorer(Store([t]), LAYOUT, window=2, engine=engine, model="mc")
        tokens = synthetic_tokens(seed, 6 * LAYOUT.chunk_tokens)
        for i, k in enumerate(keys):
            t.write(k, synthetic_chunk(LAYOUT, seed, i), LAYOUT)
        before = t.stats()["exist_calls"]
        plan = r.probe(tokens)
        calls[snapshot_s] = t.stats()["exist_calls"] - before
        assert plan.hit_chunks == 6
        assert t.stats()["bytes_read"] == 0
        t.close()
    assert calls[1.0] == 1
    assert calls[0.0] >= 6


def test_restore_from_the_pool_alone(tier, engine):
    seed, keys = state(5)
    tokens = synthetic_tokens(seed, 5 * LAYOUT.chunk_tokens)
    src = PagedKVCache.allocate(LAYOUT, len(tokens))
    for i in range(len(keys)):
        src.install(i, torch.from_numpy(synthetic_chunk(LAYOUT, seed, i)))
    r = Restorer(Store([tier]), LAYOUT, window=2, engine=engine, model="mc")
    assert r.save(tokens, src) == 5
    dest = PagedKVCache.allocate(LAYOUT, len(tokens))
    dest.direct_reads = False  # through the slots (test_mooncake_direct.py reads in place)
    res = r.restore(r.probe(tokens), dest)
    assert res.outcome == "complete" and res.committed_chunks == 5
    assert res.rws_peak_bytes == 2 * engine.slot_bytes
    for i in range(5):
        assert dest.chunk_bytes(i) == synthetic_chunk(LAYOUT, seed, i).tobytes()


def test_missing_remove_and_invalidate(tier, engine, pool):
    seed, keys = fill(tier, 3)
    with pytest.raises(ChunkMissing):
        tier.read_into(state(1)[1][0], engine)
    assert tier.remove(keys[0]) is True
    assert tier.remove(keys[0]) is False
    assert not tier.contains(keys[0])
    with pytest.raises(ChunkMissing):
        tier.read_into(keys[0], engine)
    tier.invalidate(keys[1], "test")
    assert not tier.contains(keys[1]) and tier.probe(keys[1:]) == 0
    # Removed from the pool too: another client does not see it either.
    other = MooncakeTier(pool.config(), layout=LAYOUT)
    assert not other.contains(keys[1]) and other.contains(keys[2])
    other.close()
    # A fresh write brings it back.
    assert tier.write(keys[1], synthetic_chunk(LAYOUT, seed, 1), LAYOUT) is True
    assert tier.contains(keys[1])


@pytest.mark.parametrize("kind", ["foreign_key", "bad_header", "short", "long", "flipped"])
def test_bad_objects_are_detected_and_withdrawn(tier, engine, pool, kind, tmp_path):
    seed, keys = state(2)
    lower = LowerTier(tmp_path)
    lower.write(keys[1], synthetic_chunk(LAYOUT, seed, 1), LAYOUT)
    other_record = lower.path_of(keys[1]).read_bytes()
    lower.write(keys[0], synthetic_chunk(LAYOUT, seed, 0), LAYOUT)
    good = lower.path_of(keys[0]).read_bytes()
    data = {
        "foreign_key": other_record,  # a valid record of another key under this name
        "bad_header": bytes(HEADER_BYTES) + good[HEADER_BYTES:],
        "short": good[: HEADER_BYTES + N // 2],
        "long": good + bytes(4096),
        "flipped": good[:-1] + bytes([good[-1] ^ 1]),
    }[kind]
    put_raw(tier, keys[0], data)
    assert tier.contains(keys[0])
    free = engine.free_slots()
    with pytest.raises(ChunkCorrupt):
        tier.read_into(keys[0], engine)
    assert engine.free_slots() == free  # the slot went back to the ring
    assert not tier.contains(keys[0])
    other = MooncakeTier(pool.config(), layout=LAYOUT)
    assert not other.contains(keys[0])  # removed from the pool
    other.close()


def test_an_object_of_an_older_record_format_is_a_miss_and_stays(tier, engine, pool, tmp_path):
    from bsr_io.model.record import _header_sum

    seed, keys = state(1)
    lower = LowerTier(tmp_path)
    lower.write(keys[0], synthetic_chunk(LAYOUT, seed, 0), LAYOUT)
    body = bytearray(lower.path_of(keys[0]).read_bytes())
    body[8:10] = (1).to_bytes(2, "little")  # an intact header of format version 1
    body[HEADER_BYTES - 8 : HEADER_BYTES] = _header_sum(body[:HEADER_BYTES])
    put_raw(tier, keys[0], bytes(body))
    with pytest.raises(ChunkMissing, match="older record format"):
        tier.read_into(keys[0], engine)
    assert tier.stats()["quarantined"] == 0
    other = MooncakeTier(pool.config(), layout=LAYOUT)
    assert other.contains(keys[0])  # left in the pool
    other.close()


def test_bad_objects_without_a_known_layout(pool, engine):
    """A tier that never saw the layout learns the size from the pool, and still refuses
    a foreign object."""
    writer = MooncakeTier(pool.config(), layout=LAYOUT)
    seed, keys = fill(writer, 2)
    reader = MooncakeTier(pool.config())
    slot = reader.read_into(keys[0], engine)
    assert bytes(memoryview(slot)) == synthetic_chunk(LAYOUT, seed, 0).tobytes()
    del slot
    writer.remove(keys[1])
    put_raw(writer, keys[1], b"not a record" * 100)
    reader2 = MooncakeTier(pool.config())
    with pytest.raises(ChunkCorrupt):
        reader2.read_into(keys[1], engine)
    for t in (writer, reader, reader2):
        t.close()


def test_bad_input(tier, engine):
    seed, keys = state(1)
    with pytest.raises(LayoutError):
        tier.write(keys[0], np.zeros(N - 1, dtype=np.uint8), LAYOUT)
    other = preset("tiny", chunk_tokens=128)
    with pytest.raises(LayoutError):
        tier.write(keys[0], np.zeros(other.chunk_bytes, dtype=np.uint8), other)
    assert not tier.contains(keys[0])
    tier.write(keys[0], synthetic_chunk(LAYOUT, seed, 0), LAYOUT)
    with Engine(1, 4096) as small, pytest.raises(CapacityError):
        tier.read_into(keys[0], small)


def test_writes_from_slots_and_tensors(tier, engine):
    seed, keys = state(2)
    slot = engine.lease()
    slot.fill_from(synthetic_chunk(LAYOUT, seed, 0))
    slot.set_length(N)
    assert tier.write(keys[0], slot, LAYOUT) is True
    del slot
    assert tier.write(keys[1], torch.from_numpy(synthetic_chunk(LAYOUT, seed, 1)), LAYOUT)
    for i in range(2):
        s = tier.read_into(keys[i], engine)
        assert bytes(memoryview(s)) == synthetic_chunk(LAYOUT, seed, i).tobytes()
        del s


def test_unreachable_master_is_tier_down(netns):
    from bsr_lab.loopback_pool import free_port

    port = free_port()
    cfg = MooncakeConfig(
        master=f"127.0.0.1:{port}",
        metadata_server=f"http://127.0.0.1:{free_port()}/metadata",
        timeout_s=5.0,
    )
    t0 = time.monotonic()
    with pytest.raises(TierDown):
        MooncakeTier(cfg)
    assert time.monotonic() - t0 < 5.5


def test_stalled_node_costs_the_deadline_not_a_hang(fresh_pool):
    tier = MooncakeTier(fresh_pool.config(timeout_s=1.5), layout=LAYOUT)
    seed, keys = fill(tier, 2)
    with Engine(2, N) as eng:
        fresh_pool.signal_node(signal.SIGSTOP)
        try:
            t0 = time.monotonic()
            with pytest.raises(ChunkReadError, match="no answer"):
                tier.read_into(keys[0], eng)
            took = time.monotonic() - t0
            assert 1.4 < took < 4.0
            # The read is abandoned but Mooncake may still write into its slot: it stays
            # out of the ring until the call returns.
            assert eng.free_slots() == 1
        finally:
            fresh_pool.signal_node(signal.SIGCONT)
        deadline = time.monotonic() + 60
        while eng.free_slots() < 2 and time.monotonic() < deadline:
            time.sleep(0.1)
        assert eng.free_slots() == 2
    tier.close()


def test_a_stall_removes_nothing_and_marks_the_tier_down_for_a_while(fresh_pool):
    """A read past the deadline proves nothing about the object: the window's
    invalidate after it (with the error's record, as window.py passes it) removes
    nothing; the tier answers as down for `down_s`, then serves every object again."""
    tier = MooncakeTier(fresh_pool.config(timeout_s=1.5, down_s=2.0), layout=LAYOUT)
    seed, keys = fill(tier, 3)
    with Engine(2, N) as eng:
        fresh_pool.signal_node(signal.SIGSTOP)
        try:
            with pytest.raises(ChunkReadError, match="no answer") as info:
                tier.read_into(keys[0], eng)
            tier.invalidate(keys[0], str(info.value), record=info.value.record)
            assert tier.down and tier.stats()["marked_down"] >= 1
            t0 = time.monotonic()
            with pytest.raises(TierDown, match="marked down"):
                tier.contains(keys[1])  # answered at once, the pool is not asked
            assert Store([tier]).probe(keys) == 0
            assert time.monotonic() - t0 < 0.5
        finally:
            fresh_pool.signal_node(signal.SIGCONT)
        del info
        deadline = time.monotonic() + 60
        while (tier.down or eng.free_slots() < 2) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert tier.stats()["withdrawn"] == 0 and tier.stats()["quarantined"] == 0
        assert tier.stats()["header_buffers_out"] == 0  # the abandoned read gave its back
        other = MooncakeTier(fresh_pool.config(), layout=LAYOUT)
        assert other.probe(keys) == 3  # every object is still in the pool
        other.close()
        for i, k in enumerate(keys):
            slot = tier.read_into(k, eng)
            assert bytes(memoryview(slot)) == synthetic_chunk(LAYOUT, seed, i).tobytes()
            del slot
    tier.close()


class _SlowPut:
    """Test double: the real client, except that a put waits for `go` before it runs (a
    put stalled past the tier's deadline; the real put then reads the payload). An event,
    not a delay: on a loaded machine a delay could end before the test looks."""

    def __init__(self, inner) -> None:
        self.inner, self.go = inner, threading.Event()

    def __getattr__(self, name):
        return getattr(self.inner, name)

    def batch_put_from_multi_buffers(self, *args):
        self.go.wait(60)
        return self.inner.batch_put_from_multi_buffers(*args)


def test_an_abandoned_put_keeps_its_slot_out_of_the_ring(pool):
    """A put past its deadline still reads its payload when it runs: the slot cannot be
    released meanwhile (the put holds a view of it), so it never goes back to the ring
    and gets refilled under the put; it returns once the put has, with its header
    buffer, and the object holds the slot's bytes."""
    tier = MooncakeTier(pool.config(timeout_s=1.0, down_s=0.0), layout=LAYOUT)
    seed, keys = state(2)
    with Engine(2, N) as eng:
        tier.write(keys[0], synthetic_chunk(LAYOUT, seed, 0), LAYOUT)
        tier.read_into(keys[0], eng).release()  # registers the engine's arena
        slot = eng.lease()
        slot.fill_from(synthetic_chunk(LAYOUT, seed, 1))
        slot.set_length(N)
        slow = tier.client = _SlowPut(tier.client)
        with pytest.raises(ChunkWriteError, match="no answer"):
            tier.write(keys[1], slot, LAYOUT)
        with pytest.raises(BufferError):
            slot.release()  # the put will still read it: it cannot go back now
        give_back(slot)  # what a caller does: the slot returns when the put does
        del slot
        other = eng.lease()  # the only free slot; scribbling on it harms nobody
        other.fill_from(np.full(N, 0xEE, dtype=np.uint8))
        with pytest.raises(NoFreeSlot):
            eng.lease()
        other.release()
        slow.go.set()  # the put runs now, reading the slot it kept
        deadline = time.monotonic() + 30
        while (eng.free_slots() < 2 or tier.stats()["header_buffers_out"]) and (
            time.monotonic() < deadline
        ):
            time.sleep(0.05)
        assert eng.free_slots() == 2 and tier.stats()["header_buffers_out"] == 0
        tier.client = slow.inner
        got = tier.read_into(keys[1], eng)  # the late put stored the slot's own bytes
        assert bytes(memoryview(got)) == synthetic_chunk(LAYOUT, seed, 1).tobytes()
        got.release()
    tier.close()


def test_bookkeeping_is_bounded_and_closed_engines_let_go(pool):
    tier = MooncakeTier(pool.config(), layout=LAYOUT)
    tier.INDEX_MAX = 3
    seed, keys = fill(tier, 6)
    assert tier.keys() == keys[3:]  # the newest, at most INDEX_MAX
    # A bad object is removed from the pool: nothing is left to remember about it.
    bad = state(1)[1][0]
    put_raw(tier, bad, b"x" * (HEADER_BYTES + N))
    with Engine(2, N) as a:
        with pytest.raises(ChunkCorrupt):
            tier.read_into(bad, a)
        tier.read_into(keys[0], a).release()
        assert tier.stats()["arenas"] == 1
    assert tier.stats()["withdrawn"] == 0 and not tier.contains(bad)
    with Engine(2, N) as b:  # `a` is closed: its arena goes at the next read
        tier.read_into(keys[1], b).release()
        st = tier.stats()
        assert st["arenas"] == 1 and st["arenas_unregistered"] == 1
    tier.close()  # and `b`'s at close
    assert tier.stats()["arenas"] == 0 and tier.stats()["arenas_unregistered"] == 2


def test_killed_node_fails_reads_fast(fresh_pool):
    tier = MooncakeTier(fresh_pool.config(timeout_s=5.0), layout=LAYOUT)
    seed, keys = fill(tier, 2)
    with Engine(2, N) as eng:
        fresh_pool.signal_node(signal.SIGKILL)
        fresh_pool.node.wait(timeout=5)
        t0 = time.monotonic()
        with pytest.raises((ChunkReadError, ChunkMissing)):
            tier.read_into(keys[0], eng)
        assert time.monotonic() - t0 < 5.5
        assert eng.free_slots() == 2
    tier.close()


def test_master_gone_is_tier_down_for_discovery(fresh_pool):
    tier = MooncakeTier(fresh_pool.config(timeout_s=2.0), layout=LAYOUT)
    seed, keys = fill(tier, 1)
    fresh_pool._stop(fresh_pool.master)
    t0 = time.monotonic()
    with pytest.raises(TierDown):
        tier.contains(keys[0])
    assert time.monotonic() - t0 < 10
    assert Store([tier]).probe(keys) == 0  # a down tier holds nothing for discovery
    tier.close()


def test_config_from_dict_and_extra_config():
    d = {
        "master": "10.1.2.3:50051",
        "metadata_server": "http://10.1.2.3:8080/metadata",
        "protocol": "rdma",
        "device_name": "mlx5_0",
        "timeout_s": "2.5",
        "replica_num": 2,
    }
    c = MooncakeConfig.from_dict(d)
    assert (c.protocol, c.timeout_s, c.replica_num) == ("rdma", 2.5, 2)
    extra = {"bsr.path": "/x", **c.to_extra_config()}
    assert MooncakeConfig.from_extra_config(extra) == c
    assert MooncakeConfig.from_extra_config({"bsr.path": "/x"}) is None
    with pytest.raises(ValueError, match="unknown"):
        MooncakeConfig.from_dict({**d, "mastr": "x"})
    with pytest.raises(ValueError, match="required"):
        MooncakeConfig.from_dict({"master": "h:1"})
    with pytest.raises(ValueError, match="host:port"):
        MooncakeConfig.from_dict({**d, "master": "nohost"})
    with pytest.raises(ValueError, match="protocol"):
        MooncakeConfig.from_dict({**d, "protocol": "udp"})
    with pytest.raises(ValueError, match="timeout_s"):
        MooncakeConfig.from_dict({**d, "timeout_s": 0})
