"""L1, L2 and L3 through the one tier interface, on real files and the real engine."""

import os
import stat
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch
from tiny_tiers import LAYOUT, REC, tier_at

from bsr_io import Engine, NoFreeSlot
from bsr_io.cli.synthetic import synthetic_chunk
from bsr_io.errors import CapacityError, ChunkCorrupt, ChunkMissing, LayoutError
from bsr_io.faults import Fault, FaultPlan
from bsr_io.model.keys import chunk_keys
from bsr_io.model.layout import preset
from bsr_io.tiers import LowerTier, MemoryTier, SSDTier


def make_tier(kind, tmp_path, engine, records=None):
    return tier_at(kind, tmp_path / kind.lower(), engine, records, layout=LAYOUT)


def payload(i):
    return synthetic_chunk(LAYOUT, 7, i)


def read_bytes(tier, key, engine):
    slot = tier.read_into(key, engine)
    assert len(slot) == LAYOUT.chunk_bytes
    return bytes(memoryview(slot).cast("B")[: LAYOUT.chunk_bytes])


KINDS = ["L1", "L2", "L3"]


@pytest.mark.parametrize("kind", KINDS)
def test_write_read_probe_remove(kind, tmp_path, engine, keys):
    tier = make_tier(kind, tmp_path, engine)
    assert tier.probe(keys) == 0
    forms = [
        lambda i: payload(i),
        lambda i: torch.from_numpy(payload(i)),
        lambda i: payload(i).tobytes(),
        lambda i: bytearray(payload(i)),
    ]
    for i in range(5):
        assert tier.write(keys[i], forms[i % len(forms)](i), LAYOUT) is True
    assert tier.write(keys[0], payload(0), LAYOUT) is False  # already held
    assert tier.probe(keys) == 5
    assert tier.probe(keys, group="window") == 5
    for i in range(5):
        assert read_bytes(tier, keys[i], engine) == payload(i).tobytes()
    assert tier.remove(keys[2]) is True
    assert tier.remove(keys[2]) is False
    assert tier.probe(keys) == 2
    with pytest.raises(ChunkMissing) as info:
        tier.read_into(keys[2], engine)
    assert info.value.key == keys[2] and info.value.tier == kind
    s = tier.stats()
    assert s["records"] == 4 and s["hits"] == 5 and s["writes"] == 5


@pytest.mark.parametrize("kind", KINDS)
def test_slot_payload_is_written_as_is(kind, tmp_path, engine, keys):
    tier = make_tier(kind, tmp_path, engine)
    slot = engine.lease()
    slot.fill_from(payload(3))
    slot.set_length(LAYOUT.chunk_bytes)
    tier.write(keys[0], slot, LAYOUT)
    del slot
    assert read_bytes(tier, keys[0], engine) == payload(3).tobytes()


@pytest.mark.parametrize("kind", KINDS)
def test_bad_payloads_store_nothing(kind, tmp_path, engine, keys):
    tier = make_tier(kind, tmp_path, engine)
    tier.write(keys[0], payload(0), LAYOUT)
    with pytest.raises(LayoutError, match=f"{LAYOUT.chunk_bytes - 1} bytes, a chunk"):
        tier.write(keys[1], payload(1)[:-1], LAYOUT)
    with pytest.raises(LayoutError, match="uint8"):
        tier.write(keys[1], torch.zeros(LAYOUT.chunk_bytes // 2, dtype=torch.float16), LAYOUT)
    with pytest.raises(LayoutError, match="uint8|buffer"):
        tier.write(keys[1], [0] * LAYOUT.chunk_bytes, LAYOUT)
    llama = preset("llama-3.1-8b")
    with pytest.raises(LayoutError, match="another layout|bytes"):
        tier.write(keys[1], payload(1), llama)
    assert tier.probe(keys) == 1
    assert read_bytes(tier, keys[0], engine) == payload(0).tobytes()
    if kind != "L1":
        files = list(tier.chunks_dir.rglob("*"))
        assert sum(p.is_file() for p in files) == 1  # no temp file left behind


@pytest.mark.parametrize("kind", KINDS)
def test_capacity_below_one_chunk(kind, tmp_path, engine):
    with pytest.raises(CapacityError, match="cannot hold one chunk"):
        if kind == "L1":
            MemoryTier(LAYOUT.chunk_bytes - 1, layout=LAYOUT)
        elif kind == "L2":
            SSDTier(tmp_path, REC - 1, engine, layout=LAYOUT)
        else:
            LowerTier(tmp_path, REC - 1, layout=LAYOUT)
    # Without a layout at construction, the first write says so.
    tier = (
        MemoryTier(100)
        if kind == "L1"
        else SSDTier(tmp_path / "x", 100, engine)
        if kind == "L2"
        else LowerTier(tmp_path / "y", 100)
    )
    key = chunk_keys(range(16), LAYOUT, "m")[0]
    with pytest.raises(CapacityError, match="cannot hold one chunk"):
        tier.write(key, payload(0), LAYOUT)
    assert tier.stats()["records"] == 0


@pytest.mark.parametrize("kind", KINDS)
def test_lru_eviction(kind, tmp_path, engine, keys):
    tier = make_tier(kind, tmp_path, engine, records=3)
    for i in range(3):
        tier.write(keys[i], payload(i), LAYOUT)
    read_bytes(tier, keys[0], engine)  # 0 becomes most recent; 1 is now the oldest
    tier.write(keys[3], payload(3), LAYOUT)
    held = [tier.contains(k) for k in keys[:4]]
    assert held == [True, False, True, True]
    s = tier.stats()
    assert s["evictions"] == 1 and s["records"] == 3 and s["bytes"] <= s["capacity"]


@pytest.mark.parametrize("kind", ["L2", "L3"])
def test_reopen_rebuilds_index_and_modes(kind, tmp_path, engine, keys):
    tier = make_tier(kind, tmp_path, engine)
    for i in range(4):
        tier.write(keys[i], payload(i), LAYOUT)
    again = make_tier(kind, tmp_path, engine)
    assert again.probe(keys) == 4 and again.stats()["records"] == 4
    assert set(again.keys()) == set(keys[:4])
    assert read_bytes(again, keys[3], engine) == payload(3).tobytes()
    for p in [tier.root, *tier.root.rglob("*")]:
        mode = stat.S_IMODE(p.stat().st_mode)
        assert mode == (0o700 if p.is_dir() else 0o600), p


@pytest.mark.parametrize("kind", ["L2", "L3"])
def test_two_instances_share_a_directory(kind, tmp_path, engine, keys):
    a = make_tier(kind, tmp_path, engine)
    b = make_tier(kind, tmp_path, engine)
    a.write(keys[0], payload(0), LAYOUT)
    assert b.probe(keys) == 1  # seen by stat, header adopted
    assert read_bytes(b, keys[0], engine) == payload(0).tobytes()
    b.remove(keys[0])
    assert a.probe(keys) == 0
    with pytest.raises(ChunkMissing):
        a.read_into(keys[0], engine)


def test_l2_eviction_during_a_read_never_gives_garbage(tmp_path, engine, keys):
    tier = make_tier("L2", tmp_path, engine, records=1)
    tier.write(keys[0], payload(0), LAYOUT)
    pending = tier.submit_read(keys[0], engine)  # file is open: unlink cannot tear it
    tier.write(keys[1], payload(1), LAYOUT)  # evicts keys[0]
    assert not tier.contains(keys[0])
    slot = pending.wait()
    assert bytes(memoryview(slot).cast("B")[: LAYOUT.chunk_bytes]) == payload(0).tobytes()
    with pytest.raises(ChunkMissing):
        tier.read_into(keys[0], engine)  # evicted before the open: a failed chunk


def test_l2_demotes_evicted_records_to_l3(tmp_path, engine, keys):
    lower = LowerTier(tmp_path / "l3")
    ssd = SSDTier(tmp_path / "l2", REC * 2, engine, evict_to=lower)
    for i in range(4):
        ssd.write(keys[i], payload(i), LAYOUT)
    assert ssd.probe(keys) == 0 and ssd.contains(keys[3])
    assert lower.probe(keys) == 2
    assert read_bytes(lower, keys[1], engine) == payload(1).tobytes()


def test_engine_slots_too_small(tmp_path, keys):
    with Engine(2, 4096) as small:
        big = preset("tiny", chunk_tokens=64)
        k = chunk_keys(range(64), big, "m")[0]
        lower = LowerTier(tmp_path)
        lower.write(k, synthetic_chunk(big, 1, 0), big)
        with pytest.raises(CapacityError, match="slot_bytes"):
            lower.read_into(k, small)
        assert lower.contains(k)


def test_temp_files_of_dead_writers_are_removed(tmp_path, engine, keys):
    tier = make_tier("L2", tmp_path, engine)
    tier.write(keys[0], payload(0), LAYOUT)
    final = tier.path_of(keys[1])
    dead = final.parent / f".{final.stem}.{_host()}.{2**22 + 12345}.abcd.tmp"
    live = final.parent / f".{final.stem}.{_host()}.{os.getpid()}.abcd.tmp"
    for p in (dead, live):
        p.write_bytes(b"half a record")
    again = make_tier("L2", tmp_path, engine)
    assert not dead.exists() and live.exists()
    assert again.probe(keys) == 1


def _host():
    from bsr_io.tiers import files

    return files._HOST


@pytest.mark.parametrize("kind", KINDS)
def test_failed_reads_give_their_slot_back(kind, tmp_path, keys):
    # One slot only: a corrupt read whose exception we keep must not hold it.
    with Engine(1, LAYOUT.chunk_bytes) as one:
        tier = make_tier(kind, tmp_path, one)
        for i in range(2):
            tier.write(keys[i], payload(i), LAYOUT)
        faulty = FaultPlan([Fault("corrupt", tier=kind, chunks=[0])]).wrap(tier)
        faulty.bind(keys)
        kept = []
        with pytest.raises(ChunkCorrupt) as info:
            faulty.read_into(keys[0], one)
        kept.append(info.value)
        assert one.free_slots() == 1
        assert read_bytes(tier, keys[1], one) == payload(1).tobytes()


@pytest.mark.parametrize("kind", KINDS)
def test_full_ring_is_not_a_chunk_error(kind, tmp_path, keys):
    with Engine(1, LAYOUT.chunk_bytes) as one:
        tier = make_tier(kind, tmp_path, one)
        tier.write(keys[0], payload(0), LAYOUT)
        held = one.lease()
        with pytest.raises(NoFreeSlot):
            tier.read_into(keys[0], one)
        del held
        assert tier.contains(keys[0])
        assert read_bytes(tier, keys[0], one) == payload(0).tobytes()


@pytest.mark.parametrize("kind", ["L2", "L3"])
def test_concurrent_writers_respect_capacity(kind, tmp_path, engine, keys):
    tier = make_tier(kind, tmp_path, engine, records=3)
    with ThreadPoolExecutor(4) as pool:
        list(pool.map(lambda i: tier.write(keys[i], payload(i), LAYOUT), range(8)))
    on_disk = list(tier.chunks_dir.rglob("*.chunk"))
    assert len(on_disk) == tier.stats()["records"] <= 3
    assert tier.stats()["bytes"] <= tier.capacity_bytes


def test_bad_record_in_a_read_only_store_is_not_advertised_again(tmp_path, engine, keys):
    tier = make_tier("L3", tmp_path, engine)
    tier.write(keys[0], payload(0), LAYOUT)
    path = tier.path_of(keys[0])
    raw = bytearray(path.read_bytes())
    raw[-5] ^= 0x10
    path.write_bytes(raw)
    # Root ignores permissions; a file where the quarantine directory should be makes
    # the move fail the way a read-only store would.
    tier.quarantine_dir.write_text("not a directory")
    with pytest.raises(ChunkCorrupt):
        tier.read_into(keys[0], engine)
    assert path.exists()  # could not be moved aside...
    assert not tier.contains(keys[0])  # ...but is no longer advertised
