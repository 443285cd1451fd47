"""Exactness by bytes (test support): a restored request's KV blocks compared byte for
byte with the blocks that held the same tokens before vLLM evicted them.

    python -m bsr_lab.vllm.kvbytes kvbytes --model llama|gemma3 --tp N --work DIR --out R.json

One engine with the connector (the offline API). Functions sent to every worker with
`LLM.collective_rpc` (vLLM's own way to run code in its workers) keep each request's
block table as the worker holds it after every step, copy a finished request's blocks,
zero the whole KV cache and compare. Nothing here runs in the connector's path: the
comparison reads vLLM's KV cache tensors, not bsr-io's view of them.

Two requests per run, each computed, copied, evicted (vLLM's prefix cache reset and every
KV cache tensor zeroed, so a block the restore did not write reads as zeros) and asked
again:
- "A": restored as stored; every restored block must equal its copy.
- "B": TEST DOUBLE: before the repeat, two chunks' records of one group are swapped on
  disk, each written again through the tier's own write path under the other's key
  (well formed, valid checksums: the same as installing each chunk at the other's
  destination). The load completes; the comparison must name exactly those blocks.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path
from typing import Any

from bsr_lab.vllm import harness as h

SWAPPED = (1, 2)  # B's chunks whose records trade places
NULL_BLOCK = 0  # vLLM's null block (a sliding-window group's block outside the window)


# -- in every worker (collective_rpc) ----------------------------------------------------
def track_tables(worker: Any) -> None:
    """Keep, for every request, its block table per KV cache group as the worker holds
    it after each step's state update (vLLM's own `requests`, dropped once it finishes)."""
    runner = worker.model_runner
    if hasattr(runner, "bsr_tables"):
        return
    runner.bsr_tables = {}
    update = runner._update_states

    def updated(scheduler_output: Any) -> Any:
        out = update(scheduler_output)
        for rid, state in runner.requests.items():
            runner.bsr_tables[rid] = [list(ids) for ids in state.block_ids]
        return out

    runner._update_states = updated


def _table(runner: Any, rid: str) -> list[list[int]]:
    # The worker's id is the engine's request id with a suffix of vLLM's.
    found = [t for r, t in runner.bsr_tables.items() if r == rid or r.startswith(rid + "-")]
    if len(found) != 1:
        raise RuntimeError(f"{len(found)} block tables for request {rid}")
    table: list[list[int]] = found[0]
    return table


def _layers(runner: Any) -> list[tuple[int, Any, int]]:
    """(group, layer's KV tensor, its block dimension) for every attention layer."""
    from vllm.model_executor.models.utils import extract_layer_index

    cfg = runner.kv_cache_config
    group = {n: g for g, spec in enumerate(cfg.kv_cache_groups) for n in spec.layer_names}
    # The runner's tensors are in layer-index order (vLLM's bind_kv_cache).
    names = sorted(group, key=extract_layer_index)
    out = []
    for name, kv in zip(names, runner.kv_caches, strict=True):
        dims = [d for d, n in enumerate(kv.shape) if n == cfg.num_blocks]
        if not dims:
            raise RuntimeError(f"{name}: no dimension of {tuple(kv.shape)} is the block count")
        out.append((group[name], kv, dims[0]))
    return out


def _blocks(runner: Any, rid: str, n_blocks: int) -> dict[tuple[int, int], list[Any]]:
    """(group, token block) -> that block's bytes in each of the group's layers, for the
    request's first `n_blocks` token blocks held outside the null block."""
    table = _table(runner, rid)
    out: dict[tuple[int, int], list[Any]] = {}
    for g, kv, dim in _layers(runner):
        for b, block in enumerate(table[g][:n_blocks]):
            if block != NULL_BLOCK:
                out.setdefault((g, b), []).append(kv.select(dim, block).contiguous().view(-1))
    return out


def snapshot(worker: Any, label: str, rid: str, n_blocks: int) -> int:
    """Copy the request's blocks (before eviction); returns how many."""
    runner = worker.model_runner
    blocks = _blocks(runner, rid, n_blocks)
    if not hasattr(runner, "bsr_snapshots"):
        runner.bsr_snapshots = {}
    runner.bsr_snapshots[label] = {k: [t.clone() for t in v] for k, v in blocks.items()}
    return len(blocks)


def zero_kv(worker: Any) -> int:
    """Zero every KV cache tensor: a block a restore does not write reads as zeros."""
    for kv in worker.model_runner.kv_caches:
        kv.zero_()
    return len(worker.model_runner.kv_caches)


def compare(worker: Any, label: str, rid: str, n_blocks: int) -> dict[str, Any]:
    """The request's blocks now against the copy `label`, byte for byte."""
    import torch

    runner = worker.model_runner
    before = runner.bsr_snapshots[label]
    now = _blocks(runner, rid, n_blocks)
    differ, missing, zeros, n_bytes = [], [], [], 0
    for key, tensors in sorted(now.items()):
        if key not in before:
            missing.append(list(key))
            continue
        n_bytes += sum(t.numel() * t.element_size() for t in tensors)
        old = [t.view(torch.uint8) for t in before[key]]
        if not all(torch.equal(a, b.view(torch.uint8)) for a, b in zip(old, tensors, strict=True)):
            differ.append(list(key))
        if not any(bool(a.any()) for a in old):
            zeros.append(list(key))  # a copy of zeros: equal to an unwritten block
    return {
        "blocks": len(now),
        "groups": sorted({g for g, _ in now}),
        "bytes": n_bytes,
        "differ": differ,
        "missing": missing,
        "zero_copies": zeros,
    }


# -- the driver --------------------------------------------------------------------------
def swap_records(
    events: h.Events, store: str, tp: int, model: str, prompt: list[int], group: int,
    chunk_tokens: int,
) -> int:  # fmt: skip
    """TEST DOUBLE: `SWAPPED`'s two records of `group` trade places on every rank, each
    written again through the tier's write path (valid checksums). Returns records moved."""
    from bsr_io._core import Engine
    from bsr_io.tiers.lower import LowerTier

    g = next(g for g in h.groups_of(events) if g["index"] == group)
    layout = h.record_layout(g)
    keys = h.record_keys(g, tp, prompt, model, chunk_tokens=chunk_tokens)
    tier = LowerTier(store, name="L2")
    eng = Engine(2, layout.chunk_bytes)
    moved = 0
    try:
        for r in range(tp):
            a, b = (keys[r][c] for c in SWAPPED)
            slot_a, slot_b = tier.read_into(a, eng), tier.read_into(b, eng)
            for key, slot in ((a, slot_b), (b, slot_a)):
                tier.remove(key)
                tier.write(key, slot, layout)
                moved += 1
            slot_a.release()
            slot_b.release()
    finally:
        eng.close()
    return moved


def run(model_kind: str, model: str, tp: int, work: str) -> dict[str, Any]:
    hybrid = model_kind == "gemma3"
    chunk, block = (h.G_CHUNK, h.G_BLOCK) if hybrid else (h.CHUNK_TOKENS, h.BLOCK_SIZE)
    store = os.path.join(work, "store")
    events = h.Events(os.path.join(work, "events.jsonl"))
    cfg = {
        "store_dir": store,
        "window": h.WINDOW,
        "chunk_tokens": chunk,
        "load_timeout_s": 60.0,
        "save_timeout_s": 600.0,
        "events_path": events.path,
        # A loaded host's slow writes must not skip a window record (as run_hybrid),
        # nor its busy cores starve the save threads (nice 19 by default): this checks
        # the bytes of every record, so every record must be saved.
        "step_save_budget_s": 5.0,
        "save_nice": 0,
    }
    llm = h.g_engine(model, tp, cfg) if hybrid else h.engine(model, tp, connector=cfg)
    llm.collective_rpc(track_tables)
    whole = 4 if hybrid else 10  # whole chunks of each prompt
    prompts = {"A": h.tokens(71, whole * chunk + 17), "B": h.tokens(72, whole * chunk + 17)}
    n_blocks = whole * chunk // block
    # The swapped group: the full-attention one (the hybrid's window groups store one
    # record per boundary, read only at the restore point).
    swapped_group = 2 if hybrid else 0
    out: dict[str, Any] = {"tp": tp, "chunk": chunk, "block": block, "n_blocks": n_blocks}
    out["groups"] = [[g["index"], g["kind"]] for g in h.groups_of(events)]
    for name, prompt in prompts.items():
        toks, cached, rid, _ = h.generate(llm, prompt)
        saves = events.wait(rid, h.SAVE_END, tp)
        if any(e["outcome"] != "complete" for e in saves):
            raise RuntimeError(f"the save of {name} failed: {saves}")
        copied = llm.collective_rpc(snapshot, args=(name, rid, n_blocks))
        if name == "B":
            out["B_swapped"] = swap_records(events, store, tp, model, prompt, swapped_group, chunk)
        h.reset(llm)
        llm.collective_rpc(zero_kv)
        toks2, cached2, rid2, _ = h.generate(llm, prompt)
        out[name] = {
            "computed": {"tokens": toks, "cached": cached},
            "restored": {"tokens": toks2, "cached": cached2},
            "copied": copied,
            "loads": events.of(rid2, "load"),
            "compare": llm.collective_rpc(compare, args=(name, rid2, n_blocks)),
        }
    out["swapped_group"] = swapped_group
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bsr_lab.vllm.kvbytes")
    ap.add_argument("what", choices=["kvbytes"])
    ap.add_argument("--model", choices=["llama", "gemma3"], default="llama")
    ap.add_argument("--tp", type=int, default=1)
    ap.add_argument("--work", required=True)
    ap.add_argument("--out", required=True)
    args = ap.parse_args(argv)
    os.makedirs(args.work, exist_ok=True)
    # collective_rpc ships these functions to the engine core pickled: vLLM refuses that
    # unless allowed (a test's engine only).
    os.environ["VLLM_ALLOW_INSECURE_SERIALIZATION"] = "1"
    parent = os.path.join(args.work, "..")
    if args.model == "gemma3":
        model = h.write_tiny_gemma3(os.path.join(parent, "model-gemma3"))
    else:
        model = h.write_tiny_llama(os.path.join(parent, "model-l2"))
    result = {
        "model": os.path.abspath(model),
        **run(args.model, os.path.abspath(model), args.tp, args.work),
    }
    Path(args.out).write_text(json.dumps(result, default=str))
    return 0


if __name__ == "__main__":
    sys.exit(main())
