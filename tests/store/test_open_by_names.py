"""Opening a store reads no record's header: the scan learns names (and, with a
capacity, one stat each), and a record's header is read and checked at its first use.
Real files, real engine, real restores. Header reads are counted by wrapping the real
decoder every header read goes through; bad records are forged
on purpose."""

from __future__ import annotations

import os

import pytest
from tiny_tiers import LAYOUT, REC

from bsr_io import PagedKVCache, Restorer, open_store
from bsr_io.cli.synthetic import fill_state, synthetic_chunk
from bsr_io.errors import ChunkCorrupt
from bsr_io.tiers import LowerTier, SSDTier
from bsr_io.tiers.files import records
from bsr_io.tiers.files import tier as tier_module


@pytest.fixture
def header_reads(monkeypatch):
    """How many record headers were decoded (the real decoder, counted where the
    header reads and the reads' own checks call it)."""
    calls = [0]
    real = records.decode_header

    def counted(raw):
        calls[0] += 1
        return real(raw)

    monkeypatch.setattr(records, "decode_header", counted)
    monkeypatch.setattr(tier_module, "decode_header", counted)
    return calls


def _write(tier, keys, n):
    for i in range(n):
        tier.write(keys[i], synthetic_chunk(LAYOUT, 7, i), LAYOUT)


def _age(tier, keys):
    """Give the records distinct ages, keys[0] the oldest, whatever the clock did."""
    for i, k in enumerate(keys):
        t = 1_700_000_000 + i
        os.utime(tier.path_of(k), (t, t))


def _garble(path):
    with open(path, "r+b") as f:
        f.write(b"not a record header")


@pytest.mark.parametrize("capacity", [None, 64 * REC])
def test_opening_a_store_reads_no_record_header(tmp_path, engine, keys, header_reads, capacity):
    _write(SSDTier(tmp_path, None, engine, layout=LAYOUT), keys, 6)
    _garble(SSDTier(tmp_path, None, engine).path_of(keys[5]))
    header_reads[0] = 0
    tier = SSDTier(tmp_path, capacity, engine, layout=LAYOUT)
    assert header_reads[0] == 0
    s = tier.stats()
    assert (s["records"], s["unverified"]) == (6, 6)
    assert s["bytes"] == (6 * REC if capacity else 0)  # sizes from one stat each
    assert tier.quarantined_files() == [] and tier.problems == []  # not touched yet
    assert tier.probe(keys) == 5  # the first use reads the headers, and finds the bad one
    assert header_reads[0] == 6
    assert len(tier.quarantined_files()) == 1
    assert tier.stats()["unverified"] == 0


def test_a_bad_record_found_at_first_use_is_quarantined_and_a_miss(tmp_path, engine):
    store = open_store(engine, tmp_path / "l2", layout=LAYOUT)
    tokens, ks = fill_state(store.tier("L2"), LAYOUT, 6 * LAYOUT.chunk_tokens, seed=7, model="m")
    store.close()
    bad = store.tier("L2").path_of(ks[3])
    _garble(bad)
    store = open_store(engine, tmp_path / "l2", layout=LAYOUT)
    l2 = store.tier("L2")
    assert bad.exists() and l2.quarantined_files() == []  # the open read no header
    r = Restorer(store, LAYOUT, engine=engine, model="m", timeout_s=10)
    plan = r.probe(tokens)
    assert plan.hit_chunks == 3  # the prefix ends before the bad record: a miss there
    assert not bad.exists() and len(l2.quarantined_files()) == 1
    assert "unreadable header" in l2.problems[0].reason
    res = r.restore(plan, PagedKVCache.allocate(LAYOUT, plan.hit_tokens))
    assert res.outcome == "complete", res.reason
    # Found by a read instead (no probe first): quarantined too, a ChunkError, no crash.
    _garble(l2.path_of(ks[4]))
    again = SSDTier(tmp_path / "l2", None, engine, layout=LAYOUT)
    with pytest.raises(ChunkCorrupt, match="quarantined"):
        again.read_into(ks[4], engine)
    assert not again.contains(ks[4]) and len(again.quarantined_files()) == 2
    store.close()


def test_capacity_and_eviction_count_records_not_checked_yet(tmp_path, engine, keys, header_reads):
    _write(SSDTier(tmp_path, None, engine, layout=LAYOUT), keys, 4)
    first = SSDTier(tmp_path, None, engine)
    os.truncate(first.path_of(keys[2]), REC // 2)  # torn: counts its file's size
    _age(first, keys[:4])
    header_reads[0] = 0
    tier = SSDTier(tmp_path, 4 * REC, engine, layout=LAYOUT)
    assert tier.stats()["bytes"] == 3 * REC + REC // 2
    tier.read_into(keys[0], engine)  # a use: keys[0] is now the newest, checked
    assert header_reads[0] == 1
    tier.write(keys[4], synthetic_chunk(LAYOUT, 7, 4), LAYOUT)  # evicts keys[1], unread
    assert header_reads[0] == 1  # an eviction without a lower tier reads nothing
    assert not tier.path_of(keys[1]).exists()
    s = tier.stats()
    assert s["evictions"] == 1 and s["bytes"] == 3 * REC + REC // 2 <= s["capacity"]
    tier.write(keys[5], synthetic_chunk(LAYOUT, 7, 5), LAYOUT)  # evicts the torn keys[2]
    assert [tier.path_of(k).exists() for k in keys[:6]] == [True, False, False] + [True] * 3
    assert tier.stats()["bytes"] == 4 * REC and tier.stats()["unverified"] == 1
    assert tier.keys() == [keys[3], keys[0], keys[4], keys[5]]  # LRU order, oldest first


def test_an_unchecked_record_evicted_to_a_lower_tier_is_checked_first(tmp_path, engine, keys):
    _write(SSDTier(tmp_path / "l2", None, engine, layout=LAYOUT), keys, 3)
    first = SSDTier(tmp_path / "l2", None, engine)
    _garble(first.path_of(keys[0]))
    _age(first, keys[:3])
    lower = LowerTier(tmp_path / "l3")
    tier = SSDTier(tmp_path / "l2", 3 * REC, engine, evict_to=lower)
    tier.write(keys[3], synthetic_chunk(LAYOUT, 7, 3), LAYOUT)  # evicts the bad keys[0]
    tier.write(keys[4], synthetic_chunk(LAYOUT, 7, 4), LAYOUT)  # evicts keys[1]
    assert lower.probe(keys) == 0 and lower.contains(keys[1])  # demoted after its check
    assert len(tier.quarantined_files()) == 1  # the bad one quarantined, not demoted
    assert tier.stats()["bytes"] == 3 * REC


def test_keys_of_a_store_without_capacity_come_oldest_first(tmp_path, engine, keys):
    _write(LowerTier(tmp_path, None, layout=LAYOUT), keys, 5)
    order = [keys[3], keys[0], keys[4], keys[1], keys[2]]
    _age(LowerTier(tmp_path), order)
    tier = LowerTier(tmp_path)  # no capacity: the scan stats nothing
    assert tier.stats()["unverified"] == 5
    assert tier.keys() == order  # ages learned at the check
    assert [h.key for h in tier.headers()] == order
