"""Scheduler side: discovery from the in-memory catalog, load plans, save orders.

The hit is the largest number n of whole chunks (leaving at least one token to
compute) such that on every TP rank every full group holds the chunks vLLM does not
already have locally, [local // chunk, n), and every window group holds its record at
boundary n - 1: exactly what a restore to n * chunk_tokens reads. Nothing here touches
the file system: what each rank holds comes from that rank's worker (catalog.py), so
ranks on other nodes, with drives of their own, are known as well as local ones. While
any worker reports its I/O stuck, the answer is 0: vLLM recomputes rather than queue
loads behind a wedged read.

Saves: each step, for every scheduled request, the chunk boundaries this step
completes (from the request's tokens and its computed and scheduled counts, read
before vLLM advances them) become window-group save orders, cut by the workers in
`wait_for_save` while the blocks still hold them. When a request finishes, every whole
chunk it computed (generated tokens included) that the catalog lacks is saved for the
full groups; vLLM keeps its blocks until every worker reports the save done.

A record cut in a step is known here only once a worker's report says it was written,
which comes with the step after its write ends; on an idle engine that is the next
request's first step. So a lookup whose hit a cut still in flight would lengthen answers
"ask again" (None, as while a long prompt is hashed), for at most `_CUT_WAIT_S` per
request, until the report lands or the cut is reported lost: vLLM steps meanwhile,
and each step carries the workers' reports.

An idle engine steps only while vLLM has work: a finished request whose blocks it keeps
for a hold or a finish save is such work in vLLM 0.32 to 0.34 (`has_finished_requests`),
but the reports that come after (the cuts' records written, lost, or a rank's start
inventory still arriving) are not. `has_pending_push_work` keeps it stepping until each
has arrived or its bound passed, so the next request finds the catalog current and does
not wait for them. `has_pending_block_frees` says a hold is pending: vLLM then waits for
its blocks (two writes' deadlines at most) rather than preempt a running request.
"""

from __future__ import annotations

import logging
import time
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field, replace
from typing import Any

from bsr_io.integrations.vllm.catalog import RecordCatalog
from bsr_io.integrations.vllm.config import ConnectorConfig
from bsr_io.integrations.vllm.identity import request_key_model
from bsr_io.integrations.vllm.layout import FULL, WINDOW, GroupLayout
from bsr_io.integrations.vllm.metadata import (
    BsrHandshake,
    BsrMetadata,
    BsrWorkerMeta,
    Cut,
    Inventory,
    RecordOrder,
    Transfer,
    cut_key,
    cut_of,
)
from bsr_io.integrations.vllm.trace import RestoreTrace
from bsr_io.model.keys import extend_prefix_hashes, model_digest

log = logging.getLogger("bsr_io.vllm")
_SILENT_STEPS = 3  # steps in a row a worker may miss before its rank holds nothing
# How long one request may wait for cuts in flight: a cut's write takes milliseconds, so
# this is reached only behind a slow drive or while chasing another request's prefill.
_CUT_WAIT_S = 1.0
_SETTLE_S = 0.1  # how late `has_pending_push_work` may see cuts past their age go


@dataclass
class _Request:
    request: Any  # vLLM's Request: its token ids grow with the output
    key_model: str | None
    hashes: list[int] = field(default_factory=list)
    local_tokens: int = 0  # vLLM's own hit when last asked
    hit_chunks: int = 0
    loading: bool = False
    failed: bool = False
    loaded: list[tuple[int, int]] = field(default_factory=list)  # (group, chunk) loading
    memo: tuple[int, int, int, int] | None = None  # (catalog version, first, limit) -> hit
    local_seen: int = 0  # vLLM's own hit, as last offered to get_num_new_matched_tokens
    touched: bool = False  # its chunks' recency sent to the workers once
    hashing: Future[list[int]] | None = None  # a long prompt being hashed off this thread
    step_saved: set[int] = field(default_factory=set)  # full-group chunks cut in a step
    cut_wait_end: float | None = None  # when it stops waiting for cuts in flight


class SchedulerSide:
    def __init__(
        self,
        cfg: ConnectorConfig,
        groups: list[GroupLayout],
        model: str,
        world_size: int,
        catalog: RecordCatalog | None = None,
        nnodes: int = 1,
    ) -> None:
        self.cfg = cfg
        self.nnodes = nnodes
        self._set_groups(groups)
        self.model = model
        self.world_size = world_size
        self.chunk = cfg.chunk_tokens
        self.catalog = catalog if catalog is not None else RecordCatalog()
        self._ns: dict[str, dict[int, list[str]]] = {}  # key_model -> group -> dirs
        self._fingerprints: dict[int, str] = {}  # group -> fingerprint, from the workers
        self._reqs: dict[str, _Request] = {}
        self._loads: list[Transfer] = []
        self._finish: list[Transfer] = []
        self._touches: dict[str, list[int]] = {}
        self.unhealthy: dict[int, str] = {}
        self.skipped_saves = 0
        self._recheck: dict[str, list[int]] = {}  # dropped after a failed load
        self._resync: set[int] = set()
        self._silent: dict[int, int] = {}  # worker rank -> steps in a row without its report
        self._cutting: dict[Cut, float] = {}  # cuts ordered, not yet reported -> when
        self._settled = 0.0  # when `_cutting` was last settled
        self._held: set[str] = set()  # finished, blocks kept for cuts in flight
        # Finished requests whose blocks vLLM keeps for us, until the workers name them in
        # finished_sending -> when we stop waiting for that (twice the workers' bound).
        self._holding: dict[str, float] = {}  # held for cuts still copying
        self._saving: dict[str, float] = {}  # given a finish save
        self._unsynced: set[int] = set()  # worker ranks still reporting their start listing
        self._hasher = ThreadPoolExecutor(1, thread_name_prefix="bsr-io-hash")
        self.trace = RestoreTrace(cfg.events_path)  # restored requests' marks (trace.py)

    def start(self) -> None:
        """Nothing to list: the workers' handshakes bring what each rank holds."""

    def _set_groups(self, groups: list[GroupLayout]) -> None:
        self.groups = groups
        self.full = [g for g in groups if g.kind == FULL]
        self.window = [g for g in groups if g.kind == WINDOW]

    def handshake(self, metadata: dict[int, Any]) -> None:
        """Each worker's first inventory batch, gathered by vLLM before serving."""
        shakes = [hs for hs in metadata.values() if isinstance(hs, BsrHandshake)]
        self.adopt_nodes([hs.node for hs in shakes if hs.node])
        for hs in shakes:
            self.adopt_fingerprints(hs.fingerprints)
            self._report(hs.rank, hs.inventory)

    def adopt_nodes(self, nodes: list[str]) -> None:
        """The workers' nodes (nodes.py): "auto" decided here from vLLM's nnodes alone
        before them stores a replicated group once; ranks on nodes of their own each
        store their own copy, as the workers decided from the same reports."""
        if self.cfg.replicate_once(self.nnodes, nodes) or not any(
            g.replicated for g in self.groups
        ):
            return
        log.info(
            "bsr-io: the TP ranks report %d nodes: replicated groups per rank", len(set(nodes))
        )
        self._set_groups([replace(g, replicated=False) for g in self.groups])
        self._ns.clear()

    def adopt_fingerprints(self, fingerprints: dict[int, str]) -> None:
        """The workers' group fingerprints. vLLM gives the scheduler one layer's spec for
        a group whose layers differ (DeepSeek-V4's compressed and indexer caches share a
        group: `generate_scheduler_kv_cache_config`), so a fingerprint made here from it
        names a directory no worker writes; the workers' name the real ones."""
        if fingerprints and fingerprints != self._fingerprints:
            self._fingerprints = dict(fingerprints)
            self._ns.clear()

    def close(self) -> None:
        self._hasher.shutdown(wait=False, cancel_futures=True)

    def _report(self, rank: int, inv: Inventory) -> None:
        self.catalog.report(rank, inv)
        if inv.synced:
            self._unsynced.discard(rank)
        else:
            self._unsynced.add(rank)

    # -- keeping an idle engine stepping -------------------------------------------------
    def has_pending_push_work(self) -> bool:
        """Whether a report the workers still owe needs vLLM to step: a held or saved
        request not yet named in finished_sending, a cut not yet reported written or
        lost, a rank's start listing not yet all reported. Each ends by its bound.
        vLLM asks this several times a step, and an idle step every few ms: it looks
        at the holds and saves, not at every cut."""
        self._expire()
        return bool(self._holding or self._saving or self._cutting or self._unsynced)

    def has_pending_block_frees(self) -> bool:
        """Whether blocks come back soon without a preemption: a hold (its bound is two
        writes' deadlines). A finish save's may take `save_timeout_s`: not counted."""
        self._expire()
        return bool(self._holding)

    def _expire(self) -> None:
        now = time.monotonic()
        for book in (self._holding, self._saving):
            for rid in [r for r, until in book.items() if until < now]:
                del book[rid]
        # Every step's output settles the cuts (their reports come with it); here only
        # those past their age, at most every `_SETTLE_S`.
        if now - self._settled >= _SETTLE_S:
            self._settle_cuts()

    # -- names --------------------------------------------------------------------------
    def dirs(self, key_model: str, g: GroupLayout) -> list[str]:
        """The record directories group `g` is read from, one per distinct key rank."""
        per = self._ns.get(key_model)
        if per is None:
            per = self._ns[key_model] = {}
            md = model_digest(key_model)
            for grp in self.groups:
                ranks = sorted({grp.key_rank(r) for r in range(self.world_size)})
                fp = self._fingerprints.get(grp.index) or grp.fingerprint()
                per[grp.index] = [f"{md}-{fp}-w{self.world_size}r{r}" for r in ranks]
        return per[g.index]

    def _state(self, request: Any) -> _Request:
        st = self._reqs.get(request.request_id)
        if st is None:
            st = _Request(request, request_key_model(self.model, request))
            self._reqs[request.request_id] = st
        return st

    def _hashes(self, st: _Request, upto_tokens: int) -> list[int]:
        """Chunk hashes of the request's first `upto_tokens` tokens (each hashed once:
        the chain goes on from the last chunk hashed)."""
        n = upto_tokens // self.chunk
        if len(st.hashes) < n:
            # vLLM's ConstantList slices to a list, which goes to Rust without a copy.
            tokens = st.request.all_token_ids[: n * self.chunk]
            st.hashes = extend_prefix_hashes(st.hashes, tokens, self.chunk)
        return st.hashes[:n]

    def _hashes_ready(self, st: _Request, upto_tokens: int) -> list[int] | None:
        """`_hashes`, but a long stretch is hashed on the hasher thread: None until done."""
        n = upto_tokens // self.chunk
        if len(st.hashes) >= n:
            return st.hashes[:n]
        if st.hashing is None:
            if (n - len(st.hashes)) * self.chunk <= self.cfg.hash_inline_tokens:
                return self._hashes(st, upto_tokens)
            # The request waits, so its token list does not grow meanwhile; the slice and
            # the hash run on the hasher thread (the hash without the GIL).
            prev, req, end = list(st.hashes), st.request, n * self.chunk
            st.hashing = self._hasher.submit(
                lambda: extend_prefix_hashes(prev, req.all_token_ids[:end], self.chunk)
            )
            return None
        if not st.hashing.done():
            return None
        done, st.hashing = st.hashing, None
        got = done.result()
        if len(got) > len(st.hashes):
            st.hashes = got
        return self._hashes_ready(st, upto_tokens)

    # -- discovery ------------------------------------------------------------------------
    def hit_chunks(
        self, key_model: str, hashes: list[int], first: int, cutting: dict[Cut, float] | None = None
    ) -> int:
        """Largest n <= len(hashes) such that every full group holds [first, n) and
        every window group its record at n - 1, on every rank; `first` if none. With
        `cutting`, a record cut in flight counts as held."""
        cutting = cutting or {}
        n = len(hashes)
        for g in self.full:
            dirs = self.dirs(key_model, g)
            m = self.catalog.leading(dirs, hashes, first, n)
            while m < n and cut_key(key_model, g.index, hashes[m]) in cutting:
                m = self.catalog.leading(dirs, hashes, m + 1, n)
            n = m

        def held(g: GroupLayout, h: int) -> bool:
            return cut_key(key_model, g.index, h) in cutting or self.catalog.holds(
                self.dirs(key_model, g), h
            )

        while n > first:
            if all(held(g, hashes[n - 1]) for g in self.window):
                return n
            n -= 1
        return first

    def _awaits_cuts(self, st: _Request, first: int, limit: int, n: int) -> bool:
        """Whether cuts in flight would lengthen the hit of `n` chunks: the request waits
        for their reports, at most `_CUT_WAIT_S`."""
        if n >= limit or not self._cutting or st.key_model is None:
            return False
        if self.hit_chunks(st.key_model, st.hashes[:limit], first, self._cutting) <= n:
            return False
        now = time.monotonic()
        if st.cut_wait_end is None:
            st.cut_wait_end = now + _CUT_WAIT_S
        return now < st.cut_wait_end

    def get_num_new_matched_tokens(
        self, request: Any, num_computed_tokens: int
    ) -> tuple[int | None, bool]:
        rid = request.request_id
        self.trace.lookup(rid)
        got = self._matched(request, num_computed_tokens)
        st = self._reqs.get(rid)
        chunks = st.hit_chunks - st.local_tokens // self.chunk if st is not None else 0
        self.trace.answer(rid, got, chunks, int(getattr(request, "num_prompt_tokens", 0)))
        return got

    def _matched(self, request: Any, num_computed_tokens: int) -> tuple[int | None, bool]:
        st = self._state(request)
        st.local_seen = num_computed_tokens
        if st.failed or st.key_model is None or self.unhealthy:
            return 0, False
        limit = (request.num_tokens - 1) // self.chunk  # leave a token to compute
        first = num_computed_tokens // self.chunk
        if limit <= first:
            return 0, False
        # vLLM asks again in every scheduling pass while the request waits: the answer
        # stands until the catalog changes.
        version = self.catalog.version
        if st.memo is not None and st.memo[:3] == (version, first, limit):
            n = st.memo[3]
        else:
            try:
                hashes = self._hashes_ready(st, limit * self.chunk)
            except Exception:
                log.exception("bsr-io: hashing request %s failed; it is a miss", request.request_id)
                st.failed = True
                return 0, False
            if hashes is None:
                return None, False  # still hashing: vLLM asks again in its next pass
            n = self.hit_chunks(st.key_model, hashes, first)
            st.memo = (version, first, limit, n)
        if self._awaits_cuts(st, first, limit, n):
            return None, False  # vLLM steps meanwhile, and the steps bring the reports
        ext = n * self.chunk - num_computed_tokens
        if ext <= 0:
            return 0, False
        st.local_tokens, st.hit_chunks = num_computed_tokens, n
        return ext, True

    def update_state_after_alloc(self, request: Any, blocks: Any, num_external_tokens: int) -> None:
        self._touch(request)
        if num_external_tokens <= 0:
            self.trace.missed(request.request_id)
            return
        st = self._reqs[request.request_id]
        assert st.key_model is not None
        n = (st.local_tokens + num_external_tokens) // self.chunk
        ids = blocks.get_block_ids()
        records = []
        for g in self.full:
            for c in range(st.local_tokens // self.chunk, n):
                records.append(self._order(g, c, st, ids[g.index], st.local_tokens))
        for g in self.window:
            records.append(self._order(g, n - 1, st, ids[g.index], st.local_tokens))
        # Chunk-major order: the window streams chunk by chunk through every group.
        records.sort(key=lambda r: (r.chunk, r.group))
        st.loading = True
        st.loaded = [(r.group, r.chunk) for r in records]
        self._loads.append(
            Transfer(
                request.request_id, st.key_model, tuple(records), committed_tokens=n * self.chunk
            )
        )

    def _touch(self, request: Any) -> None:
        """Once per request: the chunks vLLM's own prefix cache served it go to the
        workers, which refresh their records' recency (hot leading chunks stay)."""
        st = self._reqs.get(request.request_id)
        if st is None or st.key_model is None or st.touched:
            return
        st.touched = True
        n = st.local_seen // self.chunk
        if n > 0:
            self._touches.setdefault(st.key_model, []).extend(self._hashes(st, n * self.chunk))

    def _order(
        self, g: GroupLayout, c: int, st: _Request, ids: list[int], local_tokens: int
    ) -> RecordOrder:
        """Group `g`'s record of chunk (or boundary) `c` over the request's block ids:
        blocks of vLLM's own local hit, null blocks and pages before the prompt are
        left alone (-1)."""
        local_blocks = local_tokens // g.block_tokens
        out = []
        for p in g.span(c):
            b = ids[p] if 0 <= p < len(ids) else 0
            out.append(b if p >= local_blocks and b > 0 else -1)
        return RecordOrder(g.index, c, st.hashes[c], tuple(out))

    # -- per step ---------------------------------------------------------------------
    def build_connector_meta(self, scheduler_output: Any) -> BsrMetadata:
        idle = not getattr(scheduler_output, "total_num_scheduled_tokens", 1)
        if self.trace.path:
            so = scheduler_output
            reach = [(r, c + so.num_scheduled_tokens.get(r, 0)) for r, c in self._scheduled(so)]
            self.trace.stepped([t.request_id for t in self._loads], reach, idle)
        meta = BsrMetadata(
            self._loads,
            self._step_saves(scheduler_output),
            self._finish,
            touches=self._touches,
            recheck=self._recheck,
            resync=self._resync,
            released=self._released(scheduler_output) - self._held,
            held=self._held,
            idle=idle,
        )
        self._loads, self._finish, self._touches = [], [], {}
        self._recheck, self._resync, self._held = {}, set(), set()
        return meta

    @staticmethod
    def _released(so: Any) -> set[str]:
        """Requests finished or preempted since the last step: vLLM freed their blocks,
        but a finish save's (its job has a guard of its own) and a held request's (not
        named released: `build_connector_meta`)."""
        return set(getattr(so, "finished_req_ids", None) or ()) | set(
            getattr(so, "preempted_req_ids", None) or ()
        )

    def _scheduled(self, so: Any) -> list[tuple[str, int]]:
        """(request id, tokens computed before this step) of every scheduled request."""
        out = [(r.req_id, r.num_computed_tokens) for r in so.scheduled_new_reqs]
        cached = so.scheduled_cached_reqs
        out += list(zip(cached.req_ids, cached.num_computed_tokens, strict=False))
        return out

    def _step_saves(self, so: Any) -> list[Transfer]:
        """Records whose chunk this step completes, cut by the workers after its forward
        while the blocks still hold them: every window group's (its blocks are recycled
        as the request goes on) and, with `save_in_steps`, every full group's, so that a
        finished request has nothing left to save and vLLM frees its blocks at once
        instead of a step later (a queued request waits that step at saturation); a step
        later only when a cut of it is still unreported then (`request_finished`)."""
        groups = self.window + (self.full if self.cfg.save_in_steps else [])
        if not groups or not self.cfg.save:
            return []
        state = getattr(so, "kv_connector_block_state", None)
        saves = []
        now = time.monotonic()
        for rid, computed in self._scheduled(so):
            st = self._reqs.get(rid)
            if st is None or st.key_model is None or st.loading:
                continue
            end = computed + so.num_scheduled_tokens.get(rid, 0)
            known = len(st.request.all_token_ids)
            first, last = computed // self.chunk, min(end, known) // self.chunk
            if last <= first or state is None:
                continue
            ids = state.get_block_ids(rid)
            if ids is None:
                continue
            hashes = self._hashes(st, last * self.chunk)
            records = []
            for c in range(first, last):
                if (c + 1) * self.chunk <= computed:
                    continue
                for g in groups:
                    if g.kind == FULL:
                        st.step_saved.add(c)  # stored or cut now: not saved again at finish
                    if self.catalog.holds(self.dirs(st.key_model, g), hashes[c]):
                        continue  # stored already (every rank)
                    order = self._order(g, c, st, ids[g.index], 0)
                    live = [p for p in g.span(c) if p >= 0]
                    if len([b for b in order.ids if b > 0]) != len(live):
                        continue  # a page of it is gone already: never save a partial record
                    records.append(order)
                    self._cutting[cut_of(st.key_model, order)] = now
            if records:
                saves.append(Transfer(rid, st.key_model, tuple(records)))
        return saves

    def update_connector_output(self, output: Any) -> None:
        meta = getattr(output, "kv_connector_worker_meta", None)
        if isinstance(meta, BsrWorkerMeta):
            for rank, inv in meta.inventory.items():
                self._report(rank, inv)
            for rank in range(self.world_size):
                if rank in meta.ranks:
                    self._silent.pop(rank, None)
                    continue
                # A worker missing from steps it took part in: what it holds may have
                # changed unseen. Its rank holds nothing until it reports afresh.
                self._silent[rank] = self._silent.get(rank, 0) + 1
                if self._silent[rank] == _SILENT_STEPS and rank in self.catalog.reporting():
                    log.warning("bsr-io: worker %d sent no report; it holds nothing now", rank)
                    self.catalog.forget(rank)
                    self._unsynced.discard(rank)
                    self._resync.add(rank)
                    self._cutting.clear()  # its cuts' reports may never come
            for rank in meta.ranks:
                why = meta.unhealthy.get(rank)
                if why and rank not in self.unhealthy:
                    log.warning(
                        "bsr-io: worker %d reports stuck I/O (%s): no external hits "
                        "until it recovers",
                        rank,
                        why,
                    )
                if why:
                    self.unhealthy[rank] = why
                else:
                    self.unhealthy.pop(rank, None)
            self.skipped_saves += meta.skipped_saves
            for cut in meta.lost_cuts:
                self._cutting.pop(cut, None)
            self._settle_cuts()
        for rid in getattr(output, "finished_sending", None) or ():
            self._holding.pop(rid, None)
            self._saving.pop(rid, None)
        for rid in output.finished_recving or ():
            st = self._reqs.get(rid)
            if st is not None:
                st.loading = False
        self.trace.output(output.finished_recving or ())
        for rid in output.failed_recving or ():
            st = self._reqs.get(rid)
            if st is None:
                continue
            # The next lookup for this request is a miss: it is recomputed, not reloaded;
            # its records leave the catalog until the workers report again those they
            # still hold (the bad ones are quarantined by then).
            st.failed = True
            self.trace.failed(rid)
            if st.key_model is not None:
                for gi, c in st.loaded:
                    for ns in self.dirs(st.key_model, self.groups_by_index[gi]):
                        self.catalog.drop(ns, [st.hashes[c]])
                        self._recheck.setdefault(ns, []).append(st.hashes[c])
            log.warning("bsr-io: load of request %s failed on a rank; recomputing", rid)

    def _settle_cuts(self) -> None:
        """Forget cuts now held on every rank, and any ordered longer ago than a worker
        may take to end one (`Deadlines.cut_s`: a slot, then its write), twice over."""
        self._settled = time.monotonic()
        if not self._cutting:
            return
        old = self._settled - 2 * self.cfg.deadlines.cut_s
        groups = self.groups_by_index
        for cut, since in list(self._cutting.items()):
            km, gi, h = cut
            if since < old or self.catalog.holds(self.dirs(km, groups[gi]), h):
                del self._cutting[cut]

    def _cuts_in_flight(self, st: _Request) -> bool:
        """Whether a full-group record of `st` cut in a step is not yet reported."""
        km = st.key_model
        assert km is not None  # request_finished returned early otherwise
        return bool(self._cutting) and any(
            cut_key(km, g.index, st.hashes[c]) in self._cutting
            for c in st.step_saved
            for g in self.full
        )

    @property
    def groups_by_index(self) -> dict[int, GroupLayout]:
        return {g.index: g for g in self.groups}

    # -- save at the end ------------------------------------------------------------------
    def request_finished(
        self, request: Any, block_ids: tuple[list[int], ...]
    ) -> tuple[bool, dict[str, Any] | None]:
        st = self._reqs.pop(request.request_id, None)
        self.trace.finished(request.request_id)
        if st is not None and st.hashing is not None:
            st.hashing.cancel()  # finished (aborted) while its prompt was being hashed
        if st is None or st.loading or not self.cfg.save or st.key_model is None:
            return False, None  # a load still owns these blocks: never read them
        n = int(request.num_computed_tokens) // self.chunk
        if n == 0 or not self.full:
            return False, None
        hashes = self._hashes(st, n * self.chunk)
        first = n
        for g in self.full:
            first = min(first, self.catalog.leading(self.dirs(st.key_model, g), hashes, 0, n))
        records = []
        for c in range(first, n):
            if c in st.step_saved:
                continue  # cut in the step that computed it
            orders = [self._order(g, c, st, block_ids[g.index], 0) for g in self.full]
            if any(-1 in o.ids for o in orders):
                break  # a block is gone (never for full attention): save what precedes
            records += orders
        if not records:
            if not self._cuts_in_flight(st):
                return False, None  # every cut reported: vLLM frees the blocks at once
            # A cut ordered but not yet reported written may still have to copy its bytes
            # out of these blocks (a writer held up behind a stalled write): vLLM keeps
            # them until every worker says its cuts are past that (cuts.py `hold`).
            self._held.add(request.request_id)
            self._holding[request.request_id] = time.monotonic() + 2 * self.cfg.deadlines.hold_s
            return True, None
        d = self.cfg.deadlines
        self._saving[request.request_id] = time.monotonic() + 2 * (d.save_s + d.grace_s)
        self._finish.append(Transfer(request.request_id, st.key_model, tuple(records)))
        return True, None  # vLLM keeps the blocks until the workers report the save done
