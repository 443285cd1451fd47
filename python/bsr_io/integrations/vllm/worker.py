"""Worker side: each tensor-parallel worker loads and saves its own rank's records.

Design (one path, two lanes, nothing unbounded):
- Records: a request's KV is one record per (KV cache group, chunk) for full groups
  and one per (group, chunk boundary) for window groups (layout.py). Each worker
  reads and writes its own rank's records; a group every rank holds the same bytes of
  (MLA) is written by rank 0 and read by all.
- Loads run on the load lane (a thread) through the core's `load_records`: metadata
  discovery, then the windowed, verified install through the load engine's W slots
  straight into the request's blocks (`RequestPages`: per-group block ids, runs of
  consecutive blocks coalesced, vLLM's own local hit and null blocks skipped; fused
  copy-and-verify on the host). Its deadline counts from when the load starts. Any
  failure on any group is reported in `failed_recving`, and vLLM's aggregator fails
  the request on every rank: that is the request-level commit, no group committed
  alone. A load abandoned at its deadline closes the request's `Guard` first, so no
  late install touches blocks vLLM hands to another request.
- Saves run on the save lane with an engine of their own, so neither lane waits behind
  the other. Window-group records are cut in `wait_for_save` of the step that
  completed them (their blocks are freed and reused from the next step on): each is
  extracted into a save-engine slot synchronously, waiting at most
  `step_save_budget_s` per step for slots (past it the record is skipped: a future
  miss, counted), then written (checksummed, crash-safe) by up to W writers.
  Full-group records of a finished request go through the core's `save_records`;
  vLLM keeps the blocks until the worker reports the request in `finished_sending`.
- Health: a worker whose load timed out with a read still in flight (the load
  engine has fewer free slots than W with no load running) reports itself unhealthy
  in its per-step worker metadata; the scheduler answers 0 external tokens until it
  recovers. Logging and events never kill a lane.
- Staging: the load engine holds W slots of the largest record of any group, so the
  RWS of a restore is at most W x that; the save engine holds W more for saves.

`BSR_IO_FAULTS` in the environment wraps the load tiers in bsr-io's fault-injection
test double (bsr_io.faults), as it does for every integration; the connector's
configuration has no fault key.
"""

from __future__ import annotations

import json
import logging
import os
import queue
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor
from concurrent.futures import wait as wait_all
from dataclasses import dataclass, field
from typing import Any

import torch

from bsr_io._core import Engine, Slot
from bsr_io.engine import as_tensor, give_back, lease
from bsr_io.errors import EngineBusy, TierDown
from bsr_io.integrations.vllm.blocks import Guard, KVPages, RecordPlan, RequestPages
from bsr_io.integrations.vllm.config import ConnectorConfig
from bsr_io.integrations.vllm.layout import GroupLayout
from bsr_io.integrations.vllm.metadata import BsrMetadata, BsrWorkerMeta, RecordOrder, Transfer
from bsr_io.integrations.vllm.ranktier import RankTier
from bsr_io.load.records import COMPLETE, ZERO, LoadOptions, load_records
from bsr_io.metrics import RestoreMetrics
from bsr_io.model.keys import ChunkKey
from bsr_io.save.records import save_records
from bsr_io.tiers.lower import LowerTier
from bsr_io.tiers.ssd import SSDTier

log = logging.getLogger("bsr_io.vllm")
_GRACE_S = 2.0  # past a job's own deadline, the watchdog gives up on it


def _fault_double(tiers: list[Any], rank: int) -> list[Any]:
    """`tiers` inside bsr-io's fault-injection test double when the environment holds a
    plan (`BSR_IO_FAULTS`, as everywhere in bsr-io); `tiers` unchanged otherwise. Fault
    positions count from the request's first record: discovery hands each tier the
    request's keys first."""
    if not os.environ.get("BSR_IO_FAULTS", "").strip():
        return tiers  # production: the test double is not even imported
    from bsr_io.faults import FaultPlan

    plan = FaultPlan.from_env()
    log.warning("bsr-io: fault injection (BSR_IO_FAULTS) on rank %d: %s", rank, plan.to_json())
    return list(plan.wrap_all(tiers, rank))


@dataclass
class _Job:
    kind: str  # "load" | "save"
    transfer: Transfer
    timeout_s: float
    guard: Guard = field(default_factory=Guard)
    started: float | None = None  # time.monotonic() when a lane took it
    done: bool = False
    ok: bool = False
    reason: str = ""

    @property
    def deadline(self) -> float | None:
        return None if self.started is None else self.started + self.timeout_s


def describe(g: GroupLayout) -> dict[str, Any]:
    """A group as the event log records it (enough to rebuild its record layout)."""
    return {
        "index": g.index,
        "kind": g.kind,
        "spec": g.spec,
        "block_tokens": g.block_tokens,
        "window": g.window,
        "replicated": g.replicated,
        "fingerprint": g.fingerprint(),
        "record_name": g.record.name,
        "record_pages": g.record_blocks,
        "record_bytes": g.record_bytes,
        "layers": [
            [grp.name, lp.page_bytes] for grp, lp in zip(g.record.groups, g.layers, strict=True)
        ],
    }


class WorkerSide:
    def __init__(
        self,
        cfg: ConnectorConfig,
        groups: list[GroupLayout],
        num_blocks: int,
        rank: int,
        world_size: int,
        model: str = "",
    ) -> None:
        self.cfg = cfg
        self.model = model  # the model identity keys are made under (for the event log)
        self.groups = {g.index: g for g in groups}
        self.num_blocks = num_blocks
        self.rank = rank
        self.world_size = world_size
        self.slot_bytes = max(g.record_bytes for g in groups)
        self.load_engine = Engine(cfg.window, self.slot_bytes)
        self.save_engine = Engine(cfg.window, self.slot_bytes)
        lower = LowerTier(cfg.lower_dir) if cfg.lower_dir else None
        # One directory, two tier objects: each moves payloads through its own engine.
        # The save side's index holds this worker's records only (ranktier.py).
        load_tiers: list[Any] = [SSDTier(cfg.store_dir, None, self.load_engine)]
        if lower is not None:
            load_tiers.append(lower)
        owned = {g.key_rank(rank) for g in groups}
        self.ssd = RankTier(
            cfg.store_dir,
            cfg.store_bytes,
            self.save_engine,
            world_size=world_size,
            ranks=owned,
            evict_to=lower,
        )
        self.save_tier: Any = self.ssd
        self.pool: Any = None
        if cfg.mooncake is not None:
            # A pool below the SSD tier: saves write through, loads read it on an SSD miss.
            from bsr_io.store import Store
            from bsr_io.tiers.mooncake import MooncakeTier

            self.pool = MooncakeTier(cfg.mooncake)
            load_tiers.append(self.pool)
            self.save_tier = Store([self.ssd, self.pool])
            # The save slots registered once: otherwise every put registers its slot
            # with the metadata server and back (a TP=2 run lost a save to a timeout).
            try:
                self.pool.register_engine(self.save_engine)
            except TierDown as exc:
                log.warning(
                    "bsr-io: rank %d: save slots not registered with the pool "
                    "(%s); each put registers its own",
                    rank,
                    exc,
                )
        self.load_tiers = _fault_double(load_tiers, rank)
        self.metrics = RestoreMetrics()
        if cfg.metrics_port is not None:
            from prometheus_client import start_http_server

            start_http_server(
                cfg.metrics_port + rank, addr="127.0.0.1", registry=self.metrics.registry
            )
        self.pages: KVPages | None = None
        self._lock = threading.Lock()
        self._jobs: dict[tuple[str, str], _Job] = {}
        self._saved: dict[str, set[int]] = {}
        self._skipped = 0
        self._stuck = ""  # why the load lane is wedged (watchdog), "" when it is not
        self._loads: queue.Queue[_Job | None] = queue.Queue()
        self._saves: queue.Queue[_Job | None] = queue.Queue()
        self._writers = ThreadPoolExecutor(cfg.window, thread_name_prefix=f"bsr-w{rank}")
        self._writing: dict[str, list[Future[None]]] = {}  # request -> its window writes
        self._lanes = [
            threading.Thread(
                target=self._lane,
                args=(self._loads, self._load),
                name=f"bsr-load-r{rank}",
                daemon=True,
            ),
            threading.Thread(
                target=self._lane,
                args=(self._saves, self._save),
                name=f"bsr-save-r{rank}",
                daemon=True,
            ),
        ]
        for t in self._lanes:
            t.start()

    def register(self, kv_caches: dict[str, torch.Tensor]) -> None:
        self.pages = KVPages(kv_caches, list(self.groups.values()), self.num_blocks)
        groups = [describe(g) | {"model": self.model} for g in self.groups.values()]
        self._event(
            None,
            {
                "kind": "start",
                "storages": len(self.pages.tensors),
                "model": self.model,
                "groups": groups,
            },
        )

    # -- keys ------------------------------------------------------------------------
    def key(self, t: Transfer, r: RecordOrder) -> ChunkKey:
        g = self.groups[r.group]
        return ChunkKey(
            t.key_model, self.world_size, g.key_rank(self.rank), g.fingerprint(), r.chunk_hash
        )

    def _mine(self, r: RecordOrder) -> bool:
        """Whether this rank writes record `r` (a replicated group: rank 0 only)."""
        return not self.groups[r.group].replicated or self.rank == 0

    def _dest(self, t: Transfer, records: list[RecordOrder], guard: Guard) -> RequestPages:
        assert self.pages is not None, "register_kv_caches was not called"
        plans = [RecordPlan(self.groups[r.group], r.ids) for r in records]
        return RequestPages(self.pages, plans, guard)

    # -- called by vLLM's model runner, once per step ----------------------------------
    def submit(self, meta: BsrMetadata) -> None:
        """Queue this step's loads and finished requests' saves (start_load_kv)."""
        for key_model, hashes in meta.touches.items():
            self.ssd.touch(
                ChunkKey(key_model, self.world_size, g.key_rank(self.rank), g.fingerprint(), h)
                for h in hashes
                for g in self.groups.values()
            )
        for kind, transfers, timeout, lane in (
            ("load", meta.loads, self.cfg.load_timeout_s, self._loads),
            ("save", meta.finish_saves, self.cfg.save_timeout_s, self._saves),
        ):
            for t in transfers:
                job = _Job(kind, t, timeout)
                with self._lock:
                    self._jobs[(kind, t.request_id)] = job
                lane.put(job)

    def save_step(self, meta: BsrMetadata) -> None:
        """Cut this step's window-group records while their blocks still hold them
        (wait_for_save): extracted into save slots now, written by the writers."""
        if not meta.step_saves or self.pages is None:
            return
        budget_end = time.monotonic() + self.cfg.step_save_budget_s
        for t in meta.step_saves:
            for r in t.records:
                if not self._mine(r):
                    continue
                g = self.groups[r.group]
                try:
                    slot = lease(self.save_engine, budget_end)
                except EngineBusy:
                    with self._lock:
                        self._skipped += 1
                    continue
                try:
                    dest = self._dest(t, [r], Guard())
                    view = as_tensor(slot, length=g.record_bytes)
                    dest.extract(0, view)
                    del view
                    slot.set_length(g.record_bytes)
                except BaseException:
                    give_back(slot)
                    raise
                fut = self._writers.submit(self._write, self.key(t, r), g, slot)
                with self._lock:
                    self._writing.setdefault(t.request_id, []).append(fut)

    def _write(self, key: ChunkKey, g: GroupLayout, slot: Slot) -> None:
        try:
            self.save_tier.write(key, slot, g.record)
            self._note_saved(key)
        except Exception as exc:  # noqa: BLE001 - a failed save is a future miss
            log.warning("bsr-io: save of %s failed: %s", key.short(), exc)
        finally:
            give_back(slot)

    def _note_saved(self, key: ChunkKey) -> None:
        with self._lock:
            self._saved.setdefault(key.namespace(), set()).add(key.chunk_hash)

    def results(self) -> tuple[set[str], set[str], set[str]]:
        """(finished_sending, finished_recving, failed_recving) since the last call."""
        sending: set[str] = set()
        recving: set[str] = set()
        failed: set[str] = set()
        now = time.monotonic()
        with self._lock:
            jobs = list(self._jobs.items())
            for rid in [r for r, fs in self._writing.items() if all(f.done() for f in fs)]:
                del self._writing[rid]  # written, and no finished-request save waits on them
        for key, job in jobs:
            deadline = job.deadline
            if not job.done and deadline is not None and now > deadline + _GRACE_S:
                # The lane is past its own deadline (a wait without one): give up on the
                # job; from here on nothing touches its blocks.
                job.guard.close()
                with self._lock:
                    if not job.done:
                        job.done, job.ok = True, False
                        job.reason = f"{job.kind} did not end within {job.timeout_s} s"
                        if job.kind == "load":
                            self._stuck = job.reason
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

    def worker_meta(self) -> BsrWorkerMeta:
        with self._lock:
            saved, self._saved = self._saved, {}
            skipped, self._skipped = self._skipped, 0
        why = self.health()
        return BsrWorkerMeta(saved, {self.rank: why} if why else {}, {self.rank}, skipped)

    def health(self) -> str:
        """Why this worker's loads cannot be trusted to finish now ("" when they can)."""
        if self._stuck:
            return self._stuck
        with self._lock:
            loading = any(
                j.kind == "load" and j.started is not None and not j.done
                for j in self._jobs.values()
            )
        free = self.load_engine.free_slots()
        if not loading and free < self.cfg.window:
            return f"{self.cfg.window - free} read(s) still in flight after their load ended"
        return ""

    # -- the lanes --------------------------------------------------------------------
    def _lane(self, jobs: queue.Queue[_Job | None], run: Any) -> None:
        while True:
            job = jobs.get()
            if job is None:
                return
            if job.done:
                continue
            job.started = time.monotonic()
            try:
                ok, reason, extra = run(job)
            except Exception as exc:  # noqa: BLE001 - any failure is a zero-reuse outcome
                log.exception("bsr-io %s of %s failed", job.kind, job.transfer.request_id)
                ok, reason, extra = False, f"{type(exc).__name__}: {exc}", {}
            with self._lock:
                if job.kind == "load":
                    self._stuck = ""  # the lane is moving again
                if job.done:
                    continue  # the watchdog reported it already
                job.ok, job.reason, job.done = ok, reason, True
            self._event(job, {"outcome": COMPLETE if ok else ZERO, "reason": reason, **extra})

    def _load(self, job: _Job) -> tuple[bool, str, dict[str, Any]]:
        t = job.transfer
        records = list(t.records)
        dest = self._dest(t, records, job.guard)
        keys = [self.key(t, r) for r in records]
        assert job.deadline is not None
        res = load_records(
            self.load_engine,
            self.load_tiers,
            keys,
            dest,
            LoadOptions(
                sizes=dest.sizes(),
                chunk_bytes=self.slot_bytes,
                width=self.cfg.window,
                deadline=job.deadline,
                should_stop=lambda: job.done or not job.guard.open,
                committed_tokens=t.committed_tokens,
                keep_going=True,
            ),
        )
        if not res.complete:
            # Nothing of a failed load may land later: close the blocks to it first.
            job.guard.close()
        else:
            self.ssd.touch(keys)  # restored: the last of this rank's records to evict
        self.metrics.observe(res)
        per_group: dict[str, int] = {}
        for r, size in zip(records, dest.sizes(), strict=True):
            name = str(r.group)
            per_group[name] = per_group.get(name, 0) + size
        extra = {
            "records": len(records),
            "chunks": t.committed_tokens // self.groups[records[0].group].chunk_tokens,
            "chunks_read": len({r.chunk for r in records}) if res.complete else 0,
            "committed_tokens": res.committed_tokens,
            "rws_peak_bytes": res.rws_peak_bytes,
            "slot_bytes": self.slot_bytes,
            "window": self.cfg.window,
            "bytes_read": res.bytes_read,
            "bytes_by_group": per_group,
            "fallbacks": len(res.fallbacks),
            "timed_out": res.timed_out,
            "seconds": res.timings.get("total_s", 0.0),
        }
        return res.complete, res.reason, extra

    def _save(self, job: _Job) -> tuple[bool, str, dict[str, Any]]:
        t = job.transfer
        with self._lock:
            writing = self._writing.pop(t.request_id, [])
        assert job.deadline is not None
        # The request's window records first: once it is reported saved, all of it is.
        wait_all(writing, timeout=max(0.0, job.deadline - time.monotonic()))
        records = [r for r in t.records if self._mine(r)]
        if not records:
            return True, "", {"records": 0, "written": 0}
        dest = self._dest(t, records, job.guard)
        keys = [self.key(t, r) for r in records]
        layouts = [self.groups[r.group].record for r in records]
        failures: list[str] = []

        def done(i: int, error: BaseException | None) -> None:
            if error is None:
                self._note_saved(keys[i])
            else:
                failures.append(f"{keys[i].short()}: {error}")

        written = save_records(
            self.save_engine,
            self.save_tier,
            keys,
            layouts,
            dest,
            deadline=job.deadline,
            skip_existing=True,
            width=max(1, self.cfg.window // 2),
            on_done=done,
        )
        extra = {"records": len(records), "written": written, "failed": len(failures)}
        return not failures, "; ".join(failures[:3]), extra

    def _event(self, job: _Job | None, fields: dict[str, Any]) -> None:
        if not self.cfg.events_path:
            return
        try:
            doc: dict[str, Any] = {"rank": self.rank, "time": time.time()}
            if job is not None:
                doc |= {"kind": job.kind, "request_id": job.transfer.request_id}
            doc |= fields
            line = (json.dumps(doc, default=str) + "\n").encode()
            fd = os.open(self.cfg.events_path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o600)
            try:
                os.write(fd, line)  # one O_APPEND write per line: lines of ranks never mix
            finally:
                os.close(fd)
        except Exception:  # noqa: BLE001 - an event log that fails never stops a lane
            log.exception("bsr-io: could not write an event")

    def close(self) -> None:
        self._loads.put(None)
        self._saves.put(None)
        for t in self._lanes:
            t.join(timeout=5)
        self._writers.shutdown(wait=True)
        for tier in dict.fromkeys([*self.load_tiers, self.save_tier]):
            try:
                tier.close()
            except Exception:  # noqa: BLE001 - closing what is left, best effort
                pass
        self.load_engine.close()
        self.save_engine.close()
