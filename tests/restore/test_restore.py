"""BSR restore in one process: discovery, windowed install, commit, fallback, save."""

from __future__ import annotations

import os

import pytest
import torch

from bsr_io import Engine
from bsr_io.cli.synthetic import fill_state, synthetic_chunk
from bsr_io.cli.whole_plan import WholePlanRestorer
from bsr_io.load.kvcache import PagedKVCache
from bsr_io.model.layout import preset
from bsr_io.restore import Restorer
from bsr_io.store import open_store

LAYOUT = preset("tiny")


def _store(tmp_path, engine, *, lower=True, l1=None):
    return open_store(
        engine,
        tmp_path / "l2",
        layout=LAYOUT,
        l1_bytes=l1,
        lower_dir=tmp_path / "l3" if lower else None,
    )


def _check(dest: PagedKVCache, chunks: int, seed: int = 7, rank: int = 0) -> None:
    for i in range(chunks):
        want = synthetic_chunk(LAYOUT, seed, i, rank).tobytes()
        assert dest.chunk_bytes(i) == want, f"chunk {i} differs"


@pytest.mark.parametrize("window", [1, 3, 64])
def test_restore_complete_bytes_and_window(tmp_path, backend, window):
    os.environ["BSR_IO_BACKEND"] = backend
    try:
        engine = Engine(window, LAYOUT.chunk_bytes, backend=backend)
        store = _store(tmp_path, engine, lower=False)
        tokens, keys = fill_state(store.tier("L2"), LAYOUT, 20 * 16 + 5, seed=7, model="m")
        r = Restorer(store, LAYOUT, window=window, engine=engine, model="m")
        plan = r.probe(tokens)
        assert plan.hit_chunks == 20 and plan.hit_tokens == 320
        assert plan.source_names() == ["L2"] * 20
        dest = PagedKVCache.allocate(LAYOUT, plan.hit_tokens)
        res = r.restore(plan, dest)
        assert res.outcome == "complete", res.reason
        assert res.committed_tokens == 320
        _check(dest, 20)
        # The staging peak is the window, never the state.
        assert res.rws_peak_bytes == min(window, 20) * engine.slot_bytes
        assert engine.live_bytes() == 0
    finally:
        os.environ.pop("BSR_IO_BACKEND", None)


def test_probe_reads_no_payload(tmp_path):
    engine = Engine(2, LAYOUT.chunk_bytes)
    store = _store(tmp_path, engine, lower=False)
    tokens, _ = fill_state(store.tier("L2"), LAYOUT, 8 * 16, seed=7, model="m")
    r = Restorer(store, LAYOUT, window=2, engine=engine, model="m")
    engine.reset_peak()
    before = store.tier("L2").stats()["bytes_read"]
    plan = r.probe(tokens)
    assert plan.hit_chunks == 8
    assert engine.peak_bytes() == 0
    assert store.tier("L2").stats()["bytes_read"] == before


def test_partial_prefix_and_other_tokens(tmp_path):
    engine = Engine(2, LAYOUT.chunk_bytes)
    store = _store(tmp_path, engine, lower=False)
    tokens, _ = fill_state(store.tier("L2"), LAYOUT, 6 * 16, seed=7, model="m")
    r = Restorer(store, LAYOUT, window=2, engine=engine, model="m")
    longer = list(tokens) + [1] * 40
    assert r.probe(longer).hit_chunks == 6
    changed = list(tokens)
    changed[3 * 16 + 1] += 1  # chunk 3 differs, so chunks 3.. are other prefixes
    assert r.probe(changed).hit_chunks == 3
    other_model = Restorer(store, LAYOUT, window=2, engine=engine, model="other")
    assert other_model.probe(tokens).hit_chunks == 0
    res = other_model.restore(other_model.probe(tokens), PagedKVCache.allocate(LAYOUT, 16))
    assert res.outcome == "zero" and res.committed_tokens == 0


def test_corrupt_chunk_falls_back_to_lower_tier(tmp_path):
    engine = Engine(3, LAYOUT.chunk_bytes)
    store = _store(tmp_path, engine)
    l2, l3 = store.tier("L2"), store.tier("L3")
    tokens, keys = fill_state(l2, LAYOUT, 10 * 16, seed=7, model="m")
    fill_state(l3, LAYOUT, 10 * 16, seed=7, model="m")
    # Flip one payload byte of chunk 4's L2 record on disk.
    path = l2.path_of(keys[4])
    with open(path, "r+b") as f:
        f.seek(os.path.getsize(path) - 100)
        b = f.read(1)
        f.seek(-1, os.SEEK_CUR)
        f.write(bytes([b[0] ^ 0x40]))
    r = Restorer(store, LAYOUT, window=3, engine=engine, model="m")
    plan = r.probe(tokens)
    assert plan.hit_chunks == 10 and plan.source_names()[4] == "L2"
    dest = PagedKVCache.allocate(LAYOUT, plan.hit_tokens)
    res = r.restore(plan, dest)
    assert res.outcome == "complete", res.reason
    assert res.source_tiers[4] == "L3"
    assert [f["chunk"] for f in res.fallbacks] == [4]
    _check(dest, 10)
    # The corrupt record is no longer advertised by L2.
    assert not l2.contains(keys[4])
    assert r.probe(tokens).source_names()[4] == "L3"


def test_missing_everywhere_gives_zero(tmp_path):
    engine = Engine(2, LAYOUT.chunk_bytes)
    store = _store(tmp_path, engine, lower=False)
    l2 = store.tier("L2")
    tokens, keys = fill_state(l2, LAYOUT, 6 * 16, seed=7, model="m")
    r = Restorer(store, LAYOUT, window=2, engine=engine, model="m")
    plan = r.probe(tokens)
    os.unlink(l2.path_of(keys[5]))  # vanishes between discovery and install
    dest = PagedKVCache.allocate(LAYOUT, plan.hit_tokens)
    res = r.restore(plan, dest)
    assert res.outcome == "zero"
    assert res.committed_tokens == 0
    assert "chunk 5" in res.reason
    assert engine.live_bytes() == 0


def test_save_is_bounded_and_roundtrips(tmp_path):
    engine = Engine(4, LAYOUT.chunk_bytes)  # more slots than the window: save bounds itself
    store = _store(tmp_path, engine, lower=False)
    r = Restorer(store, LAYOUT, window=2, engine=engine, model="m")
    src = PagedKVCache.allocate(LAYOUT, 12 * 16)
    gen = torch.Generator().manual_seed(3)
    for t in src.tensors:
        t.view(torch.uint8).copy_(
            torch.randint(0, 256, t.view(torch.uint8).shape, generator=gen, dtype=torch.uint8)
        )
    tokens = list(range(12 * 16 + 3))
    engine.reset_peak()
    assert r.save(tokens, src) == 12
    assert engine.peak_bytes() <= 2 * engine.slot_bytes
    assert r.save(tokens, src) == 0  # already stored
    plan = r.probe(tokens)
    dest = PagedKVCache.allocate(LAYOUT, plan.hit_tokens, spare_blocks=5)
    res = r.restore(plan, dest)
    assert res.outcome == "complete", res.reason
    for i in range(12):
        assert dest.chunk_bytes(i) == src.chunk_bytes(i)


def test_destination_too_small_is_zero(tmp_path):
    engine = Engine(2, LAYOUT.chunk_bytes)
    store = _store(tmp_path, engine, lower=False)
    tokens, _ = fill_state(store.tier("L2"), LAYOUT, 6 * 16, seed=7, model="m")
    r = Restorer(store, LAYOUT, window=2, engine=engine, model="m")
    res = r.restore(r.probe(tokens), PagedKVCache.allocate(LAYOUT, 3 * 16))
    assert res.outcome == "zero" and "blocks for 3 chunks" in res.reason


def test_whole_plan_fails_cleanly_then_succeeds(tmp_path):
    engine = Engine(2, LAYOUT.chunk_bytes)
    store = _store(tmp_path, engine, lower=False)
    tokens, _ = fill_state(store.tier("L2"), LAYOUT, 10 * 16, seed=7, model="m")
    plan = Restorer(store, LAYOUT, window=2, engine=engine, model="m").probe(tokens)
    state = 10 * LAYOUT.chunk_bytes
    small = WholePlanRestorer(store, LAYOUT, l1_bytes=state // 2)
    res = small.restore(plan, PagedKVCache.allocate(LAYOUT, plan.hit_tokens))
    assert res.outcome == "zero" and str(state) in res.reason
    big = WholePlanRestorer(store, LAYOUT, l1_bytes=state)
    dest = PagedKVCache.allocate(LAYOUT, plan.hit_tokens)
    res = big.restore(plan, dest)
    assert res.outcome == "complete"
    assert res.rws_peak_bytes == state  # the baseline stages the whole hit
    _check(dest, 10)


def test_window_comes_from_the_engine(tmp_path):
    engine = Engine(3, LAYOUT.chunk_bytes)
    store = _store(tmp_path, engine, lower=False)
    assert Restorer(store, LAYOUT, engine=engine).window == 3
    assert Restorer(store, LAYOUT, window=2, engine=engine).window == 2  # a share of it
    own = Restorer(store, LAYOUT)
    assert own.window == own.engine.window == 32


def test_bad_arguments(tmp_path):
    engine = Engine(2, LAYOUT.chunk_bytes)
    store = _store(tmp_path, engine, lower=False)
    with pytest.raises(ValueError, match="window"):
        Restorer(store, LAYOUT, window=0, engine=engine)
    with pytest.raises(ValueError, match="slots"):
        Restorer(store, LAYOUT, window=4, engine=engine)
    with pytest.raises(ValueError, match="allocator groups"):
        PagedKVCache(LAYOUT, [], [])
    g = LAYOUT.groups[0]
    wrong = torch.zeros(4, g.block_tokens, *g.token_shape, dtype=torch.float32)
    tensors = [wrong] + [
        torch.zeros(4, x.block_tokens, *x.token_shape, dtype=x.dtype) for x in LAYOUT.groups[1:]
    ]
    with pytest.raises(ValueError, match="float16"):
        PagedKVCache(LAYOUT, tensors, [[0]] * 3)
