"""Worker side: each tensor-parallel worker loads and saves its own rank's records.

Design (one path, one job table, nothing unbounded):
- Records: a request's KV is one record per (KV cache group, chunk) for full groups
  and one per (group, chunk boundary) for window groups (layout.py). Each worker
  reads and writes its own rank's records; a group every rank holds the same bytes of
  (MLA) is written by rank 0 and read by all.
- Jobs: every load, finished-request save and step cut is a job of one job table
  (jobs.py), its deadline counted from submission; `get_transfer_results` polls the
  table, which reports each load and save once, when it ends or when its deadline passes
  (its blocks closed to it first), so vLLM never waits on a transfer that will not end,
  and names a held request once its jobs are past their copy.
- Loads run on the load lane (a thread) through the core's `load_records`: metadata
  discovery, then the windowed, verified install through the load engine's W slots
  straight into the request's blocks (`RequestPages`: per-group block ids, runs of
  consecutive blocks coalesced, vLLM's own local hit and null blocks skipped; fused
  copy-and-verify on the host). It stops at its first record no tier can deliver
  (that record withdrawn; the recompute starts at once instead of after the rest of
  the read: a later request meets the next bad record), and when vLLM aborts the
  request. Any failure on any group is reported in `failed_recving`, and vLLM's aggregator fails
  the request on every rank: that is the request-level commit, no group committed
  alone. A load abandoned at its deadline closes the request's `Guard` first, so no
  late install touches blocks vLLM hands to another request.
- Saves run on the save lane with an engine of their own, so neither lane waits behind
  the other. Records completed in a step are cut (cuts.py): window-group records in
  `wait_for_save` (their blocks are reused from the next step on), full-group ones,
  with `save_in_steps` (the default), by the writers while the request still holds its
  blocks. Full-group records left for a finished request go through the core's
  `save_records`; vLLM keeps the blocks until the worker reports the request in
  `finished_sending`. On a CPU worker a save's copies and writes run while a forward
  does (gate.py).
- Inventory: the worker alone lists its own records (its ranks' directories on its own
  node's drive) and reports them to the scheduler side: in its handshake before
  serving, then in bounded batches with every step's worker metadata, with what its
  saves, evictions and re-listings change (inventory.py).
- Health: a worker whose load timed out with a read still in flight (the load
  engine has fewer free slots than W with no load running) reports itself unhealthy
  in its per-step worker metadata; the scheduler answers 0 external tokens until it
  recovers. A load that gave up direct reads the kernel still holds (its blocks
  `unusable`) is not reported failed until they return (jobs.py `hold`): vLLM keeps
  those blocks the request's meanwhile, and the worker is unhealthy until then.
  Logging and events never kill a lane.
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
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import torch

from bsr_io._core import Engine
from bsr_io.errors import TierDown
from bsr_io.integrations.vllm.blocks import Guard, KVPages, RecordPlan, RequestPages
from bsr_io.integrations.vllm.config import ConnectorConfig
from bsr_io.integrations.vllm.cpus import (
    connector_cpus,
    lower_priority,
    pinner,
    threads_started_on,
)
from bsr_io.integrations.vllm.cuts import CutContext, StepCuts
from bsr_io.integrations.vllm.eventlog import EventLog
from bsr_io.integrations.vllm.gate import ForwardGate
from bsr_io.integrations.vllm.inventory import StoreInventory
from bsr_io.integrations.vllm.jobs import Details, Job, JobTable
from bsr_io.integrations.vllm.layout import GroupLayout
from bsr_io.integrations.vllm.metadata import (
    BsrHandshake,
    BsrMetadata,
    BsrWorkerMeta,
    RecordOrder,
    Transfer,
)
from bsr_io.integrations.vllm.metrics import SaveMetrics
from bsr_io.integrations.vllm.ranktier import RankTier
from bsr_io.load.records import COMPLETE, ZERO, LoadOptions, load_records
from bsr_io.metrics import RestoreMetrics
from bsr_io.model.keys import ChunkKey
from bsr_io.save.fence import step_fence
from bsr_io.save.records import save_records
from bsr_io.tiers.lower import LowerTier
from bsr_io.tiers.ssd import SSDTier

log = logging.getLogger("bsr_io.vllm")


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


def _log_quarantined_at_start(tiers: list[Any], rank: int) -> None:
    """The records the tiers' start scans quarantined (bad headers): they are no longer
    listed, so their requests just miss; the log says which record and why."""
    for tier in dict.fromkeys(tiers):
        for p in getattr(tier, "problems", ()):
            log.warning(
                "bsr-io: rank %d: record %s quarantined at start (%s); its requests recompute",
                rank,
                p.path,
                p.reason,
            )


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
        # Every thread started here (io_uring, lanes, inventory, a pool client's) and the
        # writers started later run off vLLM's OpenMP cores (cpus.py).
        self.cpus = connector_cpus(cfg.io_cpus)
        with threads_started_on(self.cpus):
            self._build(cfg, groups, num_blocks, rank, world_size, model)
        if self.cpus is not None:
            log.info("bsr-io: rank %d: connector threads on CPUs %s", rank, sorted(self.cpus))

    def _build(
        self,
        cfg: ConnectorConfig,
        groups: list[GroupLayout],
        num_blocks: int,
        rank: int,
        world_size: int,
        model: str,
    ) -> None:
        self.cfg = cfg
        self.deadlines = cfg.deadlines  # every wait's bound, from vLLM's step limit
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
            durable=cfg.durable_saves,
            write_timeout_s=self.deadlines.write_s,
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
        _log_quarantined_at_start([*load_tiers, self.ssd], rank)
        self.load_tiers = _fault_double(load_tiers, rank)
        roots = [cfg.store_dir] + ([cfg.lower_dir] if cfg.lower_dir else [])
        self.inventory = StoreInventory(roots, {f"-w{world_size}r{r}" for r in owned})
        self.inventory.start(cfg.rescan_s)
        self.metrics = RestoreMetrics()
        self.save_metrics = SaveMetrics(self.metrics.registry)
        if cfg.metrics_port is not None:
            from prometheus_client import start_http_server

            start_http_server(
                cfg.metrics_port + rank, addr="127.0.0.1", registry=self.metrics.registry
            )
        self.pages: KVPages | None = None
        self._save_nice = 0  # set in register, on a CPU worker (cpus.py lower_priority)
        self.gate = ForwardGate()  # set up in register, where the KV caches' device shows
        self._finish_saves: set[str] = set()  # requests given a finish save this step
        # Its thread starts at the first line, on the connector's CPUs at the saves' nice.
        self.events = EventLog(cfg.events_path or "", pinner(self.cpus, lambda: self._save_nice))
        # A request's records are written by kept threads, not by threads started and
        # joined per save (records.py `_each`); apart from the cuts' writers so that a
        # finish save's records never queue behind other requests' cuts.
        self.writers = ThreadPoolExecutor(
            max(1, cfg.window // 2),
            thread_name_prefix="bsr-save",
            initializer=pinner(self.cpus, lambda: self._save_nice),
        )
        # Every transfer of this worker is a job of one table (jobs.py): loads and finish
        # saves here, step cuts on W writers of their own (cuts.py).
        self.jobs = JobTable(
            {"load": self._load, "save": self._save},
            self._ended,
            on_hold=self._held,
            grace_s=self.deadlines.grace_s,
            # Only a destination that takes direct reads can be written after its load
            # was given up (blocks.py: RequestPages reads through slots today).
            hold_running_loads=bool(getattr(RequestPages, "direct_reads", False)),
            starved=lambda: self.save_engine.free_slots() == 0,
            starved_s=self.deadlines.starved_hold_s,
            name=f"bsr-r{rank}",
        )
        cut = CutContext(
            rank=rank,
            groups=self.groups,
            destination=self.dest,
            key=self.key,
            tier=self.save_tier,
            saved=self.note_saved,
            engine=self.save_engine,
            gate=self.gate,
            event=lambda fields: self.event(None, fields),
            metrics=self.save_metrics,
            deadlines=self.deadlines,
            budget_s=cfg.step_save_budget_s,
        )
        self.cuts = StepCuts(cut, self.jobs, writers=cfg.window)

    def register(self, kv_caches: dict[str, torch.Tensor]) -> None:
        self.pages = KVPages(kv_caches, list(self.groups.values()), self.num_blocks)
        if all(t.device.type == "cpu" for t in kv_caches.values()):
            self.gate.wait_s = self.cfg.save_gate_s  # a CPU worker (gate.py)
            # Its saves' threads below the engine core's (writers: as they start).
            self._save_nice = self.cfg.save_nice
            lower_priority(
                [*self.jobs.lane_threads("cut"), *self.jobs.lane_threads("save")], self._save_nice
            )
        groups = [describe(g) | {"model": self.model} for g in self.groups.values()]
        self.event(
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

    def mine(self, r: RecordOrder) -> bool:
        """Whether this rank writes record `r` (a replicated group: rank 0 only)."""
        return not self.groups[r.group].replicated or self.rank == 0

    def dest(self, t: Transfer, records: list[RecordOrder], guard: Guard) -> RequestPages:
        assert self.pages is not None, "register_kv_caches was not called"
        plans = [RecordPlan(self.groups[r.group], r.ids) for r in records]
        return RequestPages(self.pages, plans, guard)

    # -- called by vLLM's model runner, once per step ----------------------------------
    def submit(self, meta: BsrMetadata) -> None:
        """Queue this step's loads and finished requests' saves (start_load_kv)."""
        self.gate.opened()
        # Before this step's forward may reuse released requests' blocks (jobs.py).
        self.jobs.release(meta.released, self.cfg.step_save_budget_s)
        self.jobs.hold(meta.held, self.deadlines.hold_s)
        if self.rank in meta.resync:
            self.inventory.resync()
        for ns, hashes in meta.recheck.items():
            self.inventory.recheck(ns, hashes)
        for key_model, hashes in meta.touches.items():
            self.ssd.touch(
                ChunkKey(key_model, self.world_size, g.key_rank(self.rank), g.fingerprint(), h)
                for h in hashes
                for g in self.groups.values()
            )
        for t in meta.loads:
            self.jobs.submit("load", t, self.deadlines.load_s)
        for t in meta.finish_saves:
            self.jobs.submit("save", t, self.deadlines.save_s)
        # vLLM names these requests finished in this same step (`results`).
        self._finish_saves = {t.request_id for t in meta.finish_saves}

    def save_step(self, meta: BsrMetadata) -> None:
        """Cut the records this step completed (wait_for_save): cuts.py."""
        self.gate.closed()  # first: the writers it wakes wait for the next forward
        if meta.step_saves and self.pages is not None:
            # On a GPU the step's kernels may still run: its cuts copy after them.
            self.cuts.cut(meta, step_fence(self.pages.device))

    def note_saved(self, key: ChunkKey) -> None:
        # Written through to a pool too: no re-listing of the drive may take it back.
        self.inventory.saved(key.namespace(), key.chunk_hash, pinned=self.pool is not None)

    def results(self, finished: set[str] | None = None) -> tuple[set[str], set[str], set[str]]:
        """(finished_sending, finished_recving, failed_recving) since the last call.
        `finished`: requests vLLM finished this step; a load still running for one of
        them (an abort) is stopped."""
        if finished:
            self.jobs.abort(finished, "load")
            self.cuts.finished(finished, self._finish_saves)
        self._finish_saves = set()
        return self.jobs.poll()

    def _held(self, request_id: str, seconds: float, why: str) -> None:
        """A hold ended (jobs.py): vLLM frees the request's blocks now."""
        fields = {"kind": "hold", "request_id": request_id, "reason": why, "seconds": seconds}
        self.event(None, fields | {"outcome": ZERO if why else COMPLETE})

    def _ended(self, job: Job, details: Details) -> None:
        """The table's report of a job's end: the event log line."""
        outcome = COMPLETE if job.ok else ZERO
        self.event(job, {"outcome": outcome, "reason": job.reason, **details})
        if job.kind == "save":
            mine = int(details.get("records", sum(map(self.mine, job.transfer.records))))
            self.save_metrics.finish(
                mine,
                int(details.get("written", 0)),
                int(details.get("failed", 0 if job.ok else mine)),
                details.get("seconds"),
                started=job.started is not None,
            )
        elif not job.ok:
            # vLLM's own line says only that a rank failed: say which and why here.
            level = logging.INFO if job.aborted else logging.WARNING
            log.log(
                level,
                "bsr-io: rank %d: load of request %s failed (%s); recomputed on every rank",
                self.rank,
                job.request_id,
                job.reason,
            )

    def worker_meta(self) -> BsrWorkerMeta:
        skipped, lost = self.cuts.take_lost()
        why = self.health()
        report = {self.rank: self.inventory.take(self.cfg.report_batch)}
        unhealthy = {self.rank: why} if why else {}
        return BsrWorkerMeta(report, unhealthy, {self.rank}, skipped, lost)

    def handshake(self) -> BsrHandshake:
        """Before serving: this worker's rank and its inventory's first batch."""
        return BsrHandshake(self.rank, self.inventory.take(self.cfg.handshake_batch))

    def health(self) -> str:
        """Why this worker's loads cannot be trusted to finish now ("" when they can)."""
        stuck = self.jobs.stuck("load")
        if stuck:
            return stuck
        free = self.load_engine.free_slots()
        if not self.jobs.running("load") and free < self.cfg.window:
            return f"{self.cfg.window - free} read(s) still in flight after their load ended"
        return ""

    def _load(self, job: Job) -> tuple[bool, str, Details]:
        t = job.transfer
        records = list(t.records)
        dest = self.dest(t, records, job.guard)
        keys = [self.key(t, r) for r in records]
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
                should_stop=job.should_stop,
                committed_tokens=t.committed_tokens,
            ),
        )
        if not res.complete:
            # Nothing of a failed load may land later: close the blocks to it first.
            job.guard.close()
            if res.unusable_returned is not None:
                # Reads given up may still write these blocks: the failure is reported
                # (and vLLM recomputes into them, or frees them) only once they returned.
                why = (
                    f"{len(res.unusable_chunks)} direct read(s) given up (at the deadline, "
                    "or left with the kernel by an engine break-down) may still write them"
                )
                job.hold = (why, res.unusable_returned)
            # A pool copy that failed too is not reported again on the scheduler's recheck.
            for i in res.failed_chunks:
                self.inventory.unpin(keys[i].namespace(), keys[i].chunk_hash)
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
            # Restore traces (trace.py): when the lane took it and the read ended.
            "started_mono": job.started,
            "ended_mono": time.monotonic(),
            "timings": {k: round(v, 6) for k, v in res.timings.items()},
        }
        return res.complete, res.reason, extra

    def _save(self, job: Job) -> tuple[bool, str, Details]:
        t = job.transfer
        # The request's cuts first: once it is reported saved, all of it is.
        t_cuts = time.monotonic()
        self.jobs.wait_ended(t.request_id, "cut", job.deadline)
        phases = {"cuts": time.monotonic() - t_cuts}
        records = [r for r in t.records if self.mine(r)]
        if not records:
            return True, "", {"records": 0, "written": 0}
        dest = self.dest(t, records, job.guard)
        keys = [self.key(t, r) for r in records]
        layouts = [self.groups[r.group].record for r in records]
        failures: list[str] = []

        def done(i: int, error: BaseException | None) -> None:
            if error is None:
                self.note_saved(keys[i])
            else:
                failures.append(f"{keys[i].short()}: {error}")

        t0 = time.monotonic()
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
            pace=self.gate.wait,
            phases=phases,
            writers=self.writers,
        )
        extra = {
            "records": len(records),
            "written": written,
            "failed": len(failures),
            "seconds": time.monotonic() - t0,
            # Where a slow save's time went (seconds, summed over its writers).
            "phases": {k: round(v, 4) for k, v in phases.items()},
        }
        return not failures, "; ".join(failures[:3]), extra

    def event(self, job: Job | None, fields: dict[str, Any]) -> None:
        if not self.cfg.events_path:
            return
        try:
            doc: dict[str, Any] = {"rank": self.rank, "time": time.time()}
            if job is not None:
                doc |= {"kind": job.kind, "request_id": job.request_id}
            doc |= fields
            self.events.put((json.dumps(doc, default=str) + "\n").encode())
        except Exception:  # noqa: BLE001 - an event log that fails never stops a lane
            log.exception("bsr-io: could not write an event")

    def close(self) -> None:
        # Queued cuts end skipped (nothing reads blocks past close); a running one ends
        # by its own deadline: a slot within the hold's bound, then one write.
        self.jobs.close(max(5.0, self.deadlines.cut_s + self.deadlines.grace_s))
        self.inventory.close()
        self.writers.shutdown(wait=True, cancel_futures=True)
        for tier in dict.fromkeys([*self.load_tiers, self.save_tier]):
            try:
                tier.close()
            except Exception:  # noqa: BLE001 - closing what is left, best effort
                pass
        self.load_engine.close()
        self.save_engine.close()
        self.events.close()
