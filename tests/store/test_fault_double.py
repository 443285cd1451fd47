"""The fault-injection double: each kind does what it says, through real tiers."""

import time

import pytest
from tiny_tiers import LAYOUT, tier_at

from bsr_io import Engine
from bsr_io.cli.synthetic import fill_state, synthetic_chunk
from bsr_io.errors import ChunkCorrupt, ChunkMissing, ChunkReadError, TierDown
from bsr_io.faults import Fault, FaultPlan, FaultyTier
from bsr_io.model.layout import preset
from bsr_io.store import Store
from bsr_io.tiers import LowerTier, MemoryTier, SSDTier


@pytest.fixture
def l2(tmp_path, engine):
    tier = SSDTier(tmp_path / "l2", None, engine)
    _, keys = fill_state(tier, LAYOUT, LAYOUT.chunk_tokens * 4, seed=9)
    return tier, keys


def wrapped(tier, keys, *faults, rank=0):
    t = FaultPlan(list(faults)).wrap(tier, rank)
    assert isinstance(t, FaultyTier)
    t.bind(keys)
    return t


def test_error_hits_only_the_named_chunk(l2, engine):
    tier, keys = l2
    t = wrapped(tier, keys, Fault("error", chunks={2}))
    t.read_into(keys[1], engine)
    with pytest.raises(ChunkReadError, match="injected"):
        t.read_into(keys[2], engine)
    assert t.injected == [("error", 2)]


@pytest.mark.parametrize("kind", ["L2", "L3"])
def test_corrupt_is_caught_by_the_real_checks(tmp_path, engine, kind):
    tier = tier_at(kind, tmp_path, engine)
    _, keys = fill_state(tier, LAYOUT, LAYOUT.chunk_tokens * 3, seed=1)
    t = wrapped(tier, keys, Fault("corrupt", tier=tier.name, chunks=[1]))
    with pytest.raises(ChunkCorrupt, match="checksum"):
        t.read_into(keys[1], engine)
    assert t.probe(keys) == 1  # quarantined: no longer advertised
    assert len(tier.quarantined_files()) == 1
    slot = t.read_into(keys[2], engine)
    assert bytes(memoryview(slot)) == synthetic_chunk(LAYOUT, 1, 2).tobytes()


def test_corrupt_in_memory(engine):
    tier = MemoryTier(1 << 20)
    _, keys = fill_state(tier, LAYOUT, LAYOUT.chunk_tokens * 2, seed=1)
    t = wrapped(tier, keys, Fault("corrupt", tier="L1"))
    with pytest.raises(ChunkCorrupt):
        t.read_into(keys[0], engine)
    assert not tier.contains(keys[0]) and tier.stats()["quarantined"] == 1


def test_missing_slow_and_times(l2, engine):
    tier, keys = l2
    t = wrapped(tier, keys, Fault("missing", chunks=[0]), Fault("slow", delay_s=0.05, times=1))
    start = time.monotonic()
    t.read_into(keys[1], engine)
    assert time.monotonic() - start >= 0.05
    start = time.monotonic()
    t.read_into(keys[2], engine)
    assert time.monotonic() - start < 0.05  # `times=1` spent
    with pytest.raises(ChunkMissing):
        t.read_into(keys[0], engine)
    assert not tier.contains(keys[0])


def test_down(l2, engine):
    tier, keys = l2
    everywhere = wrapped(tier, keys, Fault("down"))
    with pytest.raises(TierDown):
        everywhere.probe(keys)
    midway = wrapped(tier, keys, Fault("down", chunks=[3]))
    assert midway.probe(keys) == 4
    with pytest.raises(TierDown):
        midway.read_into(keys[3], engine)
    store = Store([everywhere, LowerTier(tier.root.parent / "l3")])
    assert store.probe(keys) == 0  # a down tier holds nothing for discovery


def test_group_missing_only_affects_that_group(l2):
    tier, keys = l2
    t = FaultPlan([Fault("group_missing", chunks=[2], groups=["window"])]).wrap(tier)
    assert t.probe(keys, group="window") == 2  # probing the list binds positions
    assert t.probe(keys, group="full") == 4
    assert t.probe(keys) == 4


def test_ranks_select_who_gets_the_fault(l2):
    tier, _ = l2
    plan = FaultPlan([Fault("error", ranks=[1])])
    assert plan.wrap(tier, rank=0) is tier
    assert isinstance(plan.wrap(tier, rank=1), FaultyTier)
    assert plan.wrap(MemoryTier(1 << 20), rank=1).name == "L1"  # not named: not wrapped


def test_plan_json_and_env(tmp_path, monkeypatch):
    plan = FaultPlan(
        [Fault("slow", tier="L3", delay_s=0.5), Fault("group_missing", chunks=[1, 3], groups="g")]
    )
    assert FaultPlan.from_json(plan.to_json()) == plan
    monkeypatch.setenv("BSR_IO_FAULTS", plan.to_json())
    assert FaultPlan.from_env() == plan
    path = tmp_path / "plan.json"
    path.write_text('{"faults": [{"kind": "down", "tier": "L2"}]}')
    monkeypatch.setenv("BSR_IO_FAULTS", f"@{path}")
    assert FaultPlan.from_env().faults == [Fault("down")]
    monkeypatch.delenv("BSR_IO_FAULTS")
    assert FaultPlan.from_env().faults == []
    for bad, msg in [
        ('[{"kind": "explode"}]', "unknown fault kind"),
        ('[{"kind": "error", "bogus": 1}]', "bad fault"),
        ('"x"', "JSON list"),
        ('[{"kind": "group_missing"}]', "needs `groups`"),
    ]:
        with pytest.raises(ValueError, match=msg):
            FaultPlan.from_json(bad)


def test_discovery_places_faults_through_the_tier_interface(l2):
    """Discovery hands each tier the request's keys (`prepare_probe`, public Tier
    interface), so a group_missing fault at chunk 2 cuts that group's hit there with no
    bind(); control: the same wrapped tier, never told the keys, cannot place it."""
    from bsr_io.load.discovery import discover

    tier, keys = l2
    fault = Fault("group_missing", chunks=[2], groups=["window"])
    blind = FaultPlan([fault]).wrap(tier)
    assert blind.contains(keys[2], "window")  # unplaced: the fault does not fire
    sources, group_hits = discover([FaultPlan([fault]).wrap(tier)], keys, LAYOUT)
    assert sources == [0, 0]
    assert group_hits == {"full": 4, "window": 2, "state": 4}


# -- the path a host restore takes: reads straight into the cache's blocks ----------------
DSV4 = preset("deepseek-v4-flash")
IN_PLACE_CHUNKS = 4


@pytest.fixture(scope="module")
def dsv4_store(tmp_path_factory):
    """deepseek-v4-flash records (16 MiB chunks), read in place into a host cache."""
    root = tmp_path_factory.mktemp("dsv4")
    with Engine(2, DSV4.chunk_bytes) as eng:
        tier = SSDTier(root / "l2", None, eng)
        tokens, _ = fill_state(tier, DSV4, DSV4.chunk_tokens * IN_PLACE_CHUNKS, seed=3, model="m")
    return root / "l2", tokens


def _restore_in_place(l2_dir, tokens, *faults, timeout_s=60.0):
    """(result, faults injected) of a restore of the whole prefix into a host cache,
    with `faults` on L2, within `timeout_s` (long but for the faults that are about
    the deadline: a short one, reached on a loaded machine before the faulty chunk is
    even asked for, would end the restore zero with nothing injected)."""
    from bsr_io import PagedKVCache, Restorer
    from bsr_io.model.keys import chunk_keys

    with Engine(2, DSV4.chunk_bytes) as engine:
        tier = SSDTier(l2_dir, None, engine)
        # Put back what an earlier fault removed or quarantined (the others are kept).
        fill_state(tier, DSV4, len(tokens), seed=3, model="m")
        keys = chunk_keys(tokens, DSV4, "m")
        faulty = FaultPlan(list(faults)).wrap(tier, keys=keys) if faults else tier
        r = Restorer(Store([faulty]), DSV4, engine=engine, model="m", timeout_s=timeout_s)
        plan = r.probe(tokens)
        assert plan.hit_chunks == IN_PLACE_CHUNKS
        dest = PagedKVCache.allocate(DSV4, plan.hit_tokens)
        res = r.restore(plan, dest)
        injected = len(faulty.injected) if isinstance(faulty, FaultyTier) else 0
        ok = all(
            dest.chunk_bytes(i) == synthetic_chunk(DSV4, 3, i).tobytes()
            for i in range(IN_PLACE_CHUNKS)
        )
        return res, injected, ok


def test_a_host_cache_is_read_in_place_without_faults(dsv4_store):
    """Control: the restore is complete, every chunk read straight into the blocks."""
    res, injected, ok = _restore_in_place(*dsv4_store)
    assert res.outcome == "complete" and ok and injected == 0
    assert res.timings["direct_chunks"] == IN_PLACE_CHUNKS


@pytest.mark.parametrize(
    "fault",
    [
        Fault("error", chunks={2}),
        Fault("slow", chunks={1}, delay_s=5.0),
        Fault("hang", chunks={1}, delay_s=6.0),
        Fault("down", chunks={2}),
        Fault("corrupt", chunks={3}),
        Fault("missing", chunks={2}),
    ],
    ids=lambda f: f.kind,
)
def test_each_fault_fires_on_reads_into_the_cache(dsv4_store, fault):
    """Each kind fires where a host restore reads straight into the cache's blocks (the
    double wraps `submit_read_into` too): the restore that is complete without it ends
    zero, and the double counts what it injected."""
    # "slow" (5 s) and "hang" (6 s) end the restore by its deadline (3 s).
    timeout_s = 3.0 if fault.kind in ("slow", "hang") else 60.0
    res, injected, _ = _restore_in_place(*dsv4_store, fault, timeout_s=timeout_s)
    assert injected >= 1, res
    assert res.outcome == "zero", res
