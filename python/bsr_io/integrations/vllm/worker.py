"""Worker side: each tensor-parallel worker restores and saves its own rank's chunks.

One background thread per worker runs transfers in order, loads before saves, through
one bsr-io Engine of W chunk-sized slots: RWS per worker is W x chunk whatever the
prefix length. A load is reported finished only after every chunk was read, verified
against its record checksum and installed; any failure (missing, corrupt, read error,
tier down, timeout) is reported in `failed_recving` as well, and vLLM's aggregator
then fails the request on every rank and recomputes it. vLLM has no timeout of its
own, so a load that passes `load_timeout_s` is reported failed here, and its blocks
are fenced off (`Guard`) before vLLM may reuse them.

`faults` in the config wraps the tiers in bsr-io's fault-injection test double
(bsr_io.testing.faults): tests use it to stall or lose a read on one rank. Production
configurations leave it empty.
"""

from __future__ import annotations

import json
import logging
import os
import queue
import threading
import time
from dataclasses import dataclass, field
from typing import Any

import torch

from bsr_io._core import Engine
from bsr_io.discovery import discover, holds
from bsr_io.integrations.vllm.blocks import Abandoned, Guard, RequestBlocks
from bsr_io.integrations.vllm.config import ConnectorConfig
from bsr_io.integrations.vllm.layout import block_views
from bsr_io.integrations.vllm.metadata import BsrMetadata, Transfer
from bsr_io.keys import ChunkKey
from bsr_io.layout import KVLayout
from bsr_io.metrics import RestoreMetrics
from bsr_io.restore import COMPLETE, ZERO, RestoreResult
from bsr_io.tiers.lower import LowerTier
from bsr_io.tiers.ssd import SSDTier
from bsr_io.window import Window

log = logging.getLogger("bsr_io.vllm")


def _fault_double(faults: list[dict[str, Any]], tiers: list[Any], rank: int) -> list[Any]:
    """`tiers` inside bsr-io's fault-injection test double. Fault positions count from
    the request's chunk 0: discovery hands each tier the request's keys first."""
    from bsr_io.testing.faults import FaultPlan

    return FaultPlan.from_json(json.dumps(faults)).wrap_all(tiers, rank)


@dataclass
class _Job:
    kind: str  # "load" | "save"
    transfer: Transfer
    deadline: float
    guard: Guard = field(default_factory=Guard)
    done: bool = False
    ok: bool = False
    reported: bool = False
    reason: str = ""


class WorkerSide:
    def __init__(self, cfg: ConnectorConfig, layout: KVLayout, layer_names: list[str],
                 num_blocks: int, rank: int, world_size: int) -> None:  # fmt: skip
        self.cfg = cfg
        self.layout = layout
        self.fingerprint = layout.fingerprint()
        self.layer_names = layer_names
        self.num_blocks = num_blocks
        self.rank = rank
        self.world_size = world_size
        self.engine = Engine(cfg.window, layout.chunk_bytes)
        lower = LowerTier(cfg.lower_dir, layout=layout) if cfg.lower_dir else None
        tiers: list[Any] = [
            SSDTier(cfg.store_dir, cfg.store_bytes, self.engine, layout=layout, evict_to=lower)
        ]
        if lower is not None:
            tiers.append(lower)
        if cfg.faults:
            tiers = _fault_double(cfg.faults, tiers, rank)
        self.tiers = tiers
        self.metrics = RestoreMetrics()
        if cfg.metrics_port is not None:
            from prometheus_client import start_http_server

            start_http_server(cfg.metrics_port + rank, addr="127.0.0.1",
                              registry=self.metrics.registry)  # fmt: skip
        self.layers: list[torch.Tensor] = []
        self._jobs: dict[tuple[str, str], _Job] = {}
        self._lock = threading.Lock()
        self._queue: queue.PriorityQueue = queue.PriorityQueue()
        self._seq = 0
        self._thread = threading.Thread(target=self._run, name=f"bsr-vllm-r{rank}", daemon=True)
        self._thread.start()

    def register(self, kv_caches: dict[str, torch.Tensor]) -> None:
        self.layers = block_views(kv_caches, self.layer_names, self.layout, self.num_blocks)

    # -- called by vLLM's model runner, once per step ----------------------------------------
    def submit(self, meta: BsrMetadata) -> None:
        now = time.monotonic()
        for kind, transfers, timeout, prio in (
            ("load", meta.loads, self.cfg.load_timeout_s, 0),
            ("save", meta.saves, self.cfg.save_timeout_s, 1),
        ):
            for t in transfers:
                job = _Job(kind, t, now + timeout)
                with self._lock:
                    self._jobs[(kind, t.request_id)] = job
                    self._seq += 1
                    self._queue.put((prio, self._seq, job))

    def results(self) -> tuple[set[str], set[str], set[str]]:
        """(finished_sending, finished_recving, failed_recving) since the last call."""
        sending, recving, failed = set(), set(), set()
        now = time.monotonic()
        with self._lock:
            jobs = list(self._jobs.items())
        for key, job in jobs:
            if not job.done and now > job.deadline:
                job.guard.close()  # from here on the transfer never touches the blocks
                with self._lock:
                    if not job.done:
                        job.done, job.ok = True, False
                        job.reason = f"timed out after {self._timeout(job)} s"
                        self._event(job, {"outcome": ZERO, "reason": job.reason})
            if not job.done:
                continue
            rid = job.transfer.request_id
            if job.kind == "load":
                recving.add(rid)
                if not job.ok:
                    failed.add(rid)
            else:
                sending.add(rid)
            with self._lock:
                self._jobs.pop(key, None)
        return sending, recving, failed

    def _timeout(self, job: _Job) -> float:
        return self.cfg.load_timeout_s if job.kind == "load" else self.cfg.save_timeout_s

    # -- the transfer thread ----------------------------------------------------------
    def _run(self) -> None:
        while True:
            _, _, job = self._queue.get()
            if job is None:
                return
            if job.done:
                continue  # timed out while queued
            try:
                ok, reason, extra = self._load(job) if job.kind == "load" else self._save(job)
            except Abandoned as exc:
                ok, reason, extra = False, str(exc), {}
            except Exception as exc:  # noqa: BLE001 - any failure is a zero-reuse outcome
                log.exception("bsr-io %s of %s failed", job.kind, job.transfer.request_id)
                ok, reason, extra = False, f"{type(exc).__name__}: {exc}", {}
            with self._lock:
                if job.done:
                    continue  # already reported as timed out
                job.ok, job.reason, job.done = ok, reason, True
                self._event(job, {"outcome": COMPLETE if ok else ZERO, "reason": reason, **extra})

    def _keys(self, t: Transfer) -> list[ChunkKey]:
        return [
            ChunkKey(t.key_model, self.world_size, self.rank, self.fingerprint, h)
            for h in t.chunk_hashes
        ]

    def _load(self, job: _Job) -> tuple[bool, str, dict]:
        t = job.transfer
        t0 = time.perf_counter()
        keys = self._keys(t)
        sources, _ = discover(self.tiers, keys, self.layout)
        n = len(keys)
        if len(sources) < n:
            return False, f"rank {self.rank}: chunk {len(sources)} is no longer stored", {}
        per = self.layout.chunk_tokens // self.layout.groups[0].block_tokens
        first = t.first_block // per  # chunks wholly inside vLLM's local hit are not read
        dest = RequestBlocks(self.layout, self.layers, t.block_ids, t.first_block, job.guard)
        self.engine.reset_peak()
        window = Window(self.engine, self.tiers, self.layout.chunk_bytes, self.cfg.window)
        report = window.run(
            keys[first:],
            sources[first:],
            _Shifted(dest, first),
            should_stop=lambda: job.done,
        )
        if not report.error and report.installed < n - first:
            report.error = "stopped before every chunk was installed"
        ok = not report.error
        total = time.perf_counter() - t0
        result = RestoreResult(
            outcome=COMPLETE if ok else ZERO,
            committed_tokens=(n * self.layout.chunk_tokens) if ok else 0,
            committed_chunks=n if ok else 0,
            hit_chunks=n,
            source_tiers=report.sources,
            fallbacks=report.fallbacks,
            reason=report.error,
            rws_peak_bytes=self.engine.peak_bytes(),
            bytes_read=report.bytes_read,
            timings={
                "total_s": total,
                "read_wait_s": report.read_wait_s,
                "install_copy_s": report.install_s,
            },  # fmt: skip
        )
        self.metrics.observe(result)
        extra = {
            "chunks": n,
            "chunks_read": report.installed,
            "rws_peak_bytes": result.rws_peak_bytes,
            "chunk_bytes": self.layout.chunk_bytes,
            "window": self.cfg.window,
            "bytes_read": report.bytes_read,
            "fallbacks": len(report.fallbacks),
            "seconds": total,
        }
        return ok, report.error, extra

    def _save(self, job: _Job) -> tuple[bool, str, dict]:
        t = job.transfer
        t0 = time.perf_counter()
        keys = self._keys(t)
        dest = RequestBlocks(self.layout, self.layers, t.block_ids, 0, job.guard)
        n = self.layout.chunk_bytes
        top = self.tiers[0]
        written = 0
        for i, key in enumerate(keys):
            if job.done:
                return False, "save timed out", {"written": written}
            if any(holds(tier, key) for tier in self.tiers):
                continue
            slot = self.engine.lease()
            view = torch.frombuffer(slot, dtype=torch.uint8, count=n)
            try:
                dest.extract(i, view)
                del view
                slot.set_length(n)
                top.write(key, slot, self.layout)  # checksummed, crash-safe publish
            finally:
                del slot
            written += 1
        return True, "", {"chunks": len(keys), "written": written,
                          "seconds": time.perf_counter() - t0}  # fmt: skip

    def _event(self, job: _Job, fields: dict) -> None:
        if not self.cfg.events_path:
            return
        doc = {"rank": self.rank, "kind": job.kind, "request_id": job.transfer.request_id,
               "time": time.time(), **fields}  # fmt: skip
        line = (json.dumps(doc, default=str) + "\n").encode()
        fd = os.open(self.cfg.events_path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o600)
        try:
            os.write(fd, line)  # one O_APPEND write per line: lines of ranks never mix
        finally:
            os.close(fd)

    def close(self) -> None:
        self._queue.put((-1, -1, None))
        self._thread.join(timeout=5)
        for tier in self.tiers:
            tier.close()
        self.engine.close()


class _Shifted:
    """The destination seen from a window that starts at chunk `offset` of the request."""

    def __init__(self, dest: RequestBlocks, offset: int) -> None:
        self.dest = dest
        self.offset = offset
        self.capacity_chunks = dest.capacity_chunks - offset

    def install(self, chunk_index: int, payload: torch.Tensor):
        return self.dest.install(chunk_index + self.offset, payload)

    def extract(self, chunk_index: int, out: torch.Tensor) -> None:
        self.dest.extract(chunk_index + self.offset, out)

    def synchronize(self) -> None:
        self.dest.synchronize()
