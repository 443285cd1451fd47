"""L2 striped over several directories (one per drive): placement, per-drive capacity,
refusals at start, and a failing drive at restore (fallback, no quarantine)."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest

from bsr_io import Engine
from bsr_io.cli.synthetic import fill_state, synthetic_chunk
from bsr_io.errors import CapacityError, TierDown
from bsr_io.faults import Fault, FaultPlan
from bsr_io.load.kvcache import PagedKVCache
from bsr_io.model.layout import preset
from bsr_io.model.record import HEADER_BYTES
from bsr_io.restore import Restorer
from bsr_io.store import Store, open_store
from bsr_io.tiers import LowerTier, StripedSSDTier

LAYOUT = preset("tiny")
CHUNKS = 24
RECORD = HEADER_BYTES + LAYOUT.chunk_bytes


def _drives(tmp_path: Path, n: int = 2) -> list[Path]:
    dirs = [tmp_path / f"drive{i}" for i in range(n)]
    for d in dirs:
        d.mkdir()
    return dirs


def _setup(tmp_path: Path, engine: Engine, *, lower: bool = True, recheck_s: float = 30.0):
    l2 = StripedSSDTier(_drives(tmp_path), None, engine, layout=LAYOUT, recheck_s=recheck_s)
    tiers = [l2]
    if lower:
        tiers.append(LowerTier(tmp_path / "l3", layout=LAYOUT))
    store = Store(tiers)
    for t in tiers:
        tokens, keys = fill_state(t, LAYOUT, CHUNKS * LAYOUT.chunk_tokens, seed=7, model="m")
    return l2, store, tokens, keys


def _restore(store: Store, engine: Engine, tokens):
    r = Restorer(store, LAYOUT, window=4, engine=engine, model="m")
    plan = r.probe(tokens)
    dest = PagedKVCache.allocate(LAYOUT, CHUNKS * LAYOUT.chunk_tokens)
    return plan, r, dest


def _bytes_ok(dest: PagedKVCache) -> bool:
    return all(
        dest.chunk_bytes(i) == synthetic_chunk(LAYOUT, 7, i).tobytes() for i in range(CHUNKS)
    )


def test_chunks_are_placed_by_key_on_every_drive_and_restore(tmp_path: Path) -> None:
    engine = Engine(4, LAYOUT.chunk_bytes)
    l2, store, tokens, keys = _setup(tmp_path, engine, lower=False)
    per = [0, 0]
    for k in keys:
        d = l2.drive_of(k)
        per[d] += 1
        assert l2.path_of(k).is_relative_to(l2.roots[d]) and l2.path_of(k).is_file()
        assert not l2.drives[1 - d].contains(k), "a chunk lives on its own drive only"
    assert min(per) > 0, f"every drive holds chunks: {per}"
    assert [s["records"] for s in l2.stats()["drives"]] == per
    plan, r, dest = _restore(store, engine, tokens)
    assert plan.hit_chunks == CHUNKS
    res = r.restore(plan, dest)
    assert res.outcome == "complete", res.reason
    assert res.source_tiers == ["L2"] * CHUNKS and _bytes_ok(dest)
    assert res.rws_peak_bytes <= 4 * engine.slot_bytes


def test_open_store_stripes_a_list_of_directories(tmp_path: Path) -> None:
    engine = Engine(2, LAYOUT.chunk_bytes)
    store = open_store(engine, _drives(tmp_path, 3), layout=LAYOUT)
    l2 = store.tier("L2")
    assert isinstance(l2, StripedSSDTier) and len(l2.drives) == 3


def test_capacity_and_eviction_are_per_directory(tmp_path: Path) -> None:
    engine = Engine(2, LAYOUT.chunk_bytes)
    l2 = StripedSSDTier(_drives(tmp_path), 3 * RECORD, engine, layout=LAYOUT)
    _, keys = fill_state(l2, LAYOUT, CHUNKS * LAYOUT.chunk_tokens, seed=7, model="m")
    per = l2.stats()["drives"]
    assert [s["records"] for s in per] == [3, 3]
    placed = [sum(l2.drive_of(k) == d for k in keys) for d in (0, 1)]
    assert [s["evictions"] for s in per] == [n - 3 for n in placed]
    # The newest chunks of each drive survive.
    for d in (0, 1):
        mine = [k for k in keys if l2.drive_of(k) == d]
        assert set(l2.drives[d].keys()) == set(mine[-3:])


def test_a_missing_or_unusable_directory_is_refused_at_start(tmp_path: Path) -> None:
    engine = Engine(1, LAYOUT.chunk_bytes)
    ok = _drives(tmp_path, 1)[0]
    gone = tmp_path / "not-mounted"
    with pytest.raises(TierDown, match="not-mounted does not exist"):
        StripedSSDTier([ok, gone], None, engine, layout=LAYOUT)
    assert not gone.exists(), "a missing drive directory is never created"
    (tmp_path / "file").write_bytes(b"x")
    with pytest.raises(TierDown, match="is not a directory"):
        StripedSSDTier([ok, tmp_path / "file"], None, engine, layout=LAYOUT)
    with pytest.raises(ValueError, match="listed twice"):
        StripedSSDTier([ok, ok], None, engine, layout=LAYOUT)
    with pytest.raises(ValueError, match="2 capacities for 1"):
        StripedSSDTier([ok], [RECORD, RECORD], engine, layout=LAYOUT)
    free = os.statvfs(ok).f_bavail * os.statvfs(ok).f_frsize
    with pytest.raises(CapacityError, match="exceeds its"):
        StripedSSDTier([ok], free + (1 << 40), engine, layout=LAYOUT)
    # Control: the same directory with a capacity it can hold is taken.
    StripedSSDTier([ok], 4 * RECORD, engine, layout=LAYOUT)


@pytest.mark.skipif(os.geteuid() != 0, reason="mounting a small tmpfs needs root")
def test_a_full_drive_is_refused_at_start(tmp_path: Path) -> None:
    engine = Engine(1, LAYOUT.chunk_bytes)
    mnt = tmp_path / "small"
    mnt.mkdir()
    out = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", "size=1m", "none", str(mnt)], capture_output=True, text=True
    )
    if out.returncode != 0:
        pytest.skip(f"cannot mount tmpfs: {out.stderr.strip()}")
    try:
        filler = mnt / "filler"
        fd = os.open(filler, os.O_WRONLY | os.O_CREAT, 0o600)
        try:
            while os.write(fd, b"\0" * 4096):
                pass
        except OSError:
            pass  # ENOSPC: the drive is full
        finally:
            os.close(fd)
        with pytest.raises(CapacityError, match="is full"):
            StripedSSDTier([mnt], None, engine, layout=LAYOUT)
        filler.unlink()  # control: with room again it is taken
        StripedSSDTier([mnt], None, engine, layout=LAYOUT)
    finally:
        subprocess.run(["umount", str(mnt)], capture_output=True)


def test_a_vanished_drive_falls_back_to_the_lower_tier_without_quarantine(
    tmp_path: Path,
) -> None:
    engine = Engine(4, LAYOUT.chunk_bytes)
    l2, store, tokens, keys = _setup(tmp_path, engine)
    plan, r, dest = _restore(store, engine, tokens)
    assert plan.source_names() == ["L2"] * CHUNKS
    # Drive 1 disappears between the plan and the restore (unmounted, pulled).
    gone = l2.roots[1]
    gone.rename(tmp_path / "unplugged")
    res = r.restore(plan, dest)
    assert res.outcome == "complete", res.reason
    assert _bytes_ok(dest)
    on_1 = [i for i, k in enumerate(keys) if l2.drive_of(k) == 1]
    assert [i for i, s in enumerate(res.source_tiers) if s == "L3"] == on_1
    assert l2.failing_drives().keys() == {str(gone)}
    assert l2.quarantined_files() == []
    # Control: the drive back and its recheck due, its chunks come from L2 again, all
    # of its records intact (nothing was moved aside).
    (tmp_path / "unplugged").rename(gone)
    l2.recheck_s = 0.0
    plan, r, dest = _restore(store, engine, tokens)
    assert plan.source_names() == ["L2"] * CHUNKS
    res = r.restore(plan, dest)
    assert res.source_tiers == ["L2"] * CHUNKS and _bytes_ok(dest)


def test_an_io_error_on_one_drive_falls_back_and_leaves_the_drive_out(tmp_path: Path) -> None:
    engine = Engine(4, LAYOUT.chunk_bytes)
    l2, store, tokens, keys = _setup(tmp_path, engine)
    plan, r, dest = _restore(store, engine, tokens)
    # Test double (bsr_io/faults.py): every read of drive 1 raises an I/O error, as a
    # dying drive's EIO would; this kernel has no device-mapper to fail a real one.
    l2.drives[1] = FaultPlan([Fault("error", tier="L2[1]")]).wrap(l2.drives[1])
    res = r.restore(plan, dest)
    assert res.outcome == "complete", res.reason
    on_1 = {i for i, k in enumerate(keys) if l2.drive_of(k) == 1}
    assert {i for i, s in enumerate(res.source_tiers) if s == "L3"} == on_1
    # Only the first failed read reached the drive; later ones were refused at once.
    assert len(res.fallbacks) == len(on_1)
    assert sum("is failing" in c for f in res.fallbacks for c in f["causes"]) >= len(on_1) - 4
    assert l2.quarantined_files() == [] and all(l2.path_of(keys[i]).is_file() for i in on_1)
    # Discovery leaves the failing drive out: the next plan takes its chunks from L3.
    plan2 = r.probe(tokens)
    assert [plan2.source_names()[i] for i in sorted(on_1)] == ["L3"] * len(on_1)


def test_a_corrupt_record_is_quarantined_on_its_drive_only(tmp_path: Path) -> None:
    engine = Engine(4, LAYOUT.chunk_bytes)
    l2, store, tokens, keys = _setup(tmp_path, engine)
    victim = next(i for i, k in enumerate(keys) if l2.drive_of(k) == 1)
    path = l2.path_of(keys[victim])
    fd = os.open(path, os.O_RDWR)
    try:  # flip a payload byte for real: the fused check after the install must catch it
        (b,) = os.pread(fd, 1, HEADER_BYTES + 3)
        os.pwrite(fd, bytes([b ^ 0xFF]), HEADER_BYTES + 3)
    finally:
        os.close(fd)
    plan, r, dest = _restore(store, engine, tokens)
    res = r.restore(plan, dest)
    assert res.outcome == "complete", res.reason
    assert [f["chunk"] for f in res.fallbacks] == [victim] and _bytes_ok(dest)
    assert len(l2.quarantined_files()) == 1
    assert l2.quarantined_files()[0].is_relative_to(l2.roots[1])
    assert l2.failing_drives() == {}, "a bad record is not a bad drive"
    assert res.source_tiers.count("L3") == 1
