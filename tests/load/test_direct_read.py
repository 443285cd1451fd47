"""Direct reads: records read with O_DIRECT straight into a host KV cache's blocks and
hashed there (no slot, no copy), where the memory and lengths allow; slots otherwise."""

from __future__ import annotations

import gc
import os
import time
from pathlib import Path

import numpy as np
import pytest
import torch
from layouts import ALIGNED

from bsr_io import Engine
from bsr_io._core import AlignmentError, xxh3_64, xxh3_runs
from bsr_io.cli.synthetic import fill_state, synthetic_chunk
from bsr_io.faults import Fault, FaultPlan
from bsr_io.load.kvcache import PagedKVCache
from bsr_io.load.memory import registered, registrations
from bsr_io.model.record import HEADER_BYTES
from bsr_io.restore import Restorer
from bsr_io.store import Store
from bsr_io.tiers import LowerTier, SSDTier, StripedSSDTier

# Blocks of 4 KiB (16 tokens x 256 bytes), two groups: every run suits O_DIRECT.
LAYOUT = ALIGNED
CHUNKS = 12
TOKENS = CHUNKS * LAYOUT.chunk_tokens


def _store(tmp_path: Path, engine: Engine, lower: bool = True, striped: bool = False):
    if striped:
        dirs = [tmp_path / "d0", tmp_path / "d1"]
        for d in dirs:
            d.mkdir()
        l2: SSDTier | StripedSSDTier = StripedSSDTier(dirs, None, engine, layout=LAYOUT)
    else:
        l2 = SSDTier(tmp_path / "l2", None, engine, layout=LAYOUT)
    tiers = [l2] + ([LowerTier(tmp_path / "l3", layout=LAYOUT)] if lower else [])
    for t in tiers:
        tokens, keys = fill_state(t, LAYOUT, TOKENS, seed=5, model="m")
    return Store(tiers), l2, tokens, keys


def _ok(dest: PagedKVCache) -> bool:
    return all(
        dest.chunk_bytes(i) == synthetic_chunk(LAYOUT, 5, i).tobytes() for i in range(CHUNKS)
    )


def _restore(store: Store, engine: Engine, tokens, dest: PagedKVCache):
    r = Restorer(store, LAYOUT, window=4, engine=engine, model="m")
    return r.restore(r.probe(tokens), dest)


def _misaligned(dest: PagedKVCache) -> PagedKVCache:
    """The same blocks shifted 64 bytes off a page: what torch's own allocator gives."""
    tensors = []
    for t in dest.tensors:
        raw = torch.zeros(t.numel() * t.element_size() + 4096 + 64, dtype=torch.uint8)
        off = (-raw.data_ptr() % 4096) + 64
        tensors.append(raw[off : off + t.numel() * t.element_size()].view(t.dtype).view(t.shape))
    return PagedKVCache(LAYOUT, tensors, [list(range(t.shape[0])) for t in tensors])


@pytest.mark.parametrize("striped", [False, True])
def test_a_host_cache_is_filled_in_place_with_no_staging(tmp_path: Path, striped: bool) -> None:
    engine = Engine(4, LAYOUT.chunk_bytes)
    store, _, tokens, _ = _store(tmp_path, engine, lower=False, striped=striped)
    dest = PagedKVCache.allocate(LAYOUT, TOKENS)
    assert all(t.data_ptr() % 4096 == 0 for t in dest.tensors)
    res = _restore(store, engine, tokens, dest)
    assert res.outcome == "complete", res.reason
    assert res.timings["direct_chunks"] == CHUNKS and _ok(dest)
    assert res.rws_peak_bytes == 0, "no slot was leased"
    # Control: the same restore with direct reads off goes through the slots.
    dest2 = PagedKVCache.allocate(LAYOUT, TOKENS)
    dest2.direct_reads = False
    res2 = _restore(store, engine, tokens, dest2)
    assert res2.outcome == "complete" and res2.timings["direct_chunks"] == 0 and _ok(dest2)
    assert res2.rws_peak_bytes == 4 * engine.slot_bytes


def test_memory_o_direct_refuses_goes_through_slots(tmp_path: Path) -> None:
    engine = Engine(4, LAYOUT.chunk_bytes)
    store, l2, tokens, keys = _store(tmp_path, engine, lower=False)
    f = engine.open(l2.path_of(keys[0]))
    if f.alignment == 1:
        pytest.skip("no O_DIRECT on this filesystem: nothing to refuse")
    dest = _misaligned(PagedKVCache.allocate(LAYOUT, TOKENS))
    bufs, runs = dest.host_runs(0)
    with pytest.raises(AlignmentError, match="not aligned for O_DIRECT"):
        engine.submit_read_into(f, HEADER_BYTES, bufs, runs)
    f.close()
    res = _restore(store, engine, tokens, dest)
    assert res.outcome == "complete", res.reason
    assert res.timings["direct_chunks"] == 0 and res.rws_peak_bytes > 0
    for i in range(CHUNKS):
        assert dest.chunk_bytes(i) == synthetic_chunk(LAYOUT, 5, i).tobytes()


def test_runs_must_cover_the_payload_once(tmp_path: Path) -> None:
    engine = Engine(1, 8192)
    path = tmp_path / "f"
    path.write_bytes(os.urandom(3 * 4096))
    f = engine.open(path)
    buf = PagedKVCache.allocate(LAYOUT, 64).tensors[0].reshape(-1).view(torch.uint8).numpy()
    with pytest.raises(ValueError, match="without gaps"):
        engine.submit_read_into(f, 0, [buf], [(0, 0, 4096, 4096)])
    with pytest.raises(ValueError, match="overlap in memory"):
        engine.submit_read_into(f, 0, [buf], [(0, 0, 0, 4096), (0, 0, 4096, 4096)])
    with pytest.raises(BufferError, match="not writable"):
        engine.submit_read_into(f, 0, [bytes(8192)], [(0, 0, 0, 4096)])
    # The direct read itself, and the hash in place against the hash of the file's bytes.
    done = engine.submit_read_into(f, 4096, [buf], [(0, 0, 0, 4096), (0, 8192, 4096, 4096)])
    assert done.wait() == 8192
    data = path.read_bytes()[4096:]
    assert bytes(buf[:4096]) + bytes(buf[8192:12288]) == data
    assert xxh3_runs([buf], [(0, 0, 0, 4096), (0, 8192, 4096, 4096)]) == xxh3_64(data)
    assert engine.peak_bytes() == 0
    f.close()


def _flip(path: Path) -> None:
    fd = os.open(path, os.O_RDWR)
    try:
        (b,) = os.pread(fd, 1, HEADER_BYTES + 5000)
        os.pwrite(fd, bytes([b ^ 0xFF]), HEADER_BYTES + 5000)
    finally:
        os.close(fd)


def test_a_corrupt_record_read_in_place_is_caught_and_reread(tmp_path: Path) -> None:
    engine = Engine(4, LAYOUT.chunk_bytes)
    store, l2, tokens, keys = _store(tmp_path, engine)
    _flip(l2.path_of(keys[3]))
    dest = PagedKVCache.allocate(LAYOUT, TOKENS)
    res = _restore(store, engine, tokens, dest)
    assert res.outcome == "complete", res.reason
    assert [f["chunk"] for f in res.fallbacks] == [3]
    assert "direct read" in " ".join(res.fallbacks[0]["causes"])
    assert res.source_tiers[3] == "L3" and _ok(dest)
    assert len(l2.quarantined_files()) == 1
    # Without a lower tier the same damage ends the restore zero.
    engine2 = Engine(4, LAYOUT.chunk_bytes)
    store2, l2b, tokens2, keys2 = _store(tmp_path / "b", engine2, lower=False)
    _flip(l2b.path_of(keys2[7]))
    res2 = _restore(store2, engine2, tokens2, PagedKVCache.allocate(LAYOUT, TOKENS))
    assert res2.outcome == "zero" and res2.committed_tokens == 0


def _faulty_restore(tmp_path: Path, fault: Fault):
    """A restore of the aligned state from L2 alone (no lower copy), `fault` on it."""
    engine = Engine(4, LAYOUT.chunk_bytes)
    _, l2, tokens, keys = _store(tmp_path, engine, lower=False)
    faulty = FaultPlan([fault]).wrap(l2, keys=keys)
    dest = PagedKVCache.allocate(LAYOUT, TOKENS)
    return _restore(Store([faulty]), engine, tokens, dest), l2, faulty, dest, keys


def test_a_mismatch_only_in_place_is_read_again_through_a_slot_and_kept(tmp_path: Path) -> None:
    """The fault double flips a byte of chunk 3 in the cache's memory after its direct
    read landed (the stored record is intact): the chunk is read once more through a
    slot, the restore completes with the right bytes, and nothing is quarantined."""
    res, l2, faulty, dest, keys = _faulty_restore(tmp_path, Fault("clobber", chunks=[3], times=1))
    assert faulty.injected == [("clobber", 3)]
    assert res.outcome == "complete", res.reason
    assert l2.quarantined_files() == [] and l2.contains(keys[3])
    assert _ok(dest)
    assert [f["chunk"] for f in res.fallbacks] == [3] and res.source_tiers[3] == "L2"
    assert "direct read" in " ".join(res.fallbacks[0]["causes"])
    assert res.timings["direct_chunks"] == CHUNKS - 1 and res.rws_peak_bytes > 0


def test_a_mismatch_in_place_and_through_the_slot_quarantines(tmp_path: Path) -> None:
    """Control: the stored record itself is bad (both reads mismatch): withdrawn, and
    with no lower copy the restore ends zero."""
    res, l2, faulty, _, _ = _faulty_restore(tmp_path, Fault("corrupt", chunks=[3], times=1))
    assert faulty.injected == [("corrupt", 3)]
    assert res.outcome == "zero" and res.committed_tokens == 0
    assert len(l2.quarantined_files()) == 1
    causes = " ".join(res.fallbacks[0]["causes"]) if res.fallbacks else res.reason
    assert "direct read" in causes and "payload checksum mismatch" in causes


def test_hash_in_place_sees_every_byte() -> None:
    a = np.zeros(8192, dtype=np.uint8)
    a[:] = np.arange(8192) % 251
    h = xxh3_runs([a], [(0, 0, 0, 8192)])
    a[8191] ^= 1
    assert xxh3_runs([a], [(0, 0, 0, 8192)]) != h


def _ring_buffers() -> str:
    """The buffer-table lines of this process's io_uring rings (their fdinfo). The kernel
    leaves them out while an I/O thread holds a ring's lock: callers poll."""
    out = []
    for fd in os.listdir("/proc/self/fdinfo"):
        try:
            info = Path(f"/proc/self/fdinfo/{fd}").read_text()
        except OSError:
            continue
        if "UserBufs" in info:
            out.append(info)
    return "\n".join(out)


def _ring_holds(addr: int, nbytes: int, want: bool) -> bool:
    line = f": 0x{addr:x}/{nbytes}\n"
    for _ in range(500):
        if (line in _ring_buffers()) == want:
            return True
        time.sleep(0.01)
    return False


def test_a_lasting_cache_is_registered_with_the_ring_once_for_its_life(tmp_path: Path) -> None:
    engine = Engine(4, LAYOUT.chunk_bytes, backend="io_uring")
    if not engine.features["registered_memory"]:
        pytest.fail(f"this kernel takes no caller memory: {engine.features['notes']}")
    store, _, tokens, _ = _store(tmp_path, engine, lower=False)
    dest = PagedKVCache.allocate(LAYOUT, TOKENS)
    spans = [(t.data_ptr(), t.numel() * t.element_size()) for t in dest.tensors]
    assert all(_ring_holds(a, n, False) for a, n in spans), "nothing registered yet"
    res = _restore(store, engine, tokens, dest)
    assert res.outcome == "complete" and res.timings["direct_chunks"] == CHUNKS and _ok(dest)
    reg = registered(engine, dest.host_runs(0)[0])
    assert reg is not None and reg.entries(engine) == len(spans) and registrations(engine) == 1
    assert all(_ring_holds(a, n, True) for a, n in spans), "the kernel holds each tensor"
    # A second restore reads into the same registration; a fresh window does not redo it.
    for t in dest.tensors:
        t.zero_()
    res = _restore(store, engine, tokens, dest)
    assert res.outcome == "complete" and _ok(dest)
    assert registered(engine, dest.host_runs(0)[0]) is reg and registrations(engine) == 1
    # Control: a cache that does not last (a per-request view) is never registered.
    short = PagedKVCache.allocate(LAYOUT, TOKENS)
    short.lasting = False
    assert _restore(store, engine, tokens, short).outcome == "complete" and _ok(short)
    assert registered(engine, short.host_runs(0)[0]) is None and registrations(engine) == 1
    # The cache gone, its registration goes: the ring lets go of the memory.
    del dest, reg
    gc.collect()
    assert all(_ring_holds(a, n, False) for a, n in spans), "unregistered with the cache"


def _entries(spans: list[tuple[int, int]]) -> int:
    """Buffer-table entries the kernel holds for `spans`, over this process's rings (the
    most seen in a few polls: fdinfo leaves a ring out while its I/O thread holds it)."""
    best = 0
    for _ in range(20):
        text = _ring_buffers()
        best = max(best, sum(text.count(f": 0x{a:x}/{n}\n") for a, n in spans))
        time.sleep(0.005)
    return best


def test_per_request_caches_over_one_pool_cost_one_registration(tmp_path: Path) -> None:
    """100 per-request caches over one serving pool (each its own PagedKVCache over the
    pool's tensors, as a serving engine makes one per request) register the pool once,
    whether they live at once or one after another while the pool's owner holds it."""
    engine = Engine(4, LAYOUT.chunk_bytes, backend="io_uring")
    if not engine.features["registered_memory"]:
        pytest.fail(f"this kernel takes no caller memory: {engine.features['notes']}")
    store, _, tokens, _ = _store(tmp_path, engine, lower=False)
    pool = PagedKVCache.allocate(LAYOUT, TOKENS)
    ids = [list(range(t.shape[0])) for t in pool.tensors]
    spans = [(t.data_ptr(), t.numel() * t.element_size()) for t in pool.tensors]
    r = Restorer(store, LAYOUT, window=4, engine=engine, model="m")
    plan = r.probe(tokens)

    def request() -> PagedKVCache:
        dest = PagedKVCache(LAYOUT, pool.tensors, ids)
        res = r.restore(plan, dest)
        assert res.outcome == "complete" and res.timings["direct_chunks"] == CHUNKS
        return dest

    live = [request() for _ in range(100)]  # requests in flight together
    assert _entries(spans) == len(spans), "the kernel holds the pool once"
    assert _ok(pool) and registrations(engine) == 1
    del live
    gc.collect()
    assert _entries(spans) == 0, "the last request gone, the pool is let go"
    held = pool.register(engine)  # the pool's owner registers it for the pool's life
    for _ in range(100):  # requests one after another
        request()
    assert registrations(engine) == 2 and held.entries(engine) == len(spans)
    assert _entries(spans) == len(spans)
    # Control: one registration per destination object, as the keying by destination
    # gave, is what the kernel's table shows growing.
    regs = [engine.register_memory(PagedKVCache(LAYOUT, pool.tensors, ids).host_runs(0)[0])]
    regs.append(engine.register_memory(PagedKVCache(LAYOUT, pool.tensors, ids).host_runs(0)[0]))
    assert _entries(spans) == 3 * len(spans)
    for reg in regs:
        reg.close()


def test_the_ring_pins_its_slots_only_once_a_slot_is_used(tmp_path: Path) -> None:
    """The kernel's buffer table (fdinfo) holds no slot while every chunk goes straight
    into the cache; the first restore through slots fills in every slot's entry."""
    store, _, tokens, _ = _store(tmp_path, Engine(4, LAYOUT.chunk_bytes), lower=False)
    engine = Engine(4, LAYOUT.chunk_bytes, backend="io_uring")  # the restores' own
    if not engine.features["fixed_buffers"]:
        pytest.fail(f"this kernel registers no fixed buffers: {engine.features['notes']}")
    slots = [(engine.arena_address + i * engine.slot_bytes, engine.slot_bytes) for i in range(4)]
    res = _restore(store, engine, tokens, PagedKVCache.allocate(LAYOUT, TOKENS))
    assert res.outcome == "complete" and res.timings["direct_chunks"] == CHUNKS
    assert _entries(slots) == 0, "no slot pinned for a restore that used none"
    dest = PagedKVCache.allocate(LAYOUT, TOKENS)
    dest.direct_reads = False
    res = _restore(store, engine, tokens, dest)
    assert res.outcome == "complete" and res.rws_peak_bytes == 4 * engine.slot_bytes
    assert _ok(dest) and _entries(slots) == 4, "each slot pinned once a slot is read into"


def test_a_backend_without_registration_reads_the_cache_plainly(tmp_path: Path) -> None:
    engine = Engine(4, LAYOUT.chunk_bytes, backend="pread")
    assert not engine.features["registered_memory"]
    store, _, tokens, _ = _store(tmp_path, engine, lower=False)
    dest = PagedKVCache.allocate(LAYOUT, TOKENS)
    res = _restore(store, engine, tokens, dest)
    assert res.outcome == "complete" and _ok(dest)
    reg = registered(engine, dest.host_runs(0)[0])
    assert reg is not None and reg.entries(engine) == 0 and reg.registration(engine) is not None
    with pytest.raises(ValueError, match="empty"):
        Engine(1, 4096).register_memory([np.zeros(0, dtype=np.uint8)])
