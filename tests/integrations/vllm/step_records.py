"""The worker side's step cuts as tests see them: a real worker over the tiny Gemma 3's
groups, the cache's pages filled, a record's expected bytes, the records stored, and
waiting for save outcomes."""

from __future__ import annotations

import time
from pathlib import Path

import torch

from bsr_io.integrations.vllm import kv_shapes
from bsr_io.integrations.vllm.blocks import Guard
from bsr_io.integrations.vllm.config import ConnectorConfig
from bsr_io.integrations.vllm.layout import GroupLayout, group_layouts
from bsr_io.integrations.vllm.metadata import Transfer
from bsr_io.integrations.vllm.worker import WorkerSide
from bsr_io.model.record import HEADER_BYTES

STEP = "bsr_io_vllm_save_records_total{kind=step,outcome=%s}"


def gemma_worker(cfg: ConnectorConfig) -> WorkerSide:
    """The real worker side (TP=1, 24 blocks) over the tiny Gemma 3's groups from vLLM's
    own planner, its KV cache allocated and registered."""
    groups = group_layouts(kv_shapes.gemma3(), cfg.chunk_tokens)
    worker = WorkerSide(cfg, groups, 24, rank=0, world_size=1, model="tiny")
    try:
        worker.register(kv_shapes.allocate(kv_shapes.gemma3()))
    except BaseException:
        worker.close()
        raise
    return worker


def group_of(worker: WorkerSide, kind: str) -> GroupLayout:
    """The worker's first group of `kind` (FULL or WINDOW)."""
    return next(g for g in worker.groups.values() if g.kind == kind)


def fill(worker: WorkerSide, seed: int) -> None:
    """Every page of the cache: random bytes (a step's forward, or another request's)."""
    assert worker.pages is not None
    gen = torch.Generator().manual_seed(seed)
    for t in worker.pages.tensors:
        t.copy_(torch.randint(0, 256, t.shape, dtype=torch.uint8, generator=gen))


def expected(worker: WorkerSide, t: Transfer) -> bytes:
    """The record as the blocks hold it now, through the per-page torch copy."""
    r = t.records[0]
    out = torch.zeros(worker.groups[r.group].record_bytes, dtype=torch.uint8)
    worker.dest(t, [r], Guard()).extract(0, out)
    return out.numpy().tobytes()


def stored(store: Path) -> list[bytes]:
    return [p.read_bytes()[HEADER_BYTES:] for p in sorted(store.glob("chunks/*/*.chunk"))]


def wait_for(worker: WorkerSide, outcome: str, n: int) -> None:
    deadline = time.monotonic() + 30
    while worker.metrics.snapshot().get(STEP % outcome, 0) < n:
        assert time.monotonic() < deadline, worker.metrics.snapshot()
        time.sleep(0.02)
