"""A load whose direct read is still writing the request's blocks at its deadline is not
reported to vLLM until the read returned: until then vLLM keeps those blocks the
request's (it neither recomputes into them nor, on an abort, hands them to another
request), and the worker is unhealthy and refuses new loads, saying why.

The worker side is the real one (its lanes, load engine, SSD tier, O_DIRECT reads
straight into the KV cache's blocks); no vLLM engine. The stall is the fault double's
"hang" (bsr_io.faults, attached through BSR_IO_FAULTS as everywhere): chunk 1's read into
the cache is not done for HANG_S seconds, as a stalled drive's. The worker's destination
(blocks.py `RequestPages`) does not opt into direct reads today (no `direct_reads`): the
test turns them on for it, as a host KV cache whose memory suits O_DIRECT would, over
page-aligned caches (torch's own are 64-byte aligned, which sends reads via slots).
"""

from __future__ import annotations

import mmap
import time
from typing import Any

import pytest
import torch

from bsr_io.faults import Fault, FaultPlan

CHUNK = 256
BLOCK = 16
CHUNKS = 3
TIMEOUT_S = 1.0  # the load's deadline
HANG_S = 8.0  # chunk 1's read returns this long after it started
GRACE_S = 2.0  # deadlines.GRACE_S: past it the table would give a running job up


def _setup() -> tuple[Any, Any, tuple[Any, ...]]:
    from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheGroupSpec

    from bsr_io.integrations.vllm import kv_shapes
    from bsr_io.integrations.vllm.layout import group_layouts
    from bsr_io.integrations.vllm.metadata import RecordOrder

    spec = FullAttentionSpec(block_size=BLOCK, num_kv_heads=8, head_size=128, dtype=torch.bfloat16)
    layers = [f"model.layers.{i}.self_attn.attn" for i in range(2)]
    plan = kv_shapes.plan([KVCacheGroupSpec(layers, spec)], CHUNKS * CHUNK // BLOCK + 1, "LBHNC")
    (g,) = group_layouts(plan, CHUNK)
    per = g.record_blocks
    records = tuple(
        RecordOrder(g.index, c, 1000 + c, tuple(range(1 + c * per, 1 + (c + 1) * per)))
        for c in range(CHUNKS)
    )
    return plan, g, records


def _page_aligned(caches: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """`caches` over page-aligned memory (mmap), where O_DIRECT reads can land."""
    maps: dict[int, tuple[mmap.mmap, torch.Tensor]] = {}
    out = {}
    for name, t in caches.items():
        st = t.untyped_storage()
        if st.data_ptr() not in maps:
            m = mmap.mmap(-1, st.nbytes())
            maps[st.data_ptr()] = (m, torch.frombuffer(m, dtype=torch.uint8))
        flat = maps[st.data_ptr()][1]
        out[name] = torch.empty(0, dtype=t.dtype).set_(
            flat.untyped_storage(), t.storage_offset(), t.shape, t.stride()
        )
    return out


def _worker(store: str, plan: Any, g: Any) -> Any:
    from bsr_io.integrations.vllm.config import ConnectorConfig
    from bsr_io.integrations.vllm.worker import WorkerSide

    cfg = ConnectorConfig(
        store_dir=store, chunk_tokens=CHUNK, window=2, load_timeout_s=TIMEOUT_S, rescan_s=0
    )
    return WorkerSide(cfg, [g], CHUNKS * g.record_blocks + 1, rank=0, world_size=1, model="m")


def _poll(worker: Any, until: float, want: str) -> tuple[set[str], set[str], float]:
    """Results until `want` is reported or `until`: (recving, failed, when reported)."""
    recv: set[str] = set()
    failed: set[str] = set()
    while time.monotonic() < until:
        _, r, f = worker.results()
        recv |= r
        failed |= f
        if want in recv:
            return recv, failed, time.monotonic()
        time.sleep(0.02)
    return recv, failed, float("inf")


def test_a_load_with_a_direct_read_still_writing_its_blocks_is_reported_once_it_returned(
    tmp_path, monkeypatch
):
    from bsr_io.integrations.vllm import kv_shapes
    from bsr_io.integrations.vllm.blocks import RequestPages
    from bsr_io.integrations.vllm.metadata import Transfer

    plan, g, records = _setup()
    store = str(tmp_path / "store")
    # The records, saved by a worker of their own through its save lane.
    saver = _worker(store, plan, g)
    caches = kv_shapes.allocate(plan)
    for t in caches.values():
        t.view(torch.uint8).copy_(torch.randint(0, 256, t.view(torch.uint8).shape).to(torch.uint8))
    try:
        saver.register(caches)
        saver.jobs.submit("save", Transfer("s", "m", records, CHUNKS * CHUNK), 60)
        sent: set[str] = set()
        end = time.monotonic() + 60
        while "s" not in sent and time.monotonic() < end:
            sent |= saver.results()[0]
            time.sleep(0.02)
        assert "s" in sent
    finally:
        saver.close()

    monkeypatch.setattr(RequestPages, "direct_reads", True, raising=False)
    monkeypatch.setenv(
        "BSR_IO_FAULTS", FaultPlan([Fault("hang", chunks={1}, delay_s=HANG_S)]).to_json()
    )
    worker = _worker(store, plan, g)
    try:
        caches = _page_aligned(kv_shapes.allocate(plan))
        worker.register(caches)
        assert worker.health() == ""
        t0 = time.monotonic()
        worker.jobs.submit("load", Transfer("r", "m", records, CHUNKS * CHUNK), TIMEOUT_S)
        # Past the deadline and the table's grace the load is not reported while the read
        # into its blocks is held (before: reported failed at the deadline).
        recv, failed, _ = _poll(worker, t0 + TIMEOUT_S + GRACE_S + 1.0, "r")
        assert "r" not in recv, "a load reported while its read still writes the blocks"
        why = worker.health()
        assert "load of r holds its blocks" in why and "direct read" in why, why
        # vLLM aborts the request: still not reported (vLLM keeps a loading request's
        # blocks until then), so they are not handed to another request either.
        _, r, f = worker.results({"r"})
        assert "r" not in r | f
        # The lane refuses new loads meanwhile, at once, saying why.
        worker.jobs.submit("load", Transfer("r2", "m", records, CHUNKS * CHUNK), 30)
        recv, failed, _ = _poll(worker, time.monotonic() + 1.0, "r2")
        assert "r2" in failed and "r" not in recv, (recv, failed)
        # Reported failed (vLLM recomputes) once the read returned, and healthy again.
        recv, failed, when = _poll(worker, t0 + HANG_S + 10.0, "r")
        assert "r" in failed, (recv, failed)
        assert when >= t0 + HANG_S - 0.5, f"reported {when - t0:.1f} s in, read held {HANG_S}"
        assert worker.health() == ""
    finally:
        worker.close()


if __name__ == "__main__":
    pytest.main([__file__, "-q"])
