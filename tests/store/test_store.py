"""The store: tiers in order behind one interface; synthetic fill."""

import numpy as np
import pytest
from tiny_tiers import LAYOUT, REC

from bsr_io.cli.synthetic import fill_state, synthetic_chunk, synthetic_tokens
from bsr_io.errors import ChunkCorrupt, ChunkMissing
from bsr_io.model.keys import chunk_keys
from bsr_io.model.record import HEADER_BYTES
from bsr_io.store import Store, open_store
from bsr_io.tiers import LowerTier, MemoryTier


def chunk_of(slot):
    return bytes(memoryview(slot)[: LAYOUT.chunk_bytes])


def test_sources_follow_tier_order(tmp_path, engine):
    store = open_store(
        engine,
        tmp_path / "l2",
        layout=LAYOUT,
        l1_bytes=LAYOUT.chunk_bytes * 2,
        ssd_bytes=REC * 4,
        lower_dir=tmp_path / "l3",
    )
    token_ids, keys = fill_state(store, LAYOUT, LAYOUT.chunk_tokens * 8 + 3, seed=5)
    assert len(keys) == 8
    # Written through: L1 keeps the last 2, L2 the last 4, L3 all 8.
    assert store.source_of(keys) == [2, 2, 2, 2, 1, 1, 0, 0]
    assert store.probe(keys) == 8
    for i, key in enumerate(keys):
        assert chunk_of(store.read_into(key, engine)) == synthetic_chunk(LAYOUT, 5, i).tobytes()
    assert store.stats()["tiers"][2]["records"] == 8


def test_write_not_through_stays_in_first_tier(tmp_path, engine):
    store = Store([MemoryTier(REC * 8), LowerTier(tmp_path)])
    key = chunk_keys(range(16), LAYOUT, "m")[0]
    store.write(key, synthetic_chunk(LAYOUT, 0, 0), LAYOUT, through=False)
    assert store.source_of([key]) == [0] and not store.tiers[1].contains(key)


def test_corrupt_copy_falls_back_to_the_next_tier(tmp_path, engine):
    store = open_store(engine, tmp_path / "l2", lower_dir=tmp_path / "l3")
    _, keys = fill_state(store, LAYOUT, LAYOUT.chunk_tokens * 2, seed=1)
    l2 = store.tiers[0]
    path = l2.path_of(keys[1])
    raw = bytearray(path.read_bytes())
    raw[HEADER_BYTES + 100] ^= 1
    path.write_bytes(raw)
    slot = store.read_into(keys[1], engine)
    assert chunk_of(slot) == synthetic_chunk(LAYOUT, 1, 1).tobytes()
    assert store.source_of(keys) == [0, 1]  # the bad L2 copy is no longer advertised
    assert l2.stats()["quarantined"] == 1
    store.tiers[1].remove(keys[1])
    with pytest.raises(ChunkMissing):
        store.read_into(keys[1], engine)


def test_store_read_reports_every_tier_when_all_copies_are_bad(tmp_path, engine):
    store = open_store(engine, tmp_path / "l2", lower_dir=tmp_path / "l3")
    _, keys = fill_state(store, LAYOUT, LAYOUT.chunk_tokens, seed=2)
    for tier in store.tiers:
        path = tier.path_of(keys[0])
        raw = bytearray(path.read_bytes())
        raw[-1] ^= 0xFF
        path.write_bytes(raw)
    with pytest.raises(ChunkCorrupt, match="L2.*L3"):
        store.read_into(keys[0], engine)
    assert store.probe(keys) == 0


def test_fill_is_deterministic(tmp_path):
    a = synthetic_tokens(3, 100)
    assert np.array_equal(a, synthetic_tokens(3, 100))
    assert not np.array_equal(a, synthetic_tokens(4, 100))
    assert (
        synthetic_chunk(LAYOUT, 3, 0).tobytes() != synthetic_chunk(LAYOUT, 3, 0, rank=1).tobytes()
    )
    l3 = LowerTier(tmp_path)
    ids, keys = fill_state(l3, LAYOUT, 40, seed=3, rank=1, world_size=2, model="x")
    assert np.array_equal(ids, a[:40]) and len(keys) == 2
    assert keys == chunk_keys(ids, LAYOUT, "x", rank=1, world_size=2)


def test_store_needs_distinct_tiers():
    with pytest.raises(ValueError, match="at least one"):
        Store([])
    with pytest.raises(ValueError, match="unique"):
        Store([MemoryTier(REC), MemoryTier(REC)])


def test_l2_evictions_are_demoted_to_l3(tmp_path, engine):
    store = open_store(engine, tmp_path / "l2", ssd_bytes=REC * 2, lower_dir=tmp_path / "l3")
    keys = chunk_keys(range(LAYOUT.chunk_tokens * 5), LAYOUT, "m")
    for i, key in enumerate(keys):
        store.write(key, synthetic_chunk(LAYOUT, 8, i), LAYOUT, through=False)
    assert store.source_of(keys) == [1, 1, 1, 0, 0]
    for i, key in enumerate(keys):
        assert chunk_of(store.read_into(key, engine)) == synthetic_chunk(LAYOUT, 8, i).tobytes()
    assert store.tiers[0].stats()["evictions"] == 3
