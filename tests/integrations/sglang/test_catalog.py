"""The catalog `batch_exists` answers from is the store's one listing, kept fresh.

A rank that does not write (MLA's TP followers) learns of the writer's pages only by
listing the store: it must see pages stored after it started, within a few `rescan_s`,
or SGLang's MIN over the group makes every such page a miss. What the listing leaves
out (a link as a record or as a rank directory) is never offered, and a record removed
by hand leaves the catalog at the next listing. Waits are bounded polls of a few
intervals, never timed thresholds.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch
from pools import fill, keys, make_backend, mha_pool, mla_pool, page_bytes

from bsr_io.integrations.sglang.backend import BsrHiCacheStorage

WORKER = Path(__file__).parent / "mla_rank_worker.py"
RESCAN_S = 0.2
INTERVALS = 50  # the bound of every wait below, in listing intervals


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _until(ok: Callable[[], bool]) -> bool:
    """Whether `ok()` holds within INTERVALS listing intervals, polled."""
    end = time.monotonic() + INTERVALS * RESCAN_S
    while not ok():
        if time.monotonic() > end:
            return False
        time.sleep(RESCAN_S / 4)
    return True


def _path(b: BsrHiCacheStorage, key: str) -> Path:
    assert b.store is not None
    return b.store.tiers[0].path_of(b._key(key))  # type: ignore[attr-defined]


def test_a_non_writer_mla_rank_sees_pages_stored_after_it_started(tmp_path: Path) -> None:
    """Two MLA TP ranks in real processes (gloo): pages the writer stores after both
    started are hits on both ranks, so the group's minimum keeps them (it was 0: the
    other rank's catalog was taken once, at start)."""
    store = tmp_path / "store"
    store.mkdir()
    port = _free_port()
    outs = [tmp_path / f"rank{r}.json" for r in range(2)]
    args = [str(store), str(port), str(RESCAN_S)]
    procs = [
        subprocess.Popen([sys.executable, str(WORKER), str(r), "2", *args, str(outs[r])])
        for r in range(2)
    ]
    for p in procs:
        assert p.wait(timeout=300) == 0
    r0, r1 = (json.loads(o.read_text()) for o in outs)
    assert (r0["writer"], r1["writer"]) == (True, False)
    assert (r0["written"], r1["written"]) == (5, 0)
    assert r0["at_start"] == r1["at_start"] == 0
    assert r0["at_once"] == 5  # the writer's own saves: at once
    assert r0["exists"] == r1["exists"] == r0["agreed_exists"] == 5
    assert r0["got"] == r1["got"] == [True] * 5
    assert r0["agreed"] == r1["agreed"] == 5
    assert r0["same"] and r1["same"]


def test_a_page_removed_from_the_store_leaves_the_catalog(store_dir: Path) -> None:
    src = mha_pool("page_first")
    at = torch.arange(src.page_size, 5 * src.page_size)
    fill(src, at, seed=3)
    ks = keys(4)
    b = make_backend(store_dir, src, rescan_s=RESCAN_S)
    assert b.batch_set_v1(ks, at) == [True] * 4
    assert b.batch_exists(ks) == 4
    _path(b, ks[2]).unlink()  # an operator's rm, or another process's eviction
    assert _until(lambda: b.batch_exists(ks) == 2)
    # Written again, it is offered again at once.
    assert b.batch_set_v1(ks, at) == [True] * 4
    assert b.batch_exists(ks) == 4
    b.close()


def test_links_are_never_in_the_catalog(tmp_path: Path) -> None:
    """A link named as a record in this rank's directory, and a link in place of a rank
    directory, count for nothing: the engine refuses to open either (ELOOP)."""
    store = tmp_path / "store"
    store.mkdir()
    src = mla_pool("page_first")
    at = torch.arange(src.page_size, 4 * src.page_size)
    fill(src, at, seed=4)
    ks, later = keys(3), keys(1, "later")
    writer = make_backend(store, src, tp_rank=0, tp_size=2, mla=True, rescan_s=RESCAN_S)
    follower = make_backend(store, src, tp_rank=1, tp_size=2, mla=True, rescan_s=RESCAN_S)
    assert writer.batch_set_v1(ks[:2], at[: 2 * src.page_size]) == [True] * 2
    # ks[2]'s record name, linked to ks[0]'s record (a valid record's bytes).
    first = _path(writer, ks[0])
    _path(writer, ks[2]).symlink_to(first)
    # A later page, stored after the link was made: once the follower sees it, a
    # listing has run since the link was there.
    assert writer.batch_set_v1(later, at[2 * src.page_size : 3 * src.page_size]) == [True]
    assert _until(lambda: follower.batch_exists(later) == 1)
    assert follower.batch_exists(ks) == 2
    assert writer.batch_exists(ks) == 2
    # MHA rank 1 of the same model and store, whose rank directory is a link to rank 0's.
    mha = mha_pool("page_first")
    fill(mha, at, seed=4)
    r0 = make_backend(store, mha, tp_rank=0, tp_size=2, rescan_s=RESCAN_S)
    assert r0.batch_set_v1(ks, at[: 3 * mha.page_size]) == [True] * 3
    r1_dir = _path(r0, ks[0]).parent.with_name(
        _path(r0, ks[0]).parent.name.replace("-w2r0", "-w2r1")
    )
    r1_dir.symlink_to(_path(r0, ks[0]).parent, target_is_directory=True)
    r1 = make_backend(store, mha_pool("page_first"), tp_rank=1, tp_size=2, rescan_s=RESCAN_S)
    assert _path(r1, ks[0]).exists()  # through the link
    assert r1.batch_exists(ks) == 0
    assert r1.batch_get_v1(ks, at[: 3 * mha.page_size]) == [False] * 3
    # Rank 0's records were not taken for rank 1's, nor withdrawn as misplaced.
    assert r0.batch_exists(ks) == 3 and all(os.path.isfile(_path(r0, k)) for k in ks)
    into = torch.arange(20 * mha.page_size, 23 * mha.page_size)
    assert r0.batch_get_v1(ks, into) == [True] * 3
    assert page_bytes(r0.mem_pool_host, into) == page_bytes(mha, at[: 3 * mha.page_size])
    for b in (writer, follower, r0, r1):
        b.close()
