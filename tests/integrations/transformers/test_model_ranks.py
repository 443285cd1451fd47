"""Two ranks in a real gloo process group: each stores and restores its own KV-head shard.

Each rank runs the same (unsharded) model, saves only heads [r*h/2, (r+1)*h/2) of
every layer and restores only those; after a commit the ranks exchange shards.
Faults are real damage to rank 1's own records.
"""

import os
import socket
import traceback

import numpy as np
import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")
torch = pytest.importorskip("torch")
pytest.importorskip("transformers")
import torch.distributed as dist  # noqa: E402
import torch.multiprocessing as mp  # noqa: E402

CT = 16
PREFIX = 5 * CT + 6
SUFFIX = 4
STEPS = 5
WORLD = 2


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _phase(r, model, prompt, suffix, plan=None):
    from bsr_io.integrations.transformers import continue_greedy, restore_prefix

    cache, res = restore_prefix(r, model, prompt, plan=plan)
    seq = cache.get_seq_length()
    tokens, logits = continue_greedy(model, cache, suffix, STEPS)
    return {
        "outcome": res.outcome,
        "committed_tokens": res.committed_tokens,
        "reason": res.reason,
        "tokens": tokens,
        "logits": logits.numpy(),  # by value: a shared tensor dies with its process
        "seq": seq,
    }


def _rank_main(rank, port, root, family, queue):
    try:
        torch.set_num_threads(1)
        dist.init_process_group(
            "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=WORLD
        )
        queue.put((rank, _scenario(rank, root, family)))
    except BaseException:
        queue.put((rank, {"error": traceback.format_exc()}))
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def _scenario(rank, root, family):
    from bsr_io import Engine, Restorer, SSDTier, Store
    from bsr_io.integrations.transformers import (
        continue_greedy,
        kv_layout,
        prefill,
        save_prefix,
    )
    from bsr_lab.tiny_models import tiny_model

    model = tiny_model(family, heads=8, kv_heads=4)
    layout = kv_layout(
        model.config, chunk_tokens=CT, dtype=torch.float32, rank=rank, world_size=WORLD
    )
    engine = Engine(4, layout.chunk_bytes)
    tier = SSDTier(root, None, engine, layout=layout)
    r = Restorer(Store([tier]), layout, window=2, engine=engine, model=f"tiny-{family}")
    assert (r.rank, r.world_size) == (rank, WORLD)
    ids = torch.randint(0, 256, (PREFIX + SUFFIX,), generator=torch.Generator().manual_seed(21))
    prompt, suffix = ids[:PREFIX], ids[PREFIX:]

    original, _ = prefill(model, prompt, chunk_tokens=CT)
    out = {"saved": save_prefix(r, prompt, original)}
    out["ref_tokens"], ref_logits = continue_greedy(model, original, suffix, STEPS)
    out["ref_logits"] = ref_logits.numpy()
    keys = r.keys(prompt.tolist())

    out["complete"] = _phase(r, model, prompt, suffix)
    # Rank 1 loses chunk 3 before the probe: both ranks must agree on 3 chunks.
    if rank == 1:
        os.unlink(tier.path_of(keys[3]))
    out["short"] = _phase(r, model, prompt, suffix)
    # Rank 1's chunk 1 is corrupted after the probe: neither rank may commit.
    plan = r.probe(prompt.tolist())
    out["corrupt_plan_hit"] = plan.hit_chunks
    if rank == 1:
        path = tier.path_of(keys[1])
        with open(path, "r+b") as f:
            f.seek(-1, os.SEEK_END)
            b = f.read(1)[0]
            f.seek(-1, os.SEEK_END)
            f.write(bytes([b ^ 0xFF]))
    out["corrupt"] = _phase(r, model, prompt, suffix, plan=plan)
    return out


# deepseek_v3 (MLA): no heads to shard; each rank stores and restores the whole latent.
@pytest.mark.parametrize("family", ["llama", "qwen3", "deepseek_v3"])
def test_two_ranks_restore_shards_all_or_nothing(tmp_path, family):
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    port = _free_port()
    procs = [
        ctx.Process(target=_rank_main, args=(rank, port, str(tmp_path), family, queue))
        for rank in range(WORLD)
    ]
    for p in procs:
        p.start()
    results = dict(queue.get(timeout=240) for _ in procs)
    for p in procs:
        p.join(timeout=60)
    for rank, res in results.items():
        assert "error" not in res, f"rank {rank}:\n{res['error']}"

    for res in results.values():
        assert res["saved"] == PREFIX // CT
        ref_tokens, ref_logits = res["ref_tokens"], res["ref_logits"]
        # Complete: every rank restored its own shard; the exchanged cache is exact.
        c = res["complete"]
        assert (c["outcome"], c["committed_tokens"]) == ("complete", 5 * CT), c["reason"]
        # Short on rank 1 only: the agreed hit is the minimum, on both ranks.
        s = res["short"]
        assert (s["outcome"], s["committed_tokens"]) == ("complete", 3 * CT), s["reason"]
        # Corrupt on rank 1 only: zero on both, then recompute.
        z = res["corrupt"]
        assert res["corrupt_plan_hit"] == 3
        assert (z["outcome"], z["committed_tokens"]) == ("zero", 0)
        assert z["reason"]
        for phase in (c, s, z):
            assert phase["seq"] == PREFIX
            assert phase["tokens"] == ref_tokens
            assert np.array_equal(phase["logits"], ref_logits)
    assert np.array_equal(results[0]["ref_logits"], results[1]["ref_logits"])
