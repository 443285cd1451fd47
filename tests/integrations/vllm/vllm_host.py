"""The conformance cases' vLLM host (tests/conformance/cases.py `Host`): the connector's
scheduler side and one worker side (TP=1), driven as vLLM drives them, with no engine.

The KV cache is vLLM's own (one full-attention group planned by vLLM's planner, its
tensors allocated as vLLM's worker allocates them). A save is the step that prefills a
request: the scheduler side orders the step's cuts, the worker cuts and writes them.
A load is vLLM's sequence: `get_num_new_matched_tokens`, `update_state_after_alloc`,
the step's metadata to the worker (`start_load_kv`), its results polled until the
request is named, then reported back to the scheduler side. Every call to the worker's
reports (`worker_meta`) reaches the scheduler side as vLLM's aggregator hands it.

The model identity is derived from a vLLM model config holding a set (the hash-seed
case); a seed's record bytes are fixed by the seed, installed into and read back from
the request's blocks through the worker's own `RequestPages`.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from contextlib import AbstractContextManager
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import numpy as np
import pytest
import torch
from conformance.cases import CHUNKS, Background, Loaded, Options, Saved, failing_lease
from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheGroupSpec

from bsr_io.integrations.vllm import cuts, kv_shapes
from bsr_io.integrations.vllm import inventory as inventory_module
from bsr_io.integrations.vllm.blocks import Guard
from bsr_io.integrations.vllm.config import ConnectorConfig
from bsr_io.integrations.vllm.identity import model_identity
from bsr_io.integrations.vllm.layout import group_layouts
from bsr_io.integrations.vllm.metadata import RecordOrder, Transfer
from bsr_io.integrations.vllm.scheduler import SchedulerSide
from bsr_io.integrations.vllm.worker import WorkerSide
from bsr_io.save import records as save_records_module
from bsr_io.tiers.files.records import record_path
from bsr_lab.vllm.harness import scheduler_request, tokens

CHUNK, BLOCK = 256, 16
PER = CHUNK // BLOCK  # blocks per record
SPAN = CHUNKS * PER + 1  # blocks of one request (its last 10 tokens in the last)
REGIONS = 5  # the save region, then the regions loads land in, in turn
W = 4
SAVES = "bsr_io_vllm_save_records_total{kind=step,outcome="

_SET_CONFIG = SimpleNamespace(
    model_config=SimpleNamespace(
        model="/m/conformance",
        revision=None,
        dtype="torch.bfloat16",
        hf_config=SimpleNamespace(rope_scaling=None, rope_theta=10000.0),
        hf_overrides={"no_rope_layers": {"q_proj", "k_proj", "v_proj", "o_proj", "gate", "up"}},
    ),
    cache_config=SimpleNamespace(),
)


def _plan() -> Any:
    spec = FullAttentionSpec(block_size=BLOCK, num_kv_heads=1, head_size=64, dtype=torch.bfloat16)
    layers = [f"model.layers.{i}.self_attn.attn" for i in range(2)]
    return kv_shapes.plan([KVCacheGroupSpec(layers, spec)], REGIONS * SPAN + 1, "LBHNC")


def _region(i: int) -> list[int]:
    return list(range(1 + i * SPAN, 1 + (i + 1) * SPAN))


def _no_step(**kw: Any) -> SimpleNamespace:
    return SimpleNamespace(
        scheduled_new_reqs=[],
        scheduled_cached_reqs=SimpleNamespace(req_ids=[], num_computed_tokens=[]),
        num_scheduled_tokens={},
        **kw,
    )


class VLLMHost:
    window = W

    def __init__(self, store: Path, opts: Options) -> None:
        plan = _plan()
        (self.group,) = self.groups = group_layouts(plan, CHUNK)
        self.cfg = ConnectorConfig(
            store_dir=str(store),
            lower_dir=str(opts.lower) if opts.lower is not None else None,
            chunk_tokens=CHUNK,
            window=W,
            load_timeout_s=opts.timeout_s,
            rescan_s=opts.rescan_s,
        )
        self.model = model_identity(_SET_CONFIG)
        self.w = WorkerSide(self.cfg, self.groups, REGIONS * SPAN + 1, 0, 1, model=self.model)
        try:
            self.w.register(kv_shapes.allocate(plan))
            self.s = SchedulerSide(self.cfg, self.groups, self.model, 1)
            self.s.handshake({0: self.w.handshake()})
        except BaseException:
            self.w.close()
            raise
        self._rid = 0
        self._next = 0

    # -- vLLM's side of the conversation ----------------------------------------------
    def _id(self) -> str:
        self._rid += 1
        return f"r{self._rid}"

    def step(self, finished: set[str] | None = None, failed: set[str] | None = None) -> None:
        """The worker's per-step report handed to the scheduler side."""
        self.s.update_connector_output(
            SimpleNamespace(
                kv_connector_worker_meta=self.w.worker_meta(),
                finished_recving=finished,
                failed_recving=failed or set(),
            )
        )

    def idle_step(self) -> None:
        """An engine step with nothing scheduled: the scheduler side's metadata (its
        rechecks and resyncs) to the worker, the worker's report back."""
        self.w.submit(self.s.build_connector_meta(_no_step()))
        self.w.results(set())
        self.step()

    def _hit(self, req: Any) -> int:
        deadline = time.monotonic() + 30
        while True:
            self.idle_step()
            n, _ = self.s.get_num_new_matched_tokens(req, 0)
            if n is not None:
                return int(n)
            assert time.monotonic() < deadline, "the scheduler side kept asking to wait"
            time.sleep(0.02)

    def region(self) -> list[int]:
        self._next += 1
        return _region(1 + (self._next - 1) % (REGIONS - 1))

    def _pages(self, blocks: list[int]) -> Any:
        records = [RecordOrder(self.group.index, c, c, tuple(blocks[c * PER : (c + 1) * PER]))
                   for c in range(CHUNKS)]  # fmt: skip
        return self.w.dest(Transfer("x", "m", tuple(records)), records, Guard())

    def _bytes(self, seed: int, c: int) -> torch.Tensor:
        rng = np.random.default_rng([seed, c, 0xC0])
        return torch.from_numpy(rng.integers(0, 256, self.group.record_bytes, dtype=np.uint8))

    def _put(self, blocks: list[int], seed: int) -> None:
        pages = self._pages(blocks)
        for c in range(CHUNKS):
            pages.install(c, self._bytes(seed, c))
        pages.synchronize()

    def _has(self, blocks: list[int], seed: int, n: int) -> bool:
        pages = self._pages(blocks)
        out = torch.empty(self.group.record_bytes, dtype=torch.uint8)
        for c in range(n):
            pages.extract(c, out)
            if not torch.equal(out, self._bytes(seed, c)):
                return False
        return True

    def _saves(self) -> int:
        snap = self.w.metrics.snapshot()
        return int(sum(v for k, v in snap.items() if k.startswith(SAVES)))

    # -- the Host interface ------------------------------------------------------------
    def save(self, seed: int) -> Saved:
        toks = tokens(seed, CHUNKS * CHUNK + 10)
        req = scheduler_request(self._id(), toks)
        rid = req.request_id
        blocks = _region(0)
        self._put(blocks, seed)  # the prefill's forward wrote these blocks
        self._hit(req)
        ended = self._saves()
        saved_before = int(self.w.metrics.snapshot().get(SAVES + "saved}", 0))
        meta = self.s.build_connector_meta(
            SimpleNamespace(
                scheduled_new_reqs=[SimpleNamespace(req_id=rid, num_computed_tokens=0)],
                scheduled_cached_reqs=SimpleNamespace(req_ids=[], num_computed_tokens=[]),
                num_scheduled_tokens={rid: len(toks)},
                kv_connector_block_state=SimpleNamespace(get_block_ids=lambda r: (blocks,)),
            )
        )
        self.w.submit(meta)
        self.w.save_step(meta)
        cut = sum(len(t.records) for t in meta.step_saves)
        deadline = time.monotonic() + 30
        while self._saves() - ended < cut:
            assert time.monotonic() < deadline, self.w.metrics.snapshot()
            time.sleep(0.02)
        snap = self.w.metrics.snapshot()
        written = int(snap.get(SAVES + "saved}", 0))
        self.step()
        req.num_computed_tokens = len(toks)
        self.s.request_finished(req, (blocks,))
        done = self.s.build_connector_meta(_no_step(finished_req_ids={rid}))
        self.w.submit(done)
        self.w.results({rid})
        self.step()
        paths = [record_path(Path(self.cfg.store_dir) / "chunks", self.w.key(meta.step_saves[0], r))
                 for r in meta.step_saves[0].records] if meta.step_saves else []  # fmt: skip
        ok = cut == CHUNKS and written - saved_before == CHUNKS
        return Saved(ok, paths, str(snap))

    def offered(self, seed: int) -> int:
        req = scheduler_request(self._id(), tokens(seed, CHUNKS * CHUNK + 10))
        return self._hit(req) // CHUNK

    def load_into(self, seed: int, blocks: list[int]) -> Loaded:
        req = scheduler_request(self._id(), tokens(seed, CHUNKS * CHUNK + 10))
        rid = req.request_id
        n = self._hit(req)
        if n == 0:
            return Loaded(0, True, "no hit")
        self.s.update_state_after_alloc(req, SimpleNamespace(get_block_ids=lambda: (blocks,)), n)
        self.w.submit(self.s.build_connector_meta(_no_step()))
        deadline = time.monotonic() + 120
        recving: set[str] = set()
        failed: set[str] = set()
        while rid not in recving | failed:
            assert time.monotonic() < deadline, "the load was never reported"
            _, got, bad = self.w.results()
            recving |= got
            failed |= bad
            time.sleep(0.02)
        self.step(finished={rid}, failed=failed & {rid})
        if rid in failed:
            return Loaded(0, True, "failed_recving")
        k = n // CHUNK
        return Loaded(k, self._has(blocks, seed, k), "finished_recving")

    def load(self, seed: int) -> Loaded:
        return self.load_into(seed, self.region())

    def start_load(self, seed: int) -> Background[list[int]]:
        return Background(self.load_into, seed, self.region())

    def unhealthy(self) -> bool:
        return bool(self.w.health())

    def reuse(self, pending: Any, seed: int) -> bool:
        """vLLM recomputes the failed request into its blocks (or hands them on)."""
        self._put(pending.dest, seed)
        return True

    def holds(self, pending: Any, seed: int) -> bool:
        return self._has(pending.dest, seed, CHUNKS)

    def relist(self, during: Callable[[], object]) -> None:
        """The inventory's next re-listing, with `during` run after the listing read the
        drive and before it ends (a wrapper of the listing call: a test double, to make
        the interleaving certain); its report then reaches the scheduler side."""
        real = inventory_module.list_records

        def listing_then(*args: Any, **kwargs: Any) -> Any:
            listed = real(*args, **kwargs)
            during()
            return listed

        with pytest.MonkeyPatch.context() as mp:
            mp.setattr(inventory_module, "list_records", listing_then)
            self.w.inventory.relist()
        self.step()

    def free_slots(self) -> int:
        return min(int(self.w.load_engine.free_slots()), int(self.w.save_engine.free_slots()))

    def broken_lease(self) -> AbstractContextManager[None]:
        return failing_lease(cuts, save_records_module)

    def close(self) -> None:
        self.s.close()
        self.w.close()


make = VLLMHost
