"""Memory measured, not counted: the vLLM worker side (its real lanes, engines and
tiers; no vLLM engine) grows the process's resident set (VmHWM) by its two rings of W
slots to load a 128 MiB prefix, where the same worker with a window as wide as the
prefix (which stages the whole state) grows by more than the state.

Records are saved by one process through the worker's save lane; each load runs in a
fresh process, whose KV cache tensors (and the expected bytes) are resident before the
baseline, and whose worker side (load and save engines, lanes) is built after it.
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
from typing import Any

MiB = 1 << 20
CHUNK = 256
BLOCK = 16
CHUNKS = 64  # records of 2 MiB: a 128 MiB prefix
WINDOW = 2
SLACK = 16 * MiB  # the worker's threads, inventory and metrics (1.3 MiB measured)


def _kv_config() -> Any:
    import torch
    from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheGroupSpec

    from bsr_io.integrations.vllm import kv_shapes

    spec = FullAttentionSpec(block_size=BLOCK, num_kv_heads=8, head_size=128, dtype=torch.bfloat16)
    layers = [f"model.layers.{i}.self_attn.attn" for i in range(2)]
    # Block 0 is vLLM's null block: one more than the prefix needs.
    blocks = CHUNKS * CHUNK // BLOCK + 1
    return kv_shapes.plan([KVCacheGroupSpec(layers, spec)], blocks, "LBHNC")


def _expected(caches: dict[str, Any]) -> dict[str, Any]:
    import torch

    g = torch.Generator().manual_seed(7)
    return {
        name: torch.randint(0, 256, t.view(torch.uint8).shape, dtype=torch.uint8, generator=g)
        for name, t in sorted(caches.items())
    }


def _run(kind: str, store: str, window: int) -> dict[str, Any]:
    """Save (kind "save") or load (kind "load") the prefix's records with a worker side
    of window `window`, in this process; a load reports its VmHWM growth."""
    import logging

    import torch

    from bsr_io.cli.host import vmhwm_bytes, vmhwm_reset
    from bsr_io.integrations.vllm import kv_shapes
    from bsr_io.integrations.vllm.config import ConnectorConfig
    from bsr_io.integrations.vllm.layout import group_layouts
    from bsr_io.integrations.vllm.metadata import RecordOrder, Transfer
    from bsr_io.integrations.vllm.worker import WorkerSide

    logging.disable(logging.WARNING)
    plan = _kv_config()
    caches = kv_shapes.allocate(plan)
    want = _expected(caches)
    for name, t in caches.items():
        t.view(torch.uint8).copy_(want[name]) if kind == "save" else t.view(torch.uint8).zero_()
    groups = group_layouts(plan, CHUNK)
    (g,) = groups
    per = g.record_blocks
    records = tuple(
        RecordOrder(g.index, c, 1000 + c, tuple(range(1 + c * per, 1 + (c + 1) * per)))
        for c in range(CHUNKS)
    )
    cfg = ConnectorConfig(store_dir=store, chunk_tokens=CHUNK, window=window)
    base = vmhwm_reset()
    worker = WorkerSide(cfg, groups, CHUNKS * per + 1, rank=0, world_size=1, model="m")
    try:
        worker.register(caches)
        worker.jobs.submit(kind, Transfer(kind, "m", records, CHUNKS * CHUNK), 300)
        deadline = time.monotonic() + 300
        done: set[str] = set()
        while time.monotonic() < deadline:
            sent, recv, failed = worker.results()
            if failed:
                raise AssertionError(f"the {kind} failed")
            done |= sent | recv
            if kind in done:
                break
            time.sleep(0.01)
        growth = vmhwm_bytes() - base
        # Blocks are the tensors' first dimension; block 0 (null) is never loaded.
        ok = all(torch.equal(t.view(torch.uint8)[1:], want[n][1:]) for n, t in caches.items())
        return {
            "done": kind in done,
            "data_ok": ok,
            "growth": growth,
            "state": CHUNKS * g.record_bytes,
            "slot_bytes": worker.slot_bytes,
        }
    finally:
        worker.close()


def _child(kind: str, store: str, window: int) -> dict[str, Any]:
    proc = subprocess.run(
        [sys.executable, __file__, kind, store, str(window)],
        capture_output=True,
        text=True,
        timeout=900,
    )
    if proc.returncode != 0:
        raise AssertionError(f"{kind} child failed ({proc.returncode}):\n{proc.stderr[-4000:]}")
    out: dict[str, Any] = json.loads(proc.stdout.strip().splitlines()[-1])
    return out


def test_a_load_grows_by_the_worker_rings_not_the_prefix(tmp_path):
    saved = _child("save", str(tmp_path), WINDOW)
    assert saved["done"], saved
    bsr = _child("load", str(tmp_path), WINDOW)
    assert bsr["done"] and bsr["data_ok"], bsr
    # Control: a window as wide as the prefix stages the whole state in its ring.
    wide = _child("load", str(tmp_path), CHUNKS)
    assert wide["done"] and wide["data_ok"], wide
    state, slot = bsr["state"], bsr["slot_bytes"]
    assert wide["growth"] >= state, wide
    assert bsr["growth"] <= 2 * WINDOW * slot + SLACK, (bsr, wide)


if __name__ == "__main__":
    print(json.dumps(_run(sys.argv[1], sys.argv[2], int(sys.argv[3]))))
