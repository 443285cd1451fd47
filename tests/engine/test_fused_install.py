"""The fused install: copy a slot into the KV blocks and hash it in one pass (Rust, GIL
released), then check the record header's hash; a mismatch is a chunk failure."""

from __future__ import annotations

import os
import time

import numpy as np
import pytest

from bsr_io import Engine
from bsr_io._core import xxh3_64
from bsr_io.cli.synthetic import fill_state, synthetic_chunk
from bsr_io.load.kvcache import PagedKVCache
from bsr_io.model.layout import preset
from bsr_io.model.record import HEADER_BYTES
from bsr_io.restore import Restorer
from bsr_io.save.records import save_records
from bsr_io.store import open_store

LAYOUT = preset("tiny")
CHUNKS = 12


class _Spy(PagedKVCache):
    """Counts the fused installs it is asked for (so a test knows which path ran)."""

    fused_calls = 0
    direct_reads = False  # these tests watch the install from a slot

    def host_runs(self, chunk_index):
        self.fused_calls += 1
        return super().host_runs(chunk_index)


class _TwoPass:
    """The same cache without host runs: installs take the copy-then-hash path."""

    def __init__(self, inner: PagedKVCache) -> None:
        self.inner, self.layout = inner, inner.layout
        self.capacity_chunks = inner.capacity_chunks

    def install(self, i, payload):
        return self.inner.install(i, payload)

    def extract(self, i, out):
        self.inner.extract(i, out)

    def synchronize(self):
        self.inner.synchronize()


def _slot(engine: Engine, data: np.ndarray):
    s = engine.lease()
    s.fill_from(data)
    s.set_length(len(data))
    return s


def test_install_xxh3_copies_along_runs_and_hashes_every_byte():
    rng = np.random.default_rng(3)
    data = rng.integers(0, 256, 300_000, dtype=np.uint8)
    with Engine(1, 1 << 20) as eng:
        s = _slot(eng, data)
        a, b = np.zeros(200_000, np.uint8), np.zeros(150_000, np.uint8)
        runs = [(1, 10, 0, 100_000), (0, 0, 100_000, 70_000), (0, 80_000, 200_000, 100_000)]
        h = s.install_xxh3([a, b], runs)
        assert h == xxh3_64(data)  # the gap 170_000..200_000 is hashed too
        assert (b[10:100_010] == data[:100_000]).all()
        assert (a[:70_000] == data[100_000:170_000]).all()
        assert (a[80_000:180_000] == data[200_000:]).all() and not a[70_000:80_000].any()
        # Control: one flipped byte in the slot changes the hash.
        data[123_456] ^= 0x40
        s.fill_from(data)
        assert s.install_xxh3([a, b], runs) != h
        del s


def test_install_xxh3_refuses_bad_runs_and_aliasing():
    with Engine(1, 1 << 16) as eng:
        s = _slot(eng, np.arange(4096, dtype=np.uint8))
        d = np.zeros(4096, np.uint8)
        for runs in (
            [(0, 0, 4000, 200)],
            [(0, 4000, 0, 200)],
            [(1, 0, 0, 10)],
            [(0, 0, 100, 10), (0, 20, 50, 10)],
        ):
            with pytest.raises(ValueError):
                s.install_xxh3([d], runs)
        # Runs that would write the same bytes twice are refused; buffers that alias
        # each other are fine as long as the runs do not (only the runs are borrowed).
        with pytest.raises(ValueError, match="overlap"):
            s.install_xxh3([d, d[100:]], [(0, 100, 0, 10), (1, 5, 10, 10)])
        s.install_xxh3([d, d[100:]], [(0, 0, 0, 10), (1, 0, 10, 10)])
        assert d[:10].tolist() == list(range(10)) and d[100:110].tolist() == list(range(10, 20))
        with pytest.raises(ValueError, match="overlap"):  # a destination inside the slot
            s.install_xxh3([np.frombuffer(memoryview(s), np.uint8)], [(0, 0, 0, 10)])
        with pytest.raises(BufferError):
            s.install_xxh3([bytes(10)], [(0, 0, 0, 10)])  # read-only destination
        del s


def test_gather_copies_runs_into_the_slot_and_zeroes_the_gaps():
    """A save's cut of scattered pages (vLLM's blocks) into one record, in one call."""
    rng = np.random.default_rng(4)
    a, b = (rng.integers(1, 256, n, dtype=np.uint8) for n in (200_000, 150_000))
    with Engine(1, 1 << 20) as eng:
        s = _slot(eng, np.full(300_000, 0xAB, np.uint8))  # stale bytes of an earlier use
        runs = [(1, 10, 0, 100_000), (0, 0, 100_000, 70_000), (0, 80_000, 200_000, 90_000)]
        s.gather([a, b], runs)
        got = np.frombuffer(memoryview(s), np.uint8)
        assert (got[:100_000] == b[10:100_010]).all()
        assert (got[100_000:170_000] == a[:70_000]).all()
        assert (got[200_000:290_000] == a[80_000:170_000]).all()
        assert not got[170_000:200_000].any() and not got[290_000:].any()  # no stale byte
        del got
        for bad in ([(0, 0, 299_990, 20)], [(0, 199_990, 0, 20)], [(2, 0, 0, 10)]):
            with pytest.raises(ValueError):
                s.gather([a, b], bad)
        s.gather([bytes(range(10))], [(0, 0, 0, 10)])  # sources may be read-only
        assert bytes(memoryview(s)[:10]) == bytes(range(10))
        del s


def test_gather_hashes_what_it_wrote_and_checksum_never_returns_a_stale_hash():
    """`gather` returns the xxh3 of the slot's valid bytes (the copy's own pass), and
    `checksum()` reuses it only while nothing can have changed them: a write through a
    view made afterwards, a view alive during the gather, `fill_from` or `set_length`
    all make it hash the bytes again (the controls: each changes the bytes first)."""
    rng = np.random.default_rng(5)
    a = rng.integers(1, 256, 200_000, dtype=np.uint8)
    runs = [(0, 10, 4_096, 100_000), (0, 120_000, 110_000, 50_000)]
    with Engine(1, 1 << 20) as eng:
        s = _slot(eng, np.full(300_000, 0xCD, np.uint8))
        h = s.gather([a], runs)
        assert s.checksum() == h
        assert h == xxh3_64(bytes(memoryview(s)))  # the bytes, hashed on their own
        # A view made after the gather may have written: the hash is not reused.
        v = memoryview(s)
        v[7] ^= 0xFF
        del v
        assert s.checksum() == xxh3_64(bytes(memoryview(s))) != h
        # A view alive during the gather may write after it: no hash is kept.
        h = s.gather([a], runs)
        v = memoryview(s)
        assert s.gather([a], runs) == h
        v[5_000] ^= 0xFF
        del v
        assert s.checksum() != h
        # Bytes filled in, or a new length, after the gather.
        assert s.gather([a], runs) == h and s.checksum() == h
        s.fill_from(b"\x01\x02", 0)
        assert s.checksum() != h
        assert s.gather([a], runs) == h
        s.set_length(200_000)
        assert s.checksum() == xxh3_64(bytes(memoryview(s))) and len(s) == 200_000
        del s


def _state(tmp_path, engine, *, l3: bool):
    store = open_store(
        engine, tmp_path / "l2", layout=LAYOUT, lower_dir=tmp_path / "l3" if l3 else None
    )
    tokens, keys = fill_state(store.tier("L2"), LAYOUT, CHUNKS * 16, seed=5, model="m")
    if l3:
        fill_state(store.tier("L3"), LAYOUT, CHUNKS * 16, seed=5, model="m")
    return store, tokens, keys


def _bytes_ok(dest, n):
    return all(dest.chunk_bytes(i) == synthetic_chunk(LAYOUT, 5, i).tobytes() for i in range(n))


def test_fused_and_two_pass_install_the_same_bytes(tmp_path):
    engine = Engine(4, LAYOUT.chunk_bytes)
    store, tokens, _ = _state(tmp_path, engine, l3=False)
    r = Restorer(store, LAYOUT, window=4, engine=engine, model="m")
    fused = _Spy.allocate(LAYOUT, CHUNKS * 16)
    res = r.restore(r.probe(tokens), fused)
    assert res.complete and fused.fused_calls == CHUNKS
    plain = PagedKVCache.allocate(LAYOUT, CHUNKS * 16)
    res2 = r.restore(r.probe(tokens), _TwoPass(plain))
    assert res2.complete
    assert all(fused.chunk_bytes(i) == plain.chunk_bytes(i) for i in range(CHUNKS))
    assert _bytes_ok(fused, CHUNKS)
    assert engine.live_bytes() == 0


def test_gathered_and_extracted_saves_store_the_same_records(tmp_path):
    """`save_records` gathers a host destination's records in one call each
    (`host_runs`); the same records extracted run by run store the same bytes."""
    engine = Engine(4, LAYOUT.chunk_bytes)
    store, tokens, keys = _state(tmp_path, engine, l3=False)
    r = Restorer(store, LAYOUT, window=4, engine=engine, model="m")
    src = _Spy.allocate(LAYOUT, CHUNKS * 16)
    assert r.restore(r.probe(tokens), src).complete
    payloads = {}
    for name, dest in (("gathered", src), ("extracted", _TwoPass(src))):
        out = open_store(engine, tmp_path / name, layout=LAYOUT)
        calls = src.fused_calls
        n = save_records(
            engine, out.tier("L2"), keys, [LAYOUT] * CHUNKS, dest, deadline=time.monotonic() + 30
        )
        assert n == CHUNKS
        assert (src.fused_calls - calls == CHUNKS) == (name == "gathered")  # the path taken
        payloads[name] = [out.tier("L2").path_of(k).read_bytes() for k in keys]
    assert payloads["gathered"] == payloads["extracted"]
    assert engine.live_bytes() == 0


def _flip_payload(store, key, at: int = 17) -> None:
    path = store.tier("L2").path_of(key)
    fd = os.open(path, os.O_RDWR)
    try:
        b = os.pread(fd, 1, HEADER_BYTES + at)
        os.pwrite(fd, bytes([b[0] ^ 0xFF]), HEADER_BYTES + at)
    finally:
        os.close(fd)


@pytest.mark.parametrize(("two_pass", "threads"), [(False, 1), (True, 1), (False, 2)])
def test_corrupt_payload_caught_after_the_copy_is_never_committed(tmp_path, two_pass, threads):
    engine = Engine(4, LAYOUT.chunk_bytes)
    store, tokens, keys = _state(tmp_path, engine, l3=False)
    r = Restorer(store, LAYOUT, window=4, engine=engine, model="m", install_threads=threads)
    plan = r.probe(tokens)
    assert plan.hit_chunks == CHUNKS
    _flip_payload(store, keys[6])
    dest = _Spy.allocate(LAYOUT, CHUNKS * 16)
    res = r.restore(plan, _TwoPass(dest) if two_pass else dest)
    assert res.outcome == "zero" and res.committed_tokens == 0
    assert "checksum mismatch after the install copy" in res.reason
    # The fused path really ran up to the bad chunk (its bytes were installed, unseen);
    # with parallel installs, the chunk after it may have started too.
    assert dest.fused_calls == 0 if two_pass else 7 <= dest.fused_calls <= 6 + threads
    # The bad record is withdrawn: the next probe stops before it.
    assert r.probe(tokens).hit_chunks == 6
    assert store.tier("L2").quarantined_files()
    assert engine.live_bytes() == 0


@pytest.mark.parametrize("threads", [1, 2, 3])
def test_corrupt_payload_reread_from_l3_into_the_same_blocks(tmp_path, threads):
    engine = Engine(4, LAYOUT.chunk_bytes)
    store, tokens, keys = _state(tmp_path, engine, l3=True)
    r = Restorer(store, LAYOUT, window=4, engine=engine, model="m", install_threads=threads)
    plan = r.probe(tokens)
    _flip_payload(store, keys[3])
    dest = _Spy.allocate(LAYOUT, CHUNKS * 16)
    res = r.restore(plan, dest)
    assert res.complete, res.reason
    assert [f["chunk"] for f in res.fallbacks] == [3] and res.fallbacks[0]["tier"] == "L3"
    assert "checksum mismatch" in " ".join(res.fallbacks[0]["causes"])
    assert _bytes_ok(dest, CHUNKS)  # the good copy overwrote the bad bytes
    assert res.source_tiers[3] == "L3" and res.source_tiers.count("L2") == CHUNKS - 1
    assert engine.live_bytes() == 0


@pytest.mark.parametrize("threads", [2, 4])
def test_parallel_installs_equal_the_serial_ones(tmp_path, threads):
    engine = Engine(4, LAYOUT.chunk_bytes)
    store, tokens, _ = _state(tmp_path, engine, l3=False)
    r = Restorer(store, LAYOUT, window=4, engine=engine, model="m", install_threads=threads)
    dest = _Spy.allocate(LAYOUT, CHUNKS * 16)
    res = r.restore(r.probe(tokens), dest)
    assert res.complete and dest.fused_calls == CHUNKS and _bytes_ok(dest, CHUNKS)
    assert res.rws_peak_bytes == 4 * engine.slot_bytes and engine.live_bytes() == 0


def test_injected_corruption_reaches_the_fused_check(tmp_path):
    # The fault double forwards verify=False, so the fault matrix's corruption cases
    # exercise the check after the fused copy, not the tier's own.
    from bsr_io.faults import Fault, FaultPlan
    from bsr_io.store import Store

    engine = Engine(4, LAYOUT.chunk_bytes)
    store, tokens, keys = _state(tmp_path, engine, l3=False)
    faulty = Store(FaultPlan([Fault("corrupt", "L2", chunks=[2])]).wrap_all(store.tiers, 0, keys))
    r = Restorer(faulty, LAYOUT, window=4, engine=engine, model="m")
    dest = _Spy.allocate(LAYOUT, CHUNKS * 16)
    res = r.restore(r.probe(tokens), dest)
    assert res.outcome == "zero" and "after the install copy" in res.reason
    assert dest.fused_calls == 3
