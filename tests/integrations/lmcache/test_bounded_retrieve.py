"""The bounded retrieve on LMCache 0.5.6's real engine, with LMCache's own LocalDiskBackend.

The GPU is stood in for by `CPUPagedConnector` (LMCache's connector interface over CPU
tensors); everything else is the real `lmcache` package. Faults are injected with test
doubles that wrap a real backend method, and say so.
"""

from __future__ import annotations

import pytest

pytest.importorskip("lmcache")

import torch  # noqa: E402

from bsr_io.integrations.lmcache import retrieve as r  # noqa: E402
from bsr_lab.lmcache import harness as h  # noqa: E402

SHAPE = h.Shape()
CB = SHAPE.chunk_bytes


def stored_engine(engines, tmp_path, n_chunks, l1_chunks, seed=0):
    eng = engines(l1_chunks=l1_chunks, disk=tmp_path)
    src = h.make_state(SHAPE, n_chunks, seed=seed)
    h.store_windowed(eng, src, max(1, l1_chunks // 2))
    h.drop_l1(eng)
    return eng, src


def test_state_8x_l1_restores_completely_where_stock_hangs(engines, tmp_path):
    n, l1, w = 32, 4, 2  # state = 8x L1
    stock = h.run_stock_case(SHAPE, n, l1 * CB, str(tmp_path / "stock"), timeout_s=6.0)
    assert stock["result"] == "hang"
    assert stock["l1_peak_bytes"] == l1 * CB  # it filled its whole pool, then spun

    eng, src = stored_engine(engines, tmp_path / "bsr", n, l1)
    retriever = r.install(eng, window=w)
    eng.gpu_connector.reset_stats()
    dst = h.empty_like(src)
    mask = eng.retrieve(src.tokens, **dst.kwargs())
    assert bool(mask.all())
    assert h.restored_equal(src, dst, len(src.tokens))
    rep = retriever.last
    assert (rep.outcome, rep.chunks, rep.windows) == ("complete", n, n // w)
    # The window fills and no batch is larger: staging W chunks, not the state. (L1's
    # own peak is no measure here: it is capped by its pool in either path.)
    assert rep.staging_peak_bytes == w * CB
    assert eng.gpu_connector.max_batch_bytes == w * CB


def test_partial_hit_requested_gives_zero_not_a_shorter_prefix(engines, tmp_path):
    eng, src = stored_engine(engines, tmp_path, 8, 16)
    disk = eng.storage_manager.storage_backends["LocalDiskBackend"]
    keys = h._keys(eng, src.tokens, 0, 8)
    assert disk.remove(keys[5])

    stock_dst = h.empty_like(src)
    stock = eng.retrieve(src.tokens, **stock_dst.kwargs())
    assert int(stock.sum()) == 5 * SHAPE.chunk_tokens  # what LMCache does: a shorter prefix

    retriever = r.install(eng, window=2)
    dst = h.empty_like(src)
    mask = eng.retrieve(src.tokens, **dst.kwargs())
    assert not bool(mask.any())
    assert retriever.last.outcome == "zero"
    assert "5 of 8" in retriever.last.reason
    assert eng.gpu_connector.to_gpu_calls == 1  # only the stock call: nothing was staged


@pytest.mark.parametrize("bad_call", [0, 2])
def test_window_failure_gives_zero_and_releases_staging(engines, tmp_path, bad_call):
    eng, src = stored_engine(engines, tmp_path, 12, 6)
    disk = eng.storage_manager.storage_backends["LocalDiskBackend"]
    real = disk.batched_get_blocking
    calls = []

    def flaky(keys):  # test double: the real read, with the last chunk of one call lost
        objs = real(keys)
        calls.append(len(keys))
        if len(calls) - 1 == bad_call and objs[-1] is not None:
            objs[-1].ref_count_down()
            objs[-1] = None
        return objs

    disk.batched_get_blocking = flaky
    retriever = r.install(eng, window=3)
    dst = h.empty_like(src)
    mask = eng.retrieve(src.tokens, **dst.kwargs())
    assert not bool(mask.any())
    assert retriever.last.outcome == "zero"
    assert len(calls) == bad_call + 1  # stopped at the failing window
    # Earlier windows filled all 3 slots; a failing first window stages nothing.
    assert retriever.last.staging_peak_bytes == (3 * CB if bad_call else 0)
    h.drop_l1(eng)
    assert h.l1_allocated_bytes(eng) == 0  # every staged chunk was released


def test_connector_error_gives_zero_without_raising(engines, tmp_path):
    eng, src = stored_engine(engines, tmp_path, 6, 8)
    conn = eng.gpu_connector
    real = conn.batched_to_gpu
    count = []

    def failing(*a, **k):  # test double: the second install into the destination fails
        count.append(1)
        if len(count) == 2:
            raise RuntimeError("injected: device copy failed")
        return real(*a, **k)

    conn.batched_to_gpu = failing
    retriever = r.install(eng, window=2)
    mask = eng.retrieve(src.tokens, **h.empty_like(src).kwargs())
    assert not bool(mask.any())
    assert "injected" in retriever.last.reason
    h.drop_l1(eng)
    assert h.l1_allocated_bytes(eng) == 0


def test_masked_prefix_and_uninstall(engines, tmp_path):
    eng, src = stored_engine(engines, tmp_path, 6, 8)
    ct = SHAPE.chunk_tokens
    mask_in = torch.ones(len(src.tokens), dtype=torch.bool)
    mask_in[: 2 * ct] = False  # vLLM already holds two chunks
    retriever = r.install(eng, window=2)
    dst = h.empty_like(src)
    mask = eng.retrieve(src.tokens, mask_in, **dst.kwargs())
    assert torch.equal(mask, mask_in)
    assert retriever.last.chunks == 4
    r.uninstall(eng)
    assert r.installed(eng) is None
    eng.gpu_connector.reset_stats()
    assert bool(eng.retrieve(src.tokens, **h.empty_like(src).kwargs()).all())
    assert eng.gpu_connector.to_gpu_calls == 1  # stock path again: one whole-plan call


def test_refuses_engines_whose_retrieve_it_does_not_replace(engines):
    eng = engines(l1_chunks=8, settings={"use_layerwise": True})
    assert r.unsupported_reasons(eng)
    with pytest.raises(ValueError, match="layerwise"):
        r.install(eng, window=4)
    with pytest.raises(ValueError):
        r.BoundedRetriever(eng, window=0)


def test_bounded_retrieve_function(engines, tmp_path):
    eng, src = stored_engine(engines, tmp_path, 5, 4)
    dst = h.empty_like(src)
    mask = r.bounded_retrieve(eng, src.tokens, window=1, **dst.kwargs())
    assert bool(mask.all()) and h.restored_equal(src, dst, len(src.tokens))
    assert eng.gpu_connector.max_batch_objs == 1
    assert "retrieve" not in vars(eng)
