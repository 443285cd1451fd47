"""Bad records are misses from that page on, never wrong bytes; a stalled read ends in
the batch's deadline; nothing raises onto SGLang's threads.

Corrupt, missing, truncated, foreign and misplaced records are real files damaged on
disk. The stalled read is bsr-io's documented fault double (`bsr_io.faults`, a "hang"
on one page), the one part simulated: a real hung device cannot be made on demand.
"""

from __future__ import annotations

import os
import shutil
import time
from pathlib import Path

import pytest
import torch
from pools import fill, keys, make_backend, mha_pool, page_bytes

from bsr_io.faults import Fault, FaultPlan
from bsr_io.integrations.sglang.backend import BsrHiCacheStorage
from bsr_io.model.record import HEADER_BYTES

N, BAD = 6, 2  # pages per batch, the page whose record is damaged


def _saved(
    store_dir: Path, layout: str, **bsr
) -> tuple[BsrHiCacheStorage, torch.Tensor, list[str]]:
    """A backend that stored N known pages; then a fresh pool for it to read into."""
    src = mha_pool(layout)
    at = torch.arange(src.page_size, (N + 1) * src.page_size)
    fill(src, at, seed=7)
    ks = keys(N)
    writer = make_backend(store_dir, src)
    assert writer.batch_set_v1(ks, at) == [True] * N
    expected = page_bytes(src, at)
    writer.close()
    reader = make_backend(store_dir, mha_pool(layout), **bsr)
    reader.expected = expected  # type: ignore[attr-defined]
    return reader, at, ks


def _path(backend: BsrHiCacheStorage, key: str) -> Path:
    assert backend.store is not None
    return backend.store.tiers[0].path_of(backend._key(key))  # type: ignore[attr-defined]


def _check_leading(backend: BsrHiCacheStorage, at: torch.Tensor, ks: list[str], good: int) -> None:
    """`good` leading pages true with the saved bytes; every other page false."""
    got = backend.batch_get_v1(ks, at)
    assert got == [True] * good + [False] * (N - good)
    now = page_bytes(backend.mem_pool_host, at)
    assert now[:good] == backend.expected[:good]  # type: ignore[attr-defined]


def _flip(path: Path, offset: int) -> None:
    with open(path, "r+b") as f:
        f.seek(offset)
        b = f.read(1)
        f.seek(offset)
        f.write(bytes([b[0] ^ 0x40]))


@pytest.mark.parametrize("direct", [True, False], ids=["direct", "slots"])
def test_corrupt_payload(store_dir: Path, host_layout: str, direct: bool) -> None:
    b, at, ks = _saved(store_dir, host_layout, direct_reads=direct)
    _flip(_path(b, ks[BAD]), HEADER_BYTES + 100)
    _check_leading(b, at, ks, BAD)
    # The record was proven bad: withdrawn, and no longer offered.
    assert b.batch_exists(ks) == BAD
    assert not _path(b, ks[BAD]).exists()
    b.close()


def test_missing_record(store_dir: Path, host_layout: str) -> None:
    # No listing in the test's time (rescan_s): the read alone must withdraw it
    # (test_catalog.py: the listing does too).
    b, at, ks = _saved(store_dir, host_layout, rescan_s=3600)
    _path(b, ks[BAD]).unlink()
    # batch_exists answers from memory, no file-system call per key: it still lists it.
    assert b.batch_exists(ks) == N
    _check_leading(b, at, ks, BAD)
    assert b.batch_exists(ks) == BAD
    b.close()


def test_truncated_record(store_dir: Path, host_layout: str) -> None:
    b, at, ks = _saved(store_dir, host_layout)
    p = _path(b, ks[BAD])
    os.truncate(p, p.stat().st_size // 2)
    _check_leading(b, at, ks, BAD)
    b.close()


@pytest.mark.parametrize("other", ["model", "rank"])
def test_foreign_record_is_a_miss(
    store_dir: Path, tmp_path: Path, host_layout: str, other: str
) -> None:
    """Another model's (or another rank's) record of the same page key, moved to this
    rank's path, is never taken for this rank's page."""
    b, at, ks = _saved(store_dir, host_layout)
    elsewhere = tmp_path / "other"
    elsewhere.mkdir()
    pool = mha_pool(host_layout)
    fill(pool, at, seed=99)
    kw = {"model": "another-model"} if other == "model" else {"tp_rank": 1, "tp_size": 2}
    foreign = make_backend(elsewhere, pool, **kw)
    assert foreign.batch_set_v1(ks, at) == [True] * N
    shutil.copyfile(_path(foreign, ks[BAD]), _path(b, ks[BAD]))
    foreign.close()
    _check_leading(b, at, ks, BAD)
    b.close()


def test_a_layer_first_record_is_a_miss_to_a_page_first_pool(store_dir: Path) -> None:
    src = mha_pool("layer_first")
    at = torch.arange(src.page_size, 3 * src.page_size)
    fill(src, at, seed=5)
    w = make_backend(store_dir, src)
    assert w.batch_set_v1(keys(2), at) == [True, True]
    w.close()
    r = make_backend(store_dir, mha_pool("page_first"))
    assert r.batch_exists(keys(2)) == 0
    assert r.batch_get_v1(keys(2), at) == [False, False]
    r.close()


def test_stalled_read_is_false_within_the_deadline(store_dir: Path, host_layout: str) -> None:
    """Through slots, a read still in flight at the deadline ends the batch there."""
    b, at, ks = _saved(store_dir, host_layout, direct_reads=False, timeout_s=1.0)
    assert b.store is not None
    b.store.tiers[0] = FaultPlan([Fault("hang", chunks=[BAD], delay_s=6.0)]).wrap(b.store.tiers[0])
    t0 = time.monotonic()
    got = b.batch_get_v1(ks, at)
    took = time.monotonic() - t0
    assert got == [True] * BAD + [False] * (N - BAD)
    assert took < 3.0, f"the batch took {took:.1f} s against a 1 s deadline"
    assert page_bytes(b.mem_pool_host, at)[:BAD] == b.expected[:BAD]  # type: ignore[attr-defined]
    b.close()


def test_stalled_direct_read_is_waited_for_and_false(store_dir: Path, host_layout: str) -> None:
    """A read into SGLang's own pages is never abandoned (the kernel may still write
    them): past the deadline it is waited for, and its page is false all the same."""
    b, at, ks = _saved(store_dir, host_layout, timeout_s=0.5)
    assert b.store is not None
    b.store.tiers[0] = FaultPlan([Fault("hang", chunks=[BAD], delay_s=2.0)]).wrap(b.store.tiers[0])
    got = b.batch_get_v1(ks, at)
    assert got == [True] * BAD + [False] * (N - BAD)
    b.close()


def test_read_errors_never_raise(backend: BsrHiCacheStorage) -> None:
    pool = backend.mem_pool_host
    ks = keys(3)
    at = torch.arange(pool.page_size, 4 * pool.page_size)
    fill(pool, at, seed=1)
    assert backend.batch_set_v1(ks, at) == [True] * 3
    # Host indices that are not whole pages, or too few for the keys: all false, no raise.
    assert backend.batch_get_v1(ks, at[:-1]) == [False] * 3
    assert backend.batch_get_v1(ks, at[: pool.page_size]) == [False] * 3
    assert backend.batch_set_v1(keys(3, "x"), at[:5]) == [False] * 3
    # A closed store: false, not an exception.
    backend.close()
    assert backend.batch_get_v1(ks, at) == [False] * 3
    assert backend.batch_set_v1(keys(3, "y"), at) == [False] * 3
