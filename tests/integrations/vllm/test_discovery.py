"""Scheduler-side discovery: the hit rule over groups and ranks, from the in-memory
catalog, with no file-system call once it is built.

Records are files named as the store names them (the catalog lists names only); the
group layouts come from vLLM's real KV cache objects (kv_shapes.py). Requests are the
few fields of vLLM's Request the scheduler side reads.
"""

from __future__ import annotations

import builtins
import os
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
from bsr_io.integrations.vllm.layout import group_layouts
from bsr_io.integrations.vllm.metadata import BsrWorkerMeta
from bsr_io.integrations.vllm.scheduler import SchedulerSide
from bsr_io.model.keys import ChunkKey, prefix_hashes
from bsr_io.tiers.files.records import record_path
from bsr_lab.vllm.harness import tokens

CHUNK = 256
MODEL = "m"
TP = 2


def _request(rid: str, toks: list[int]) -> SimpleNamespace:
    return SimpleNamespace(
        request_id=rid,
        all_token_ids=toks,
        num_tokens=len(toks),
        cache_salt=None,
        lora_request=None,
        mm_features=None,
        prompt_embeds=None,
        num_computed_tokens=0,
    )


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


def _side(cfg, groups) -> SchedulerSide:
    return SchedulerSide(cfg, groups, MODEL, TP)


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
    groups, _, _, store = setup
    dirs = [store.path(2, r, 0).parent.name for r in range(TP)]  # the full group's ranks
    h = store.hashes
    cat = RecordCatalog([store.root])
    assert cat.leading(dirs, h, 0, 10) == 10
    # One rank's record gone (a failed load dropped it): the prefix stops there for the
    # group, while the other rank alone still holds it.
    cat.drop(dirs[1], [h[4]])
    assert (cat.leading(dirs, h, 0, 10), cat.leading(dirs[:1], h, 0, 10)) == (4, 10)
    assert (cat.holds(dirs, h[4]), cat.holds(dirs[:1], h[4])) == (False, True)
    cat.add(dirs[1], [h[4]])  # a worker's save
    assert cat.leading(dirs, h, 2, 10) == 10
    # From the listing: rank 0's file removed by another process.
    store.path(2, 0, 6).unlink()
    cat.rescan()
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
    side = _side(cfg, groups)
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
    # leave the catalog until a rescan finds them on disk again.
    blocks = SimpleNamespace(get_block_ids=lambda: tuple(list(range(1, 12)) for _ in groups))
    side.update_state_after_alloc(req, blocks, 10 * CHUNK)
    side.update_connector_output(
        SimpleNamespace(kv_connector_worker_meta=None, finished_recving={"b"}, failed_recving={"b"})
    )
    assert side.get_num_new_matched_tokens(req, 0) == (0, False)
    assert side.get_num_new_matched_tokens(_request("c", toks), 0) == (0, False)
    side.catalog.rescan()
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
