"""Direct reads that land ahead of their turn are waited for and hashed on the hash
threads (hashers.py) while the caller hashes the chunk at its turn; every chunk is still
verified after its read ended, and failures still come in chunk order.

A drive that shares its bandwidth among every read in flight lands a small state's reads
all at once; `LandsTogether` (a test double of such a drive) provokes that: a direct
read's wait returns only once every read submitted so far has landed. Everything else is
real: the engine's O_DIRECT reads, SSD and lower tiers on disk, a host KV cache."""

from __future__ import annotations

import os
import time
from pathlib import Path
from typing import Any

import pytest
import torch

from bsr_io import Engine
from bsr_io.cli.synthetic import fill_state, synthetic_chunk
from bsr_io.errors import ChunkReadError
from bsr_io.faults import Fault, FaultPlan
from bsr_io.load import hashers
from bsr_io.load.install import fused_runs
from bsr_io.load.kvcache import PagedKVCache
from bsr_io.model.keys import ChunkKey
from bsr_io.model.layout import AllocatorGroup, KVLayout
from bsr_io.model.record import HEADER_BYTES
from bsr_io.restore import Restorer
from bsr_io.store import Store
from bsr_io.tiers import LowerTier, SSDTier
from bsr_io.tiers.base import DirectChunk

# Blocks of 4 KiB: every run suits O_DIRECT.
LAYOUT = KVLayout(
    "aligned",
    (
        AllocatorGroup("k", torch.float16, (128,), 16),
        AllocatorGroup("v", torch.float16, (2, 64), 16),
    ),
    64,
)
CHUNKS = 8
TOKENS = CHUNKS * LAYOUT.chunk_tokens

pytestmark = pytest.mark.skipif(
    len(os.sched_getaffinity(0)) < 2, reason="hash threads need a second CPU"
)


class LandsTogether(SSDTier):
    """Test double of a drive that lands every read in flight at once: a direct read's
    wait first waits (10 s at most) until every read submitted so far has landed.
    `fail_at_wait`: chunk positions whose wait then raises a read error (an errno)."""

    def __init__(self, *args: Any, fail_at_wait: frozenset[int] = frozenset(), **kw: Any):
        super().__init__(*args, **kw)
        self.fail_at_wait = fail_at_wait
        self.positions: dict[ChunkKey, int] = {}
        self.handles: list[DirectChunk] = []

    def submit_read_into(self, key, engine, bufs, runs):  # type: ignore[no-untyped-def]
        inner = super().submit_read_into(key, engine, bufs, runs)
        self.handles.append(inner)

        def finish(timeout: float | None) -> None:
            until = time.monotonic() + 10
            while not all(h.done() for h in self.handles) and time.monotonic() < until:
                time.sleep(0.001)
            inner.wait(timeout)
            if self.positions.get(key) in self.fail_at_wait:
                raise ChunkReadError("injected: EIO at the read's end", key=key, tier=self.name)

        return DirectChunk(
            key,
            finish,
            inner.done,
            expected_xxh3=inner.expected_xxh3,
            reject=inner.reject,
            abandon=inner.abandon,
            returned=inner.returned,
        )


class HashedAhead:
    """Spy on hashers.hash_later (the real one runs): which chunks went to hash threads."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch, dest: PagedKVCache) -> None:
        self.runs = {i: fused_runs(dest, i) for i in range(CHUNKS)}
        self.chunks: list[int] = []
        real = hashers.hash_later

        def spy(where):  # type: ignore[no-untyped-def]
            self.chunks += [i for i, w in self.runs.items() if w == where]
            return real(where)

        monkeypatch.setattr(hashers, "hash_later", spy)


def _flip(path: Path) -> None:
    """One payload byte of the stored record changed on disk."""
    with open(path, "r+b") as f:
        f.seek(HEADER_BYTES + 100)
        b = f.read(1)
        f.seek(HEADER_BYTES + 100)
        f.write(bytes([b[0] ^ 0x5A]))


def _restore(
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    fault: Fault | None = None,
    damaged: int | None = None,
    **kw: Any,
):
    engine = Engine(4, LAYOUT.chunk_bytes)
    l2 = LandsTogether(tmp_path / "l2", None, engine, layout=LAYOUT, **kw)
    l3 = LowerTier(tmp_path / "l3", layout=LAYOUT)
    for t in (l2, l3):
        tokens, keys = fill_state(t, LAYOUT, TOKENS, seed=5, model="m")
    if damaged is not None:
        _flip(l2.path_of(keys[damaged]))
    l2.positions = {k: i for i, k in enumerate(keys)}
    top = l2 if fault is None else FaultPlan([fault]).wrap(l2, keys=keys)
    dest = PagedKVCache.allocate(LAYOUT, TOKENS)
    spy = HashedAhead(monkeypatch, dest)
    r = Restorer(Store([top, l3]), LAYOUT, window=4, engine=engine, model="m")
    res = r.restore(r.probe(tokens), dest)
    ok = all(dest.chunk_bytes(i) == synthetic_chunk(LAYOUT, 5, i).tobytes() for i in range(CHUNKS))
    return res, l2, keys, spy, ok


def test_reads_landed_together_are_hashed_side_by_side(tmp_path, monkeypatch) -> None:
    res, _, _, spy, ok = _restore(tmp_path, monkeypatch)
    assert res.outcome == "complete", res.reason
    assert ok and res.fallbacks == [] and res.timings["direct_chunks"] == CHUNKS
    assert spy.chunks and 0 not in spy.chunks  # chunk 0 is hashed at its turn, the rest ahead


def test_a_bad_record_hashed_ahead_falls_back_in_order(tmp_path, monkeypatch) -> None:
    """Chunk 1's stored payload is damaged: its hash, made ahead of its turn, differs;
    the slot read confirms it, the record is withdrawn and L3's copy goes in its blocks."""
    res, l2, _, spy, ok = _restore(tmp_path, monkeypatch, damaged=1)
    assert 1 in spy.chunks
    assert res.outcome == "complete", res.reason
    assert [f["chunk"] for f in res.fallbacks] == [1] and res.source_tiers[1] == "L3"
    assert "direct read" in " ".join(res.fallbacks[0]["causes"])
    assert len(l2.quarantined_files()) == 1 and ok


def test_memory_changed_at_the_reads_end_is_seen_when_hashed_ahead(tmp_path, monkeypatch):
    """The fault double flips a byte of chunk 1 in the cache as its read ends: the wait
    ahead of its turn comes before its hash, so the change is seen; the chunk is read
    again through a slot and kept (the record is fine)."""
    res, l2, keys, spy, ok = _restore(tmp_path, monkeypatch, Fault("clobber", chunks=[1], times=1))
    assert 1 in spy.chunks
    assert res.outcome == "complete", res.reason
    assert [f["chunk"] for f in res.fallbacks] == [1] and res.source_tiers[1] == "L2"
    assert l2.quarantined_files() == [] and l2.contains(keys[1]) and ok


def test_a_read_that_failed_ahead_fails_at_its_turn(tmp_path, monkeypatch) -> None:
    """Chunk 2's read ends in an error while chunk 1 is installed: the error is kept and
    raised at chunk 2's turn, which falls back to L3; nothing is withdrawn for an errno."""
    res, l2, _, spy, ok = _restore(tmp_path, monkeypatch, fail_at_wait=frozenset({2}))
    assert 3 in spy.chunks  # hashed ahead: the scan went on past chunk 2's failed wait
    assert res.outcome == "complete", res.reason
    assert [f["chunk"] for f in res.fallbacks] == [2] and res.source_tiers[2] == "L3"
    assert "injected: EIO" in " ".join(res.fallbacks[0]["causes"])
    assert l2.quarantined_files() == [] and ok
