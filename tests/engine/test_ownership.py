"""Engine back-pressure and slot ownership.

A full or closed engine is the engine's own state: it never fails a chunk and never
quarantines a record. Slots return to the ring deterministically (release(), a
with-block), never by garbage collection, and a write owns its slot until it ends.
Real engine, real files; the only double is a tier wrapper that fails on purpose.
"""

from __future__ import annotations

import threading
import time

import numpy as np
import pytest
import torch

from bsr_io import Engine, EngineClosedError, as_numpy, as_tensor
from bsr_io.cli.synthetic import fill_state, synthetic_chunk
from bsr_io.errors import ChunkWriteError
from bsr_io.load.kvcache import PagedKVCache
from bsr_io.model.layout import preset
from bsr_io.restore import Restorer
from bsr_io.store import Store, open_store

LAYOUT = preset("tiny")
CHUNKS = 8


def _setup(tmp_path, window=3, timeout_s=10.0, slots=None):
    engine = Engine(slots or window, LAYOUT.chunk_bytes)
    store = open_store(engine, tmp_path / "l2", layout=LAYOUT)
    tokens, _ = fill_state(store.tier("L2"), LAYOUT, CHUNKS * 16, seed=7, model="m")
    r = Restorer(store, LAYOUT, window=window, engine=engine, model="m", timeout_s=timeout_s)
    return engine, store, r, tokens


def _intact(store, dest, r, tokens) -> None:
    """Nothing quarantined, every record still advertised, the bytes right."""
    l2 = store.tier("L2")
    assert l2.quarantined_files() == [] and l2.stats()["quarantined"] == 0
    assert r.probe(tokens).hit_chunks == CHUNKS
    if dest is not None:
        for i in range(CHUNKS):
            assert dest.chunk_bytes(i) == synthetic_chunk(LAYOUT, 7, i).tobytes()


# -- defect 3: a full or closed engine is not a bad chunk ------------------------------
@pytest.mark.parametrize("hold", ["slot", "numpy-view", "tensor-view"])
def test_held_slot_narrows_the_window(tmp_path, hold):
    engine, store, r, tokens = _setup(tmp_path)
    slot = engine.lease()
    view = {"slot": None, "numpy-view": as_numpy(slot), "tensor-view": as_tensor(slot)}[hold]
    dest = PagedKVCache.allocate(LAYOUT, CHUNKS * 16)
    res = r.restore(r.probe(tokens), dest)
    assert res.outcome == "complete", res.reason
    # It ran on the slots that were free: W-1 of them, not W.
    assert res.rws_peak_bytes == 3 * engine.slot_bytes  # two of the restore's + the held one
    _intact(store, dest, r, tokens)
    del view
    slot.release()
    assert engine.free_slots() == 3


def test_every_slot_held_is_engine_busy_not_a_bad_chunk(tmp_path):
    engine, store, r, tokens = _setup(tmp_path, timeout_s=0.5)
    held = [engine.lease() for _ in range(3)]
    t0 = time.monotonic()
    res = r.restore(r.probe(tokens), PagedKVCache.allocate(LAYOUT, CHUNKS * 16))
    assert res.outcome == "zero" and "staging slots came free" in res.reason
    assert time.monotonic() - t0 < 5  # bounded by the restore timeout
    for s in held:
        s.release()
    _intact(store, None, r, tokens)
    # The same records restore once the slots are back.
    dest = PagedKVCache.allocate(LAYOUT, CHUNKS * 16)
    assert r.restore(r.probe(tokens), dest).complete
    _intact(store, dest, r, tokens)


def test_closed_engine_is_a_caller_error(tmp_path):
    engine, store, r, tokens = _setup(tmp_path)
    plan = r.probe(tokens)
    engine.close()
    with pytest.raises(EngineClosedError):
        r.restore(plan, PagedKVCache.allocate(LAYOUT, CHUNKS * 16))
    l2 = store.tier("L2")
    assert l2.quarantined_files() == [] and l2.stats()["quarantined"] == 0
    assert len(l2.keys()) == CHUNKS


def test_save_then_restore_on_one_engine(tmp_path):
    """The README's sequence: save and restore through the same engine and W."""
    engine = Engine(2, LAYOUT.chunk_bytes)
    store = open_store(engine, tmp_path / "l2", layout=LAYOUT, l1_bytes=1 << 20)
    r = Restorer(store, LAYOUT, window=2, engine=engine, model="m")
    src = PagedKVCache.allocate(LAYOUT, CHUNKS * 16)
    for t in src.tensors:
        t.view(torch.uint8).copy_(
            torch.randint(0, 256, t.view(torch.uint8).shape, dtype=torch.uint8)
        )
    tokens = list(range(CHUNKS * 16))
    assert r.save(tokens, src) == CHUNKS
    assert engine.free_slots() == 2  # every save slot is back, not waiting for a collector
    dest = PagedKVCache.allocate(LAYOUT, CHUNKS * 16)
    res = r.restore(r.probe(tokens), dest)
    assert res.outcome == "complete", res.reason
    assert all(dest.chunk_bytes(i) == src.chunk_bytes(i) for i in range(CHUNKS))


def test_save_and_restore_at_once_on_a_shared_engine(tmp_path):
    engine, store, r, tokens = _setup(tmp_path, window=2)
    src = PagedKVCache.allocate(LAYOUT, 24 * 16)
    for t in src.tensors:
        t.view(torch.uint8).fill_(0x3C)
    other = list(range(24 * 16))
    saved: list[int] = []
    saver = threading.Thread(target=lambda: saved.append(r.save(other, src)))
    results = []
    saver.start()
    for _ in range(5):  # restores race the saver for the same two slots
        dest = PagedKVCache.allocate(LAYOUT, CHUNKS * 16)
        results.append((r.restore(r.probe(tokens), dest), dest))
    saver.join(60)
    assert saved == [24]
    for res, dest in results:
        assert res.outcome == "complete", res.reason
        _intact(store, dest, r, tokens)
    assert r.probe(other).hit_chunks == 24


# -- defect 4: slots return deterministically ------------------------------------------
def test_release_and_with_block(tmp_path):
    engine = Engine(2, 4096)
    with engine.lease() as slot:
        assert engine.free_slots() == 1
    assert engine.free_slots() == 2 and slot.released
    with pytest.raises(ValueError, match="released"):
        slot.fill_from(b"x")
    with pytest.raises(BufferError):
        memoryview(slot)
    slot.release()  # idempotent
    assert engine.free_slots() == 2


@pytest.mark.parametrize("make", [memoryview, as_numpy, as_tensor], ids=["mv", "np", "torch"])
def test_release_refused_while_a_view_lives(make):
    engine = Engine(1, 4096)
    slot = engine.lease()
    view = make(slot)
    with pytest.raises(BufferError, match="view"):
        slot.release()
    assert engine.free_slots() == 0 and not slot.released
    del view
    slot.release()
    assert engine.free_slots() == 1


def test_write_owns_its_slot_until_done(tmp_path):
    engine = Engine(1, 1 << 20)
    f = engine.open(tmp_path / "out", create=True)
    slot = engine.lease()
    slot.fill_from(np.full(1 << 20, 7, np.uint8))
    view = memoryview(slot)
    with pytest.raises(BufferError, match="view"):
        engine.submit_write(slot, f, 0)  # a live writable view could tear the write
    del view
    pending = engine.submit_write(slot, f, 0)
    # While in flight (or until waited), release and views are refused or harmless.
    if not pending.done():
        with pytest.raises(ValueError, match="in flight"):
            slot.release()
        with pytest.raises(BufferError, match="in flight"):
            memoryview(slot)
    assert pending.wait() is slot
    slot.release()
    assert engine.free_slots() == 1
    f.close()


class _FullDisk:
    """A tier double whose writes fail as a full disk does (the error a real ENOSPC
    gives, see test_store_faults.test_full_disk), after touching the staged slot."""

    def __init__(self, inner):
        self.inner, self.name = inner, inner.name

    def __getattr__(self, name):
        return getattr(self.inner, name)

    def write(self, key, payload, layout):
        memoryview(payload).release()  # what a real write does first: look at the bytes
        raise ChunkWriteError("no space left on the device", key=key, tier=self.name)


def test_failed_save_kept_exception_pins_no_slot(tmp_path):
    engine, store, r, tokens = _setup(tmp_path, window=2)
    failing = Restorer(
        Store([_FullDisk(store.tier("L2"))]),
        LAYOUT,
        window=2,
        engine=engine,
        model="m",
        timeout_s=2.0,
    )
    src = PagedKVCache.allocate(LAYOUT, 4 * 16)
    kept = []
    try:
        failing.save(list(range(4 * 16)), src)
    except ChunkWriteError as exc:
        kept.append(exc)  # as a logging framework would: traceback and all
    assert kept and kept[0].__traceback__ is not None
    assert engine.free_slots() == 2  # the traceback's frames hold released slots only
    dest = PagedKVCache.allocate(LAYOUT, CHUNKS * 16)
    res = r.restore(r.probe(tokens), dest)
    assert res.outcome == "complete", res.reason
    _intact(store, dest, r, tokens)


class _ExtractFails:
    """Destination double: gathering chunk 1 fails (a device error, say)."""

    def __init__(self, inner: PagedKVCache) -> None:
        self.inner, self.layout = inner, inner.layout
        self.capacity_chunks = inner.capacity_chunks

    def extract(self, chunk_index: int, out: torch.Tensor) -> None:
        if chunk_index == 1:
            raise RuntimeError("injected: cannot gather chunk 1")
        self.inner.extract(chunk_index, out)

    def install(self, chunk_index: int, payload: torch.Tensor):
        return self.inner.install(chunk_index, payload)

    def synchronize(self) -> None:
        self.inner.synchronize()


def test_failed_extract_kept_exception_pins_no_slot(tmp_path):
    engine, store, r, tokens = _setup(tmp_path, window=2)
    src = _ExtractFails(PagedKVCache.allocate(LAYOUT, 4 * 16))
    with pytest.raises(RuntimeError, match="injected") as kept:
        r.save(list(range(4 * 16)), src)
    assert any("extract failed at" in n for n in kept.value.__notes__)
    assert engine.free_slots() == 2  # the kept exception holds no view of a slot
    dest = PagedKVCache.allocate(LAYOUT, CHUNKS * 16)
    assert r.restore(r.probe(tokens), dest).complete
