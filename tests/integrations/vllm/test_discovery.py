"""Scheduler-side discovery: the hit rule over groups and ranks, from the in-memory
catalog fed only by the workers' inventories, with no file-system call on the scheduler
side.

Records are files named as the store names them (inventories list names only); each
rank's inventory is the worker's own (`StoreInventory`, the one a worker runs), handed
to the scheduler side as vLLM hands it: in the handshake, then in every step's worker
metadata. The group layouts come from vLLM's real KV cache objects (kv_shapes.py).
Requests are the few fields of vLLM's Request the scheduler side reads.
"""

from __future__ import annotations

import builtins
import os
import random
import sys
import threading
import time
from dataclasses import replace
from pathlib import Path
from types import SimpleNamespace

import pytest

from bsr_io.integrations.vllm import kv_shapes, scheduler
from bsr_io.integrations.vllm.catalog import RecordCatalog
from bsr_io.integrations.vllm.config import ConnectorConfig
from bsr_io.integrations.vllm.identity import key_model
from bsr_io.integrations.vllm.inventory import SUFFIX, StoreInventory, list_records
from bsr_io.integrations.vllm.layout import group_layouts
from bsr_io.integrations.vllm.metadata import BsrHandshake, BsrWorkerMeta, Inventory
from bsr_io.integrations.vllm.scheduler import SchedulerSide
from bsr_io.model.keys import ChunkKey, prefix_hashes
from bsr_io.tiers.files.records import record_path
from bsr_lab.vllm.harness import scheduler_request, tokens

CHUNK = 256
MODEL = "m"
TP = 2


NO_STEP = SimpleNamespace(
    scheduled_new_reqs=[],
    scheduled_cached_reqs=SimpleNamespace(req_ids=[], num_computed_tokens=[]),
    num_scheduled_tokens={},
)


def _request(rid: str, toks: list[int]) -> SimpleNamespace:
    return scheduler_request(rid, toks)  # type: ignore[no-any-return]


class Store:
    """Record files (empty: the catalog reads names only) for every group and rank."""

    def __init__(self, root: Path, groups, toks: list[int]) -> None:
        self.root, self.groups = root, groups
        self.hashes = prefix_hashes(toks, CHUNK)
        self.km = key_model(MODEL)

    def path(self, g: int, rank: int, c: int) -> Path:
        grp = self.groups[g]
        key = ChunkKey(self.km, TP, grp.key_rank(rank), grp.fingerprint(), self.hashes[c])
        return record_path(self.root / "chunks", key)

    def put(self, chunks: range) -> None:
        for g in range(len(self.groups)):
            for r in range(TP):
                for c in chunks:
                    p = self.path(g, r, c)
                    p.parent.mkdir(parents=True, exist_ok=True)
                    p.touch()


@pytest.fixture
def setup(tmp_path):
    groups = group_layouts(kv_shapes.gemma3(), CHUNK)
    cfg = ConnectorConfig(store_dir=str(tmp_path), chunk_tokens=CHUNK)
    toks = tokens(5, 10 * CHUNK + 17)
    store = Store(tmp_path, groups, toks)
    store.put(range(10))
    return groups, cfg, toks, store


def _inventories(groups, roots) -> dict[int, StoreInventory]:
    """Each rank's worker inventory over its own store (`roots[rank]`, or one shared)."""
    out = {}
    for r in range(TP):
        root = roots[r] if isinstance(roots, list) else roots
        out[r] = StoreInventory([root], {f"-w{TP}r{g.key_rank(r)}" for g in groups})
    return out


def _side(cfg, groups, invs=None, ranks=range(TP)) -> SchedulerSide:
    """A scheduler side fed, as vLLM feeds it, by the handshakes of `ranks`' workers."""
    side = SchedulerSide(cfg, groups, MODEL, TP)
    invs = invs or _inventories(groups, cfg.store_dir)
    side.handshake({r: BsrHandshake(r, invs[r].take(cfg.handshake_batch)) for r in ranks})
    return side


def _step(side, invs, ranks=range(TP), batch=None) -> None:
    """One engine step's worker metadata, aggregated over `ranks` as vLLM does."""
    meta = None
    for r in ranks:
        one = BsrWorkerMeta({r: invs[r].take(batch or side.cfg.report_batch)}, ranks={r})
        meta = one if meta is None else meta.aggregate(one)
    side.update_connector_output(
        SimpleNamespace(kv_connector_worker_meta=meta, finished_recving=None, failed_recving=set())
    )


def test_hit_needs_every_full_chunk_and_the_window_record_at_the_end(setup):
    groups, cfg, toks, store = setup
    assert _side(cfg, groups).get_num_new_matched_tokens(_request("a", toks), 0) == (
        10 * CHUNK,
        True,
    )
    # A sliding group's record missing at boundary 9 on rank 1: restore to 9 chunks
    # (its record at boundary 8 is there), not fewer.
    store.path(1, 1, 9).unlink()
    assert _side(cfg, groups).get_num_new_matched_tokens(_request("b", toks), 0)[0] == 9 * CHUNK
    # A full-attention record missing at chunk 3 on rank 0: only 3 chunks restorable...
    store.path(2, 0, 3).unlink()
    side = _side(cfg, groups)
    assert side.get_num_new_matched_tokens(_request("c", toks), 0)[0] == 3 * CHUNK
    # ...unless vLLM holds chunks 0-4 itself: then chunk 3 is not needed.
    assert side.get_num_new_matched_tokens(_request("d", toks), 5 * CHUNK) == (4 * CHUNK, True)


def test_catalog_answers_for_every_rank_of_a_group(setup):
    groups, cfg, _, store = setup
    dirs = [store.path(2, r, 0).parent.name for r in range(TP)]  # the full group's ranks
    h = store.hashes
    invs = _inventories(groups, cfg.store_dir)
    cat = RecordCatalog()
    for r, inv in invs.items():
        cat.report(r, inv.take(10**6))
    assert cat.leading(dirs, h, 0, 10) == 10
    # One rank's record gone (a failed load dropped it): the prefix stops there for the
    # group, while the other rank alone still holds it.
    cat.drop(dirs[1], [h[4]])
    assert (cat.leading(dirs, h, 0, 10), cat.leading(dirs[:1], h, 0, 10)) == (4, 10)
    assert (cat.holds(dirs, h[4]), cat.holds(dirs[:1], h[4])) == (False, True)
    invs[1].recheck(dirs[1], [h[4]])  # the worker still has it: reported again
    cat.report(1, invs[1].take(100))
    assert cat.leading(dirs, h, 2, 10) == 10
    # Rank 0's file removed by another process: rank 0's worker re-lists and reports it.
    store.path(2, 0, 6).unlink()
    invs[0].relist()
    cat.report(0, invs[0].take(100))
    assert (cat.leading(dirs, h, 0, 10), cat.leading(dirs[1:], h, 0, 10)) == (6, 10)


def test_leaves_a_token_to_compute(setup):
    groups, cfg, toks, _ = setup
    side = _side(cfg, groups)
    assert side.get_num_new_matched_tokens(_request("a", toks[: 10 * CHUNK]), 0)[0] == 9 * CHUNK


def test_no_file_system_call_once_the_catalog_is_built(setup):
    groups, cfg, toks, _ = setup
    side = _side(cfg, groups)
    calls: list[str] = []

    def hook(event: str, _args: object) -> None:
        if event.startswith(("open", "os.", "shutil.", "glob.", "pathlib.")):
            calls.append(event)

    wrapped = {n: getattr(os, n) for n in ("stat", "lstat", "scandir", "listdir", "open")}
    real_open = builtins.open

    def counting(name, fn):
        def f(*a, **k):
            calls.append(name)
            return fn(*a, **k)

        return f

    sys.addaudithook(hook)  # hooks cannot be removed: it only appends while `armed`
    try:
        for n, fn in wrapped.items():
            setattr(os, n, counting(n, fn))
        builtins.open = counting("open", real_open)
        got = [side.get_num_new_matched_tokens(_request(f"r{i}", toks), 0) for i in range(3)]
    finally:
        for n, fn in wrapped.items():
            setattr(os, n, fn)
        builtins.open = real_open
    assert got == [(10 * CHUNK, True)] * 3
    assert calls == []


def test_a_long_prompt_is_hashed_off_the_scheduler_thread(setup):
    """Past `hash_inline_tokens` the first ask hands the hash to the hasher thread and
    answers None (vLLM asks again next pass); the answer then equals the inline one, and
    the chain goes on from the hashes already made when the sequence grows."""
    groups, cfg, toks, store = setup
    inline = _side(cfg, groups).get_num_new_matched_tokens(_request("a", toks), 0)
    side = _side(replace(cfg, hash_inline_tokens=0), groups)
    req = _request("b", toks)
    main = threading.get_ident()
    seen: list[int] = []
    real = scheduler.extend_prefix_hashes

    def recording(*a, **k):
        seen.append(threading.get_ident())
        return real(*a, **k)

    scheduler.extend_prefix_hashes = recording
    try:
        got = side.get_num_new_matched_tokens(req, 0)
        assert got == (None, False)
        deadline = time.monotonic() + 10
        while got[0] is None and time.monotonic() < deadline:
            time.sleep(0.001)
            got = side.get_num_new_matched_tokens(req, 0)
    finally:
        scheduler.extend_prefix_hashes = real
        side.close()
    assert got == inline == (10 * CHUNK, True)
    assert seen and main not in seen  # hashed on the hasher thread only
    assert side._reqs["b"].hashes == store.hashes


def test_unhealthy_worker_and_failed_load_mean_no_hit(setup):
    groups, cfg, toks, _ = setup
    invs = _inventories(groups, cfg.store_dir)
    side = _side(cfg, groups, invs)
    side.update_connector_output(
        SimpleNamespace(
            kv_connector_worker_meta=BsrWorkerMeta(unhealthy={1: "a read in flight"}, ranks={0, 1}),
            finished_recving=None,
            failed_recving=set(),
        )
    )
    assert side.get_num_new_matched_tokens(_request("a", toks), 0) == (0, False)
    side.update_connector_output(
        SimpleNamespace(
            kv_connector_worker_meta=BsrWorkerMeta(ranks={1}),
            finished_recving=None,
            failed_recving=set(),
        )
    )
    req = _request("b", toks)
    assert side.get_num_new_matched_tokens(req, 0)[0] == 10 * CHUNK
    # The load fails on some rank: the request is a miss from then on, and its records
    # leave the catalog until the workers report again those they still hold.
    blocks = SimpleNamespace(get_block_ids=lambda: tuple(list(range(1, 12)) for _ in groups))
    side.update_state_after_alloc(req, blocks, 10 * CHUNK)
    side.update_connector_output(
        SimpleNamespace(kv_connector_worker_meta=None, finished_recving={"b"}, failed_recving={"b"})
    )
    assert side.get_num_new_matched_tokens(req, 0) == (0, False)
    assert side.get_num_new_matched_tokens(_request("c", toks), 0) == (0, False)
    meta = side.build_connector_meta(NO_STEP)
    assert meta.recheck  # every dropped record goes back to its workers to check
    for inv in invs.values():
        for ns, hashes in meta.recheck.items():
            inv.recheck(ns, hashes)
    _step(side, invs)
    assert side.get_num_new_matched_tokens(_request("d", toks), 0)[0] == 10 * CHUNK


def test_load_plan_skips_vllm_local_blocks_and_nulls(setup):
    groups, cfg, toks, _ = setup
    side = _side(cfg, groups)
    req = _request("a", toks)
    assert side.get_num_new_matched_tokens(req, 4 * CHUNK) == (6 * CHUNK, True)
    # 20 blocks of 128: sliding groups hold nulls (0) outside the window at the hit.
    full = list(range(100, 120))
    window = [0] * 18 + [200, 201]
    blocks = SimpleNamespace(get_block_ids=lambda: (window, window, full))
    side.update_state_after_alloc(req, blocks, 6 * CHUNK)
    meta = side.build_connector_meta(
        SimpleNamespace(
            scheduled_new_reqs=[],
            scheduled_cached_reqs=SimpleNamespace(req_ids=[], num_computed_tokens=[]),
            num_scheduled_tokens={},
        )
    )
    (load,) = meta.loads
    assert load.committed_tokens == 10 * CHUNK
    full_records = [r for r in load.records if r.group == 2]
    assert [r.chunk for r in full_records] == list(range(4, 10))  # vLLM has chunks 0-3
    assert full_records[0].ids == (108, 109)
    assert [(r.chunk, r.ids) for r in load.records if r.group < 2] == [(9, (200, 201))] * 2


# -- the workers' inventories: what every rank holds, from that rank alone -------------------
def _truth(store, upto: int = 10) -> int:
    """The hit from the files themselves: the longest prefix whose every record of every
    group and rank exists (full groups), with the window groups' record at its end."""
    n = 0
    while n < upto and all(store.path(g, r, n).exists() for g in (2,) for r in range(TP)):
        n += 1
    while n > 0 and not all(store.path(g, r, n - 1).exists() for g in (0, 1) for r in range(TP)):
        n -= 1
    return n * CHUNK


def test_reports_answer_what_a_listing_of_every_drive_answers(setup):
    """The catalog fed only by worker reports, in small batches over many steps, gives
    the hits of the files themselves, and holds the same entries as one listing of every
    rank's directories (what the scheduler side listed before)."""
    groups, cfg, toks, store = setup
    rng = random.Random(7)
    for _ in range(6):  # records missing here and there, on both ranks
        store.path(rng.randrange(3), rng.randrange(TP), rng.randrange(10)).unlink(missing_ok=True)
    invs = _inventories(groups, cfg.store_dir)
    side = _side(replace(cfg, handshake_batch=5), groups, invs)
    steps = 0
    while any(inv.pending() for inv in invs.values()):
        _step(side, invs, batch=7)
        steps += 1
    assert steps > 3  # it took several bounded reports
    want = _truth(store)
    assert 0 < want < 10 * CHUNK  # records are missing, but not all from the start
    got = side.get_num_new_matched_tokens(_request("a", toks), 0)[0]
    assert got == want
    listed = RecordCatalog()
    every = list_records([Path(cfg.store_dir) / "chunks"])
    listed.report(0, Inventory(1, {ns: sorted(h) for ns, h in every.items()}))
    assert side.catalog._masks == listed._masks


def test_a_rank_that_never_reported_holds_nothing(setup):
    groups, cfg, toks, _ = setup
    assert _side(cfg, groups, ranks=[0]).get_num_new_matched_tokens(_request("a", toks), 0) == (
        0,
        False,
    )
    # Control: the same records with rank 1's report in.
    assert _side(cfg, groups).get_num_new_matched_tokens(_request("a", toks), 0)[0] == 10 * CHUNK


def test_node_local_drives_are_found_through_their_workers(tmp_path):
    """Two nodes, each with its own drive at the same path in its own eyes: rank 0's
    records only on drive 0, rank 1's only on drive 1. The scheduler side (on node 0)
    sees both ranks' records because each worker reports its own; a listing of node 0's
    drive alone (what the scheduler side did before) sees no rank 1 record."""
    groups = group_layouts(kv_shapes.gemma3(), CHUNK)
    toks = tokens(5, 10 * CHUNK + 17)
    drives = [tmp_path / "node0", tmp_path / "node1"]
    for r, drive in enumerate(drives):
        store = Store(drive, groups, toks)
        for g in range(len(groups)):
            for c in range(10):
                p = store.path(g, r, c)
                p.parent.mkdir(parents=True, exist_ok=True)
                p.touch()
    cfg = ConnectorConfig(store_dir=str(drives[0]), chunk_tokens=CHUNK)
    invs = _inventories(groups, [str(d) for d in drives])
    side = _side(cfg, groups, invs)
    assert side.get_num_new_matched_tokens(_request("a", toks), 0)[0] == 10 * CHUNK
    node0 = list_records([drives[0] / "chunks"])
    assert all(ns.endswith("r0") for ns in node0)  # the old listing: rank 0's only


def test_a_restarted_worker_reports_afresh_and_a_silent_one_holds_nothing(setup):
    groups, cfg, toks, store = setup
    invs = _inventories(groups, cfg.store_dir)
    side = _side(cfg, groups, invs)
    assert side.get_num_new_matched_tokens(_request("a", toks), 0)[0] == 10 * CHUNK
    # Node 1 restarts with records deleted meanwhile: its new epoch replaces its view.
    for c in range(5, 10):
        store.path(2, 1, c).unlink()
    invs[1] = _inventories(groups, cfg.store_dir)[1]
    _step(side, invs)
    assert side.get_num_new_matched_tokens(_request("b", toks), 0)[0] == 5 * CHUNK
    # Rank 1 stops reporting (its steps come without it): after a few steps it holds
    # nothing, and it is asked to report everything again.
    for _ in range(3):
        _step(side, invs, ranks=[0])
    assert side.get_num_new_matched_tokens(_request("c", toks), 0) == (0, False)
    meta = side.build_connector_meta(NO_STEP)
    assert meta.resync == {1}
    invs[1].resync()
    _step(side, invs)
    assert side.get_num_new_matched_tokens(_request("d", toks), 0)[0] == 5 * CHUNK


def test_idle_steps_leave_a_waiting_requests_answer_standing(setup):
    """vLLM asks for a waiting request in every scheduling pass; most steps' reports
    carry nothing. The answer is memoized until the catalog changes: an empty report
    must not count as a change, a removal must."""
    groups, cfg, toks, store = setup
    invs = _inventories(groups, cfg.store_dir)
    side = _side(cfg, groups, invs)
    _step(side, invs, batch=10**6)  # the rest of the listing: nothing left to report
    req = _request("a", toks)
    assert side.get_num_new_matched_tokens(req, 0)[0] == 10 * CHUNK
    version, memo = side.catalog.version, side._state(req).memo
    for _ in range(3):
        _step(side, invs)
    assert side.catalog.version == version
    assert side.get_num_new_matched_tokens(req, 0)[0] == 10 * CHUNK
    assert side._state(req).memo is memo  # not looked up again
    # Control: a record that left rank 1's store is reported, and the answer follows.
    for g in range(len(groups)):
        store.path(g, 1, 6).unlink()
    invs[1].relist()
    _step(side, invs)
    assert side.catalog.version != version
    assert side.get_num_new_matched_tokens(req, 0)[0] == 6 * CHUNK


def test_pool_records_survive_relisting_until_a_failed_load(tmp_path):
    """Records written through to a pool are on no drive: the worker keeps them (pinned)
    across re-listings; a recheck after a failed load that finds neither file nor pin
    drops the record; a pinned one is reported again."""
    inv = StoreInventory([tmp_path], {"-w1r0"})
    ns = "0" * 32 + "-" + "1" * 32 + "-w1r0"
    inv.saved(ns, 1, pinned=True)
    inv.saved(ns, 3)
    cat = RecordCatalog()
    cat.report(0, inv.take(100))
    inv.relist()  # the drive holds none of them
    cat.report(0, inv.take(100))
    assert [cat.holds([ns], h) for h in (1, 3)] == [True, False]
    cat.drop(ns, [1])
    inv.recheck(ns, [1])
    cat.report(0, inv.take(100))
    assert cat.holds([ns], 1)


def test_a_pool_record_no_tier_could_serve_is_not_reported_again(tmp_path):
    """A failed load unpins the records no tier had a good copy of (the worker's
    `failed_chunks`): the scheduler's recheck then drops a pool-only record for good
    instead of offering its bad pool copy again; one still on the drive stays."""
    inv = StoreInventory([tmp_path], {"-w1r0"})
    ns = "0" * 32 + "-" + "1" * 32 + "-w1r0"
    (tmp_path / "chunks" / ns).mkdir(parents=True)
    (tmp_path / "chunks" / ns / f"{2:032x}{SUFFIX}").write_bytes(b"x")
    inv.saved(ns, 1, pinned=True)  # in the pool only
    inv.saved(ns, 2, pinned=True)  # in the pool and on the drive
    cat = RecordCatalog()
    cat.report(0, inv.take(100))
    for h in (1, 2):
        inv.unpin(ns, h)
    cat.drop(ns, [1, 2])
    inv.recheck(ns, [1, 2])
    cat.report(0, inv.take(100))
    assert [cat.holds([ns], h) for h in (1, 2)] == [False, True]
    inv.relist()
    cat.report(0, inv.take(100))
    assert [cat.holds([ns], h) for h in (1, 2)] == [False, True]


def test_a_worker_withdraws_exactly_what_it_reported():
    """Workers also report rank 0's directory (a replicated group is stored once, in
    rank 0's): a new epoch or `forget` withdraws what that worker reported, in every
    directory, and nothing another worker still reports."""
    base = "0" * 32 + "-" + "1" * 32 + "-w2r"
    r0, r1 = base + "0", base + "1"
    cat = RecordCatalog()
    cat.report(0, Inventory(1, {r0: [1, 2]}))
    cat.report(1, Inventory(1, {r0: [2, 3], r1: [7]}))
    assert [cat.holds([r0], h) for h in (1, 2, 3)] == [True, True, True]
    cat.forget(1)  # worker 1 stops reporting: its replicated record 3 goes with it
    assert [cat.holds([r0], h) for h in (1, 2, 3)] == [True, True, False]
    assert not cat.holds([r1], 7)
    cat.report(1, Inventory(2, {r0: [3]}))
    cat.report(0, Inventory(2, {r0: [1]}))  # worker 0 restarts: 2 was its alone now
    assert [cat.holds([r0], h) for h in (1, 2, 3)] == [True, False, True]
    cat.report(1, Inventory(2, removed={r0: [1]}))  # not its report: 0 still holds it
    assert cat.holds([r0], 1)
    cat.drop(r0, [1, 3])  # a failed load: gone whoever reported it, until reported again
    assert [cat.holds([r0], h) for h in (1, 2, 3)] == [False, False, False]
    assert cat.entries() == 0
