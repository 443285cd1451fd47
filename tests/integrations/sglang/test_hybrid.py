"""Hybrid models through HiCache v2: every host pool of a page under one commit.

SGLang's own host pools of a sliding-window model, a Mamba hybrid, a DSA model (MLA KV
and its indexer) and DeepSeek-V4
(`hybrid_pools.py` says what each set holds and what SGLang's CPU code cannot build),
saved and read back through the factory-built backend at page sizes 1 and 64. Damage
is real files damaged on disk, one pool's record at a time.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import pytest
from hybrid_pools import ALL, TRAILING, PoolSet, Sidecar, build, fill, page_bytes, slots, transfer
from pools import keys, make_backend
from sglang.srt.mem_cache.hicache_storage import PoolTransfer

from bsr_io.integrations.sglang.backend import BsrHiCacheStorage
from bsr_io.model.record import HEADER_BYTES

N = 6  # pages of the prefix
KV_AT = [7, 2, 9, 4, 11, 5]  # host pages, out of order as SGLang's allocator hands them
INTO = [13, 17, 14, 19, 15, 21]  # where a fresh reader's pages go


def _attach(store: Path, s: PoolSet, **bsr: Any) -> BsrHiCacheStorage:
    """As SGLang's hybrid controller attaches: the anchor, then every pool through v2."""
    b = make_backend(store, s.kv, mla=s.mla, **bsr)
    for c in s.sidecars:
        b.register_mem_host_pool_v2(c.pool, c.name)
    b.on_host_pools_registered()
    return b


def _logical(s: PoolSet) -> bool:
    return getattr(s.kv, "kv_buffer", None) is None


def _query(s: PoolSet, ks: list[str]) -> list[PoolTransfer]:
    """What SGLang asks batch_exists_v2: each pool's policy (a trailing pool's keys
    are its window)."""
    return [
        PoolTransfer(
            name=c.name, keys=ks[-c.window :] if c.policy == TRAILING else None, hit_policy=c.policy
        )
        for c in s.sidecars
    ]


def _save(b: BsrHiCacheStorage, s: PoolSet, ks: list[str], windows: list[int] | None) -> None:
    """KV through v1, every all-pages pool through v2 at the KV's pages; a trailing pool
    holds the window ending each prefix length in `windows` (None: every page)."""
    if not _logical(s):
        fill(s.kv, KV_AT, seed=1)
        assert b.batch_set_v1(ks, slots(s.kv, KV_AT)) == [True] * N
    full = [c for c in s.sidecars if c.policy == ALL]
    for i, c in enumerate(s.sidecars):
        fill(c.pool, KV_AT, seed=10 + i)
    if full:
        got = b.batch_set_v2([transfer(c, ks, KV_AT) for c in full])
        assert got == {c.name: [True] * N for c in full}
    for c in s.sidecars:
        if c.policy != TRAILING:
            continue
        ends = windows if windows is not None else [N]
        for end in ends:
            lo = 0 if windows is None else end - c.window
            got = b.batch_set_v2([transfer(c, ks[lo:end], KV_AT[lo:end])])
            assert got == {c.name: [True] * (end - lo)}


# DSA's pages are 64 tokens whatever the model (SGLang asserts it): page 64 only.
_ROUND_TRIPS = [
    (kind, page)
    for kind in ("dsv4", "dsv4_fp8", "swa", "mamba", "dsa")
    for page in ([64] if kind == "dsa" else [1, 64])
]


@pytest.mark.parametrize(("kind", "page"), _ROUND_TRIPS)
def test_every_pool_round_trips_and_the_trailing_window_gates_the_prefix(
    store_dir: Path, kind: str, page: int
) -> None:
    src = build(kind, page)
    ks = keys(N, kind)
    w = _attach(store_dir, src)
    # Trailing pools hold only the windows that end prefixes of 3 and 6 pages.
    _save(w, src, ks, windows=[3, 6])
    w.close()

    dst = build(kind, page)
    r = _attach(store_dir, dst)  # a new process: catalogs from the store's listing
    hit = r.batch_exists_v2(ks, _query(dst, ks))
    assert hit.kv_hit_pages == N
    five = r.batch_exists_v2(ks[:5], _query(dst, ks[:5]))
    if any(c.policy == TRAILING for c in dst.sidecars):
        # Lengths whose windows are held, and only those: 3 and 6, never 4 or 5.
        assert hit.restorable_prefix_pages == [3, 6]
        # A 5-page request: its window (pages 3-4) is not held; 3 is the longest legal.
        assert (five.kv_hit_pages, five.restorable_prefix_pages) == (3, [3])
    else:  # every pool holds every page: every length is restorable
        assert hit.restorable_prefix_pages == list(range(1, N + 1))
        assert (five.kv_hit_pages, five.restorable_prefix_pages) == (5, [1, 2, 3, 4, 5])

    assert r.batch_get_v1(ks, slots(dst.kv, INTO)) == [True] * N
    full = [c for c in dst.sidecars if c.policy == ALL]
    if full:
        got = r.batch_get_v2([transfer(c, ks, INTO) for c in full])
        assert got == {c.name: [True] * N for c in full}
    for c in dst.sidecars:
        if c.policy == TRAILING:
            lo = N - c.window
            assert r.batch_get_v2([transfer(c, ks[lo:], INTO[lo:])]) == {c.name: [True] * c.window}
    # Byte for byte, every pool.
    if not _logical(src):
        assert page_bytes(dst.kv, INTO) == page_bytes(src.kv, KV_AT)
    for c in src.sidecars:
        mine = dst.sidecar(c.name).pool
        lo = N - c.window if c.policy == TRAILING else 0
        assert page_bytes(mine, INTO[lo:]) == page_bytes(c.pool, KV_AT[lo:]), c.name
    r.close()


BAD = 2


def _damage(path: Path, how: str) -> None:
    if how == "missing":
        path.unlink()
    elif how == "truncated":
        os.truncate(path, path.stat().st_size - 1)
    else:  # corrupt: one payload byte flipped
        with open(path, "r+b") as f:
            f.seek(HEADER_BYTES + 3)
            b = f.read(1)
            f.seek(HEADER_BYTES + 3)
            f.write(bytes([b[0] ^ 0x40]))


_CASES = [
    (kind, pool, page)
    for kind, pools in (
        (
            "dsv4",
            [
                "deepseek_v4_c4",
                "deepseek_v4_c4_indexer",
                "deepseek_v4_c128",
                "swa",
                "deepseek_v4_c4_state",
                "deepseek_v4_c4_indexer_state",
            ],
        ),
        (
            "dsv4_fp8",
            [
                "deepseek_v4_c4",
                "deepseek_v4_c4_rope",
                "deepseek_v4_c4_indexer",
                "deepseek_v4_c4_indexer_scale",
                "deepseek_v4_c128",
                "deepseek_v4_c128_rope",
            ],
        ),
        ("swa", ["kv", "swa"]),
        ("mamba", ["kv", "mamba"]),
        ("dsa", ["kv", "indexer"]),
    )
    for pool in pools
    # DeepSeek-V4's pools at both page sizes (their geometry changes with it).
    for page in ([1, 64] if kind.startswith("dsv4") else [64])
]


@pytest.mark.parametrize("how", ["corrupt", "missing", "truncated"])
@pytest.mark.parametrize(("kind", "bad_pool", "page"), _CASES)
def test_a_damaged_record_in_any_pool_ends_the_prefix_for_every_pool(
    store_dir: Path, kind: str, bad_pool: str, page: int, how: str
) -> None:
    src = build(kind, page)
    ks = keys(N, kind)
    w = _attach(store_dir, src)
    _save(w, src, ks, windows=None)  # every pool holds every page
    w.close()

    dst = build(kind, page)
    r = _attach(store_dir, dst, rescan_s=3600)  # no listing in the test: reads decide
    g = r.groups[bad_pool]
    _damage(g.store.tiers[0].path_of(g.key(ks[BAD])), how)  # type: ignore[attr-defined]
    # One batch: the KV through v1 (SGLang's order), then every sidecar through v2 over
    # the same pages, as one transfer each.
    kv = r.batch_get_v1(ks, slots(dst.kv, INTO))
    side = r.batch_get_v2([transfer(c, ks, INTO) for c in dst.sidecars])
    cut = [True] * BAD + [False] * (N - BAD)
    assert side == {c.name: cut for c in dst.sidecars}
    if not _logical(dst):
        assert kv == (cut if bad_pool == "kv" else [True] * N)
        assert page_bytes(dst.kv, INTO[:BAD]) == page_bytes(src.kv, KV_AT[:BAD])
    for c in src.sidecars:
        assert page_bytes(dst.sidecar(c.name).pool, INTO[:BAD]) == page_bytes(
            c.pool, KV_AT[:BAD]
        ), c.name
    # The pool's record is withdrawn: no pool's prefix is offered past it.
    q = r.batch_exists_v2(ks, [PoolTransfer(name=c.name, hit_policy=ALL) for c in dst.sidecars])
    assert q.kv_hit_pages == BAD
    r.close()


def test_a_pool_added_after_attach_is_served(store_dir: Path) -> None:
    """SGLang's dynamic sidecar: registered through v2 once the attach is over."""
    src, dst = build("swa", 16), build("swa", 16)
    ks = keys(N, "late")
    late: Sidecar = src.sidecars.pop()
    w = _attach(store_dir, src)
    w.register_mem_host_pool_v2(late.pool, late.name)  # after on_host_pools_registered
    src.sidecars.append(late)
    _save(w, src, ks, windows=None)
    w.close()
    r = _attach(store_dir, dst)
    hit = r.batch_exists_v2(ks, _query(dst, ks))
    assert (hit.kv_hit_pages, hit.restorable_prefix_pages) == (N, list(range(1, N + 1)))
    c = dst.sidecar("swa")
    assert r.batch_get_v2([transfer(c, ks, INTO)]) == {"swa": [True] * N}
    assert page_bytes(c.pool, INTO) == page_bytes(late.pool, KV_AT)
    r.close()


def test_block_groups_report_whole_groups_and_an_unknown_pool_gates_everything(
    store_dir: Path,
) -> None:
    from bsr_io.integrations.sglang.hybrid import BLOCK_GROUPS, PoolQuery, fold_hits

    # Groups of 2: pages 0-3 held, 4 missing: two whole groups; the KV is not gated.
    held = [True, True, True, True, False, True]
    hits = fold_hits(N, [PoolQuery("deepseek_v4_c128", BLOCK_GROUPS, held, group_pages=2)])
    assert (hits.kv_pages, hits.pool_pages["deepseek_v4_c128"]) == (N, 4)
    # A pool this backend never registered holds nothing: no prefix is restorable.
    s = build("swa", 16)
    ks = keys(N, "unknown")
    b = _attach(store_dir, s)
    _save(b, s, ks, windows=None)
    ask = [*_query(s, ks), PoolTransfer(name="indexer", hit_policy=ALL)]
    assert b.batch_exists_v2(ks, ask).kv_hit_pages == 0
    assert b.batch_get_v2(
        [
            transfer(s.sidecar("swa"), ks, INTO),
            PoolTransfer(name="indexer", host_indices=slots(s.kv, INTO), keys=ks),
        ]
    ) == {"swa": [False] * N, "indexer": [False] * N}
    b.close()
