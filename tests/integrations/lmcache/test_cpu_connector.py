"""CPUPagedConnector: LMCache's connector interface over paged KV caches in CPU memory,
with memory objects from LMCache's real L1 allocator."""

from __future__ import annotations

import pytest

pytest.importorskip("lmcache")

import torch  # noqa: E402

from bsr_lab.lmcache import harness as h  # noqa: E402
from bsr_lab.lmcache.connector import CPUPagedConnector  # noqa: E402

SHAPE = h.Shape()
CT = SHAPE.chunk_tokens


@pytest.fixture
def engine():
    e = h.Engines(SHAPE)
    yield e(l1_chunks=4)
    e.close()


def alloc(engine):
    md = engine.metadata
    return engine.storage_manager.allocate(md.get_shapes(CT), md.get_dtypes(), busy_loop=False)


@pytest.mark.parametrize("slots", ["whole pages", "scattered tokens"])
def test_round_trip_and_vllm_cached_tokens(engine, slots):
    src = h.make_state(SHAPE, 2, seed=4)
    if slots == "scattered tokens":  # no whole pages: the per-token path
        src.slot_mapping = torch.randperm(
            len(src.tokens), generator=torch.Generator().manual_seed(0)
        )
    conn = engine.gpu_connector
    obj = alloc(engine)
    conn.from_gpu(obj, CT, 2 * CT, **src.kwargs())
    dst = h.empty_like(src)
    conn.batched_to_gpu([obj], [CT], [2 * CT], **dst.kwargs())
    slots = src.slot_mapping[CT : 2 * CT]
    for a, b in zip(src.kvcaches, dst.kvcaches, strict=True):
        fa, fb = a.view(2, -1, a.shape[-2] * a.shape[-1]), b.view(2, -1, b.shape[-2] * b.shape[-1])
        assert torch.equal(fa[:, slots], fb[:, slots])
    assert not h.restored_equal(src, dst, CT)  # chunk 0 was not copied

    # Tokens vLLM already holds (the first 10 of this chunk) are not overwritten.
    dst2 = h.empty_like(src)
    conn.to_gpu(obj, CT, 2 * CT, vllm_cached_tokens=CT + 10, **dst2.kwargs())
    slots = src.slot_mapping[CT : 2 * CT]
    for a, b in zip(src.kvcaches, dst2.kvcaches, strict=True):
        fa, fb = a.view(2, -1, a.shape[-2] * a.shape[-1]), b.view(2, -1, b.shape[-2] * b.shape[-1])
        assert not bool(fb[:, slots[:10]].any())
        assert torch.equal(fa[:, slots[10:]], fb[:, slots[10:]])
    obj.ref_count_down()


def test_rejects_what_it_cannot_place(engine):
    conn = engine.gpu_connector
    src = h.make_state(SHAPE, 1, seed=1)
    obj = alloc(engine)
    with pytest.raises(ValueError, match="slot_mapping"):
        conn.to_gpu(obj, 0, CT, kvcaches=src.kvcaches)
    with pytest.raises(ValueError, match="shape"):
        conn.to_gpu(obj, 0, CT - 1, **src.kwargs())
    with pytest.raises(ValueError, match="layer caches"):
        conn.to_gpu(obj, 0, CT, kvcaches=src.kvcaches[:1], slot_mapping=src.slot_mapping)
    obj.ref_count_down()
    assert conn.get_shape(7) == torch.Size([2, SHAPE.num_layers, 7, 2 * 64])
    assert isinstance(conn, CPUPagedConnector)
