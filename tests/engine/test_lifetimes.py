"""A slot is never refilled while a numpy array or torch tensor views it; accounting
of live staging bytes is exact, also under concurrent leases."""

from __future__ import annotations

import gc
import threading
from pathlib import Path

import numpy as np
import pytest
import torch

from bsr_io import Engine, NoFreeSlot, as_numpy, as_tensor

SLOT = 64 * 1024


@pytest.fixture
def two_files(tmp_path: Path) -> tuple[Path, Path]:
    a, b = tmp_path / "a", tmp_path / "b"
    a.write_bytes(bytes([0xAA]) * SLOT)
    b.write_bytes(bytes([0xBB]) * SLOT)
    return a, b


def _fill_all_other_slots(eng: Engine, path: Path) -> list:
    f = eng.open(path)
    held = []
    while eng.free_slots():
        held.append(eng.read(f, 0, SLOT))
    with pytest.raises(NoFreeSlot) as exc:
        eng.submit_read(f, 0, SLOT)
    assert exc.value.errno == 11  # EAGAIN
    return held


@pytest.mark.parametrize("kind", ["numpy", "torch", "torch_typed", "memoryview"])
def test_view_keeps_slot(backend: str, two_files: tuple[Path, Path], kind: str) -> None:
    a, b = two_files
    eng = Engine(3, SLOT, backend=backend)
    slot = eng.read(eng.open(a), 0, SLOT)
    index = slot.index
    if kind == "numpy":
        view = as_numpy(slot)
    elif kind == "torch":
        view = as_tensor(slot)
    elif kind == "torch_typed":
        view = as_tensor(slot, dtype=torch.int32)
    else:
        view = memoryview(slot)
    del slot
    gc.collect()
    # The view alone holds the slot: still live, not free.
    assert eng.live_bytes() == eng.slot_bytes
    assert eng.free_slots() == 2
    others = _fill_all_other_slots(eng, b)
    assert all(s.index != index for s in others)
    assert all(bytes(s) == bytes([0xBB]) * SLOT for s in others)
    raw = bytes(view.numpy().tobytes() if isinstance(view, torch.Tensor) else view)
    assert raw == bytes([0xAA]) * SLOT
    del others
    gc.collect()
    assert eng.free_slots() == 2
    del view
    gc.collect()
    assert eng.free_slots() == 3 and eng.live_bytes() == 0


def test_derived_views_keep_slot(backend: str, two_files: tuple[Path, Path]) -> None:
    a, _ = two_files
    eng = Engine(1, SLOT, backend=backend)
    slot = eng.read(eng.open(a), 0, SLOT)
    t = as_tensor(slot)[100:200].view(torch.int16)
    n = as_numpy(slot, np.uint32)[5:10]
    del slot
    gc.collect()
    assert eng.free_slots() == 0
    del t
    gc.collect()
    assert eng.free_slots() == 0
    del n
    gc.collect()
    assert eng.free_slots() == 1


def test_views_survive_engine_close(two_files: tuple[Path, Path]) -> None:
    a, _ = two_files
    eng = Engine(1, SLOT)
    arr = as_numpy(eng.read(eng.open(a), 0, SLOT))
    eng.close()
    del eng
    gc.collect()
    # The mapping lives on until the last view goes.
    assert int(arr.sum()) == 0xAA * SLOT


def test_write_in_flight_keeps_slot(backend: str, tmp_path: Path) -> None:
    eng = Engine(1, 1 << 20, backend=backend)
    f = eng.open(tmp_path / "w", create=True)
    slot = eng.lease()
    slot.fill_from(b"z" * (1 << 20))
    pending = eng.submit_write(slot, f, 0)
    del slot
    gc.collect()
    # Either still in flight (slot owned by the write) or done and held by Pending.
    s = pending.wait()
    assert eng.free_slots() == 0
    del s, pending
    gc.collect()
    assert eng.free_slots() == 1
    assert (tmp_path / "w").read_bytes() == b"z" * (1 << 20)


def test_pending_does_not_pin_slot(backend: str, two_files: tuple[Path, Path]) -> None:
    a, _ = two_files
    eng = Engine(1, SLOT, backend=backend)
    p = eng.submit_read(eng.open(a), 0, SLOT)
    s = p.wait()
    assert p.wait() is s  # same object while it lives
    del s
    gc.collect()
    assert eng.free_slots() == 1
    with pytest.raises(ValueError, match="already released"):
        p.wait()


def test_unwaited_pending_frees_slot(backend: str, two_files: tuple[Path, Path]) -> None:
    a, _ = two_files
    eng = Engine(2, SLOT, backend=backend)
    f = eng.open(a)
    p = eng.submit_read(f, 0, SLOT)
    while not p.done():
        pass
    del p
    gc.collect()
    assert eng.free_slots() == 2 and eng.live_bytes() == 0


def test_accounting_exact_under_concurrent_leases(backend: str, tmp_path: Path) -> None:
    window, threads, rounds = 6, 6, 200
    (tmp_path / "f").write_bytes(b"q" * SLOT)
    eng = Engine(window, SLOT, backend=backend)
    f = eng.open(tmp_path / "f")
    barrier = threading.Barrier(threads)
    seen: list[int] = []
    errors: list[BaseException] = []

    def worker(k: int) -> None:
        try:
            for i in range(rounds):
                s = eng.lease() if (i + k) % 2 else eng.read(f, 0, SLOT)
                seen.append(eng.live_bytes())
                del s
            barrier.wait()
            held = eng.lease()  # every thread holds one at once
            barrier.wait()
            seen.append(eng.live_bytes())
            barrier.wait()
            del held
        except BaseException as exc:  # reported below
            errors.append(exc)

    ts = [threading.Thread(target=worker, args=(k,)) for k in range(threads)]
    for t in ts:
        t.start()
    for t in ts:
        t.join()
    assert not errors
    assert all(v % eng.slot_bytes == 0 for v in seen)
    assert seen[-threads:] == [threads * eng.slot_bytes] * threads
    assert eng.peak_bytes() == threads * eng.slot_bytes
    assert eng.live_bytes() == 0 and eng.free_slots() == window
    eng.reset_peak()
    assert eng.peak_bytes() == 0
