"""Every error path of a read or a write gives its staging slot back before the error
reaches the caller: checked with `Engine.free_slots()` while the error is still held
(a kept traceback must not pin a slot), not by the next request's deadline.

Real faults where the kernel can make them: ENOSPC from a real 1 MiB tmpfs (mounted
here; needs root), a record truncated on disk after the probe."""

from __future__ import annotations

import errno
import os
import subprocess
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from bsr_io import Engine
from bsr_io.cli.synthetic import fill_state
from bsr_io.errors import ChunkError
from bsr_io.load.kvcache import PagedKVCache
from bsr_io.model.layout import preset
from bsr_io.model.record import HEADER_BYTES
from bsr_io.restore import Restorer
from bsr_io.store import Store
from bsr_io.tiers import LowerTier, SSDTier

LAYOUT = preset("tiny")
W = 4
CHUNKS = 8  # 8 records of ~6 KiB: more than a 16 KiB tmpfs holds


@pytest.fixture
def tiny_fs(tmp_path: Path) -> Iterator[Path]:
    """A real tmpfs of 16 KiB: writes past it fail ENOSPC in the kernel."""
    d = tmp_path / "tiny"
    d.mkdir()
    run = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=16k", "tmpfs", str(d)], check=False)
    if run.returncode != 0:
        pytest.skip("mounting a tmpfs needs root (CAP_SYS_ADMIN)")
    try:
        yield d
    finally:
        subprocess.run(["umount", "-l", str(d)], check=False)


def _cache(tokens: int) -> PagedKVCache:
    return PagedKVCache.allocate(LAYOUT, tokens)


def _filled_source(tmp_path: Path, engine: Engine) -> tuple[Any, PagedKVCache]:
    """Tokens and a cache holding their KV (restored from a good store)."""
    src = SSDTier(tmp_path / "src", None, engine, layout=LAYOUT)
    tokens, _ = fill_state(src, LAYOUT, CHUNKS * LAYOUT.chunk_tokens, seed=5, model="m")
    cache = _cache(len(tokens))
    r = Restorer(Store([src]), LAYOUT, window=W, engine=engine, model="m", timeout_s=10)
    assert r.restore(r.probe(tokens), cache).outcome == "complete"
    return tokens, cache


def test_enospc_on_the_ssd_tier_gives_every_slot_back(tmp_path: Path, tiny_fs: Path) -> None:
    with Engine(W, LAYOUT.chunk_bytes) as engine:
        tokens, cache = _filled_source(tmp_path, engine)
        full = SSDTier(tiny_fs, None, engine, layout=LAYOUT)
        r = Restorer(Store([full]), LAYOUT, window=W, engine=engine, model="m", timeout_s=10)
        with pytest.raises(ChunkError) as err:
            r.save(tokens, cache)
        assert errno.ENOSPC in _errnos(err.value), err.value
        assert engine.free_slots() == W  # with the error still held


def test_enospc_on_the_l3_write_through_gives_every_slot_back(
    tmp_path: Path, tiny_fs: Path
) -> None:
    with Engine(W, LAYOUT.chunk_bytes) as engine:
        tokens, cache = _filled_source(tmp_path, engine)
        l2 = SSDTier(tmp_path / "l2", None, engine, layout=LAYOUT)
        l3 = LowerTier(tiny_fs, layout=LAYOUT)
        r = Restorer(Store([l2, l3]), LAYOUT, window=W, engine=engine, model="m", timeout_s=10)
        with pytest.raises(ChunkError) as err:
            r.save(tokens, cache)
        assert errno.ENOSPC in _errnos(err.value), err.value
        assert engine.free_slots() == W
        # The records L2 took still restore, and the restore gives its slots back too.
        plan = r.probe(tokens)
        assert plan.hit_chunks >= 1
        res = r.restore(plan, _cache(len(tokens)))
        assert res.outcome in ("complete", "partial"), res.reason
        assert engine.free_slots() == W


def test_a_record_truncated_after_the_probe_completes_from_l3(tmp_path: Path) -> None:
    """The short read withdraws the L2 record, returns its slot, and L3 serves the chunk
    (the issue: 9 of 12 runs ended `zero` with no slot free in time)."""
    with Engine(W, LAYOUT.chunk_bytes) as engine:
        l2 = SSDTier(tmp_path / "l2", None, engine, layout=LAYOUT)
        l3 = LowerTier(tmp_path / "l3", layout=LAYOUT)
        store = Store([l2, l3])
        tokens, keys = fill_state(store, LAYOUT, CHUNKS * LAYOUT.chunk_tokens, seed=9, model="m")
        r = Restorer(store, LAYOUT, window=W, engine=engine, model="m", timeout_s=10)
        plan = r.probe(tokens)
        assert plan.hit_chunks == CHUNKS
        for k in keys[2:6]:  # four short records: as many as the window has slots
            os.truncate(l2.path_of(k), HEADER_BYTES + LAYOUT.chunk_bytes // 2)
        res = r.restore(plan, _cache(len(tokens)))
        assert res.outcome == "complete", res.reason
        assert engine.free_slots() == W


def test_a_short_read_from_each_tier_gives_its_slot_back(tmp_path: Path) -> None:
    with Engine(W, LAYOUT.chunk_bytes) as engine:
        for tier in (
            SSDTier(tmp_path / "l2", None, engine, layout=LAYOUT),
            LowerTier(tmp_path / "l3", layout=LAYOUT),
        ):
            _, keys = fill_state(tier, LAYOUT, 2 * LAYOUT.chunk_tokens, seed=1, model="m")
            os.truncate(tier.path_of(keys[0]), HEADER_BYTES + 100)
            with pytest.raises(ChunkError) as err:
                tier.submit_read(keys[0], engine).wait(10)
            assert err.value.key == keys[0]
            assert engine.free_slots() == W, tier.name


def _errnos(exc: BaseException | None) -> set[int]:
    """Every errno along an exception's causes."""
    out: set[int] = set()
    while exc is not None:
        if isinstance(exc, OSError) and exc.errno is not None:
            out.add(exc.errno)
        cause = getattr(exc, "cause", None)
        exc = cause if isinstance(cause, BaseException) else exc.__cause__
    return out
