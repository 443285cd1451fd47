"""The one whole-plan baseline: LMCache-like reads (buffered readinto threads into a
resident pool) and the control that reads through BSR's engine; both stage the whole
hit, install the same bytes, and honour injected faults."""

from __future__ import annotations

import pytest

from bsr_io import Engine
from bsr_io.cli.synthetic import fill_state, synthetic_chunk
from bsr_io.cli.whole_plan import WholePlanRestorer
from bsr_io.faults import Fault, FaultPlan
from bsr_io.load.kvcache import PagedKVCache
from bsr_io.model.layout import preset
from bsr_io.restore import Restorer
from bsr_io.store import open_store

LAYOUT = preset("tiny")
CHUNKS = 9


@pytest.fixture
def state(tmp_path):
    engine = Engine(3, LAYOUT.chunk_bytes)
    store = open_store(engine, tmp_path / "l2", layout=LAYOUT)
    tokens, keys = fill_state(store.tier("L2"), LAYOUT, CHUNKS * 16, seed=4, model="m")
    plan = Restorer(store, LAYOUT, window=3, engine=engine, model="m").probe(tokens)
    return engine, store, plan, keys


@pytest.mark.parametrize("reads", ["lmcache", "engine"])
def test_both_reads_stage_the_whole_hit_and_install_the_same_bytes(state, reads):
    engine, store, plan, _ = state
    need = CHUNKS * LAYOUT.chunk_bytes
    wp = WholePlanRestorer(store, LAYOUT, l1_bytes=need, engine=engine, reads=reads)
    seen = []
    wp.on_chunk = seen.append
    dest = PagedKVCache.allocate(LAYOUT, plan.hit_tokens)
    res = wp.restore(plan, dest)
    assert res.complete and res.rws_peak_bytes == need == wp.pool.numel()
    assert seen == list(range(CHUNKS))
    for i in range(CHUNKS):
        assert dest.chunk_bytes(i) == synthetic_chunk(LAYOUT, 4, i).tobytes()
    assert engine.live_bytes() == 0


def test_pool_is_resident_and_shared_and_budget_fails_cleanly(state):
    engine, store, plan, _ = state
    need = CHUNKS * LAYOUT.chunk_bytes
    a = WholePlanRestorer(store, LAYOUT, l1_bytes=need)
    pool = a.prepare(need)
    assert int(pool.sum()) == need  # every byte written once: faulted in before timing
    b = WholePlanRestorer(store, LAYOUT, l1_bytes=need, engine=engine, reads="engine", pool=pool)
    assert b.prepare(need) is pool
    small = WholePlanRestorer(store, LAYOUT, l1_bytes=need - 1)
    res = small.restore(plan, PagedKVCache.allocate(LAYOUT, plan.hit_tokens))
    assert res.outcome == "zero" and str(need) in res.reason
    with pytest.raises(ValueError, match="reads"):
        WholePlanRestorer(store, LAYOUT, l1_bytes=need, reads="mmap")


@pytest.mark.parametrize("reads", ["lmcache", "engine"])
def test_an_injected_read_error_is_not_bypassed(state, reads):
    engine, store, plan, keys = state
    faulty = FaultPlan([Fault("error", "L2", chunks=[4])]).wrap_all(store.tiers, 0, keys)

    class _Store:
        tiers = faulty

    wp = WholePlanRestorer(_Store(), LAYOUT, l1_bytes=1 << 30, engine=engine, reads=reads)
    res = wp.restore(plan, PagedKVCache.allocate(LAYOUT, plan.hit_tokens))
    assert res.outcome == "zero" and "injected fault" in res.reason
    assert engine.live_bytes() == 0
