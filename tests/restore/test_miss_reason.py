"""A miss says why: every plan with no hit carries a reason naming its cause, so the
README's `print("miss:", plan.reason)` is never blank. Each cause is provoked for real
(the group's record is withheld by the fault double, which says so)."""

from __future__ import annotations

import threading

import pytest
from torch.distributed import HashStore

from bsr_io import Engine, PagedKVCache, Restorer, open_store, preset
from bsr_io.commit import Agreement
from bsr_io.faults import Fault, FaultPlan
from bsr_io.store import Store

LAYOUT = preset("tiny")
TOKENS = list(range(3 * LAYOUT.chunk_tokens))


@pytest.fixture
def engine():
    with Engine(2, LAYOUT.chunk_bytes) as eng:
        yield eng


def _saved(restorer: Restorer) -> None:
    kv = PagedKVCache.allocate(LAYOUT, len(TOKENS))
    assert restorer.save(TOKENS, kv) == 3


def test_a_hit_has_no_reason(tmp_path, engine):
    """Control: with the chunks saved the plan hits and gives no reason."""
    r = Restorer(open_store(engine, tmp_path, layout=LAYOUT), LAYOUT, engine=engine)
    _saved(r)
    plan = r.probe(TOKENS)
    assert plan.hit_chunks == 3 and plan.reason == ""


def test_an_empty_store_names_the_tiers_it_searched(tmp_path, engine):
    store = open_store(engine, tmp_path / "l2", layout=LAYOUT, lower_dir=tmp_path / "l3")
    plan = Restorer(store, LAYOUT, engine=engine).probe(TOKENS)
    assert plan.hit_chunks == 0
    assert plan.reason == "no record of the first chunk in any tier (L2, L3)"


def test_a_prompt_shorter_than_a_chunk_says_so(tmp_path, engine):
    r = Restorer(open_store(engine, tmp_path, layout=LAYOUT), LAYOUT, engine=engine)
    _saved(r)
    plan = r.probe(TOKENS[: LAYOUT.chunk_tokens - 1])
    assert plan.hit_chunks == 0
    assert plan.reason.startswith(
        f"prompt shorter than one chunk ({LAYOUT.chunk_tokens - 1} tokens < chunk_tokens "
        f"{LAYOUT.chunk_tokens})"
    )


def test_a_group_without_its_first_record_is_named(tmp_path, engine):
    store = open_store(engine, tmp_path, layout=LAYOUT)
    _saved(Restorer(store, LAYOUT, engine=engine))
    # Test double: the tier answers that it has no "window" record of chunk 0.
    l2 = FaultPlan([Fault("group_missing", chunks=[0], groups=["window"])]).wrap(store.tiers[0])
    plan = Restorer(Store([l2]), LAYOUT, engine=engine).probe(TOKENS)
    assert plan.hit_chunks == 0
    assert plan.reason == (
        "group window has no record of chunk 0 in any tier (L2); group full, state has"
    )


def test_a_rank_whose_peer_has_nothing_says_another_rank_shortened_it(tmp_path):
    """Two ranks (threads) agree through one store: rank 0 holds 3 chunks, rank 1 none.
    Each plan is zero; rank 0's reason names the other rank, rank 1's its own miss."""
    shared = HashStore()
    plans = {}
    with Engine(2, LAYOUT.chunk_bytes) as e0, Engine(2, LAYOUT.chunk_bytes) as e1:
        restorers = [
            Restorer(
                open_store(eng, tmp_path / f"r{rank}", layout=LAYOUT),
                LAYOUT,
                engine=eng,
                agreement=Agreement(rank, 2, shared, timeout_s=20.0),
            )
            for rank, eng in enumerate((e0, e1))
        ]
        _saved(restorers[0])

        def probe(rank: int) -> None:
            plans[rank] = restorers[rank].probe(TOKENS, request_id="req")

        threads = [threading.Thread(target=probe, args=(rank,)) for rank in (0, 1)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    assert (plans[0].local_hit_chunks, plans[0].hit_chunks, plans[1].hit_chunks) == (3, 0, 0)
    assert plans[0].reason == "hit shortened from 3 to 0 chunks by another rank"
    assert plans[1].reason == "no record of the first chunk in any tier (L2)"
