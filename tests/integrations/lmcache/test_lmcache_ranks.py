"""Two tensor-parallel ranks, each with its own real LMCache engine and bsr-io plugin,
agreeing through torch.distributed (gloo on localhost): a failure on one rank gives
zero reuse on both, never a rank-asymmetric prefix.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import socket

import pytest

pytest.importorskip("lmcache")

WORLD = 2
N_CHUNKS = 6


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _rank_main(rank: int, port: int, path: str, bad_rank: int | None, out) -> None:
    import logging

    logging.disable(logging.WARNING)
    import torch.distributed as dist

    from bsr_io.integrations.lmcache.config import lmcache_settings
    from bsr_io.model.record import HEADER_BYTES
    from bsr_lab.lmcache import harness as h

    dist.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=WORLD
    )
    shape = h.Shape()
    engines = h.Engines(shape)
    try:
        settings = lmcache_settings(path, window=2, agreement="world", timeout_s=30)
        eng = engines(4, settings=settings, metadata=h.make_metadata(shape, rank, WORLD))
        plugin = eng.storage_manager.storage_backends["bsr"]
        src = h.make_state(shape, N_CHUNKS, seed=100 + rank)  # each rank its own shard
        src.tokens = h.make_state(shape, N_CHUNKS, seed=0, fill=False).tokens  # same prompt
        h.store_windowed(eng, src, 2)
        h.drop_l1(eng)
        if rank == bad_rank:
            key = h._keys(eng, src.tokens, 0, N_CHUNKS)[4]
            with open(plugin.tier.path_of(plugin.chunk_key(key)), "r+b") as f:
                f.seek(HEADER_BYTES + 7)
                f.write(b"\x5a\xa5")  # a real on-disk corruption of chunk 4 on this rank
        dist.barrier()
        dst = h.empty_like(src)
        mask = eng.retrieve(src.tokens, **dst.kwargs())
        rep = plugin.retriever.last
        full = bool(mask.all())
        out.put(
            (
                rank,
                int(mask.sum()),
                rep.outcome,
                rep.reason,
                h.restored_equal(src, dst, len(src.tokens)) if full else None,
            )
        )
    finally:
        engines.close()
        dist.destroy_process_group()


def _run(tmp_path, bad_rank):
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    port = _free_port()
    env_seed = os.environ.get("PYTHONHASHSEED")
    os.environ["PYTHONHASHSEED"] = "0"  # LMCache's fallback token hash must match across ranks
    try:
        procs = [
            ctx.Process(target=_rank_main, args=(r, port, str(tmp_path), bad_rank, out))
            for r in range(WORLD)
        ]
        for p in procs:
            p.start()
        results = sorted(out.get(timeout=240) for _ in range(WORLD))
        for p in procs:
            p.join(timeout=60)
            assert p.exitcode == 0
    finally:
        if env_seed is None:
            os.environ.pop("PYTHONHASHSEED", None)
        else:
            os.environ["PYTHONHASHSEED"] = env_seed
    return results


def test_two_ranks_restore_completely_or_not_at_all(tmp_path):
    ok = _run(tmp_path / "ok", bad_rank=None)
    assert [(r[1], r[2], r[4]) for r in ok] == [(N_CHUNKS * 256, "complete", True)] * WORLD

    bad = _run(tmp_path / "bad", bad_rank=1)
    assert [(r[1], r[2]) for r in bad] == [(0, "zero")] * WORLD
    assert "rank 1" in bad[0][3]  # rank 0 had every chunk of its own, and still reports zero
