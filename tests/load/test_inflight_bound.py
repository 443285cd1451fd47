"""The engine's bound on bytes in flight per drive, seen in a real restore (real files,
O_DIRECT reads through io_uring straight into a host cache) from the engine's own
request trace: what was in flight when each request went to the kernel, in order."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from bsr_io import Engine
from bsr_io.cli.synthetic import fill_state, synthetic_chunk
from bsr_io.load.kvcache import PagedKVCache
from bsr_io.model.layout import AllocatorGroup, KVLayout
from bsr_io.restore import Restorer
from bsr_io.store import Store
from bsr_io.tiers import SSDTier

KiB = 1 << 10
# One 64 KiB block per group per chunk: a chunk is 128 KiB, 8 requests of 16 KiB.
LAYOUT = KVLayout(
    "inflight",
    (
        AllocatorGroup("k", torch.float16, (128,), 256),
        AllocatorGroup("v", torch.float16, (128,), 256),
    ),
    256,
)
CHUNKS = 8
REQUEST = 16 * KiB
BOUND = 32 * KiB  # two requests


def _restore(
    tmp_path: Path, inflight_bytes: int, tail_inflight: int | None = None
) -> tuple[list[tuple[int, ...]], dict]:
    """A restore of CHUNKS chunks through an engine with this bound, its last read capped
    at `tail_inflight`: (its trace, marks)."""
    engine = Engine(
        CHUNKS, LAYOUT.chunk_bytes, request_bytes=REQUEST, inflight_bytes=inflight_bytes
    )
    if engine.backend != "io_uring":
        pytest.skip("the bound is the io_uring backend's")
    tier = SSDTier(tmp_path / f"l2-{inflight_bytes}-{tail_inflight}", None, engine, layout=LAYOUT)
    tokens, _ = fill_state(tier, LAYOUT, CHUNKS * LAYOUT.chunk_tokens, seed=5, model="m")
    dest = PagedKVCache.allocate(LAYOUT, len(tokens))
    r = Restorer(Store([tier]), LAYOUT, engine=engine, model="m", tail_inflight=tail_inflight)
    plan = r.probe(tokens)
    engine.trace_start()
    res = r.restore(plan, dest)
    events = engine.trace_take()
    assert res.complete, res.reason
    assert res.timings["direct_chunks"] == CHUNKS  # read in place: requests of the payload
    assert all(dest.chunk_bytes(i) == synthetic_chunk(LAYOUT, 5, i).tobytes() for i in (0, 7))
    engine.close()
    return events, res.marks


def _most_in_flight(events: list[tuple[int, ...]]) -> int:
    """The most bytes in flight as any request went to the kernel (itself included): the
    I/O thread stamps both submissions and completions, so their order is exact."""
    return max(sum(e[1] for e in events if e[3] <= at[3] < e[4] or e is at) for at in events)


def test_bytes_in_flight_stay_within_the_bound_and_chunk_0_lands_first(tmp_path: Path) -> None:
    events, marks = _restore(tmp_path, BOUND)
    assert len(events) >= CHUNKS * LAYOUT.chunk_bytes // REQUEST
    assert _most_in_flight(events) <= BOUND
    # Chunk 0's requests went first (one drive: in order); every one of them completed
    # before the last request went to the kernel, so chunk 0 is there to hash while the
    # rest are read, not only once every read is back.
    by_submit = sorted(events, key=lambda e: e[3])
    first, got = [], 0
    for e in by_submit:
        if got >= LAYOUT.chunk_bytes:
            break
        first.append(e)
        got += e[1]
    assert max(e[4] for e in first) < by_submit[-1][3]
    # The restore's own stamps: chunk 0's hash began before the last chunk's.
    assert marks["first_submitted"] <= marks["first_hash"] < marks["last_hash"] <= marks["end"]


def test_control_without_the_bound_a_whole_chunk_is_in_flight_at_once(tmp_path: Path) -> None:
    """Control: bound off (0), the queue depth alone bounds the requests: a chunk's 8
    requests go to the kernel together, 4 times the bound."""
    events, _ = _restore(tmp_path, 0)
    assert _most_in_flight(events) >= LAYOUT.chunk_bytes > BOUND


def test_the_bound_is_an_engine_setting(tmp_path: Path) -> None:
    assert Engine(1, 4096).features["inflight_bytes"] == 32 << 20  # the default
    e = Engine(1, 4096, inflight_bytes=0)
    assert e.features["inflight_bytes"] == 0
    with pytest.raises(ValueError, match="inflight_bytes must be at least 0"):
        Engine(1, 4096, inflight_bytes=-1)


def test_the_last_chunks_read_keeps_its_bytes_in_flight_under_the_tail_cap(
    tmp_path: Path,
) -> None:
    """No drive bound: every chunk's requests go at once, the last one's too unless the
    restore caps that read, so that its requests land one after another and are hashed
    as they land (window.py)."""
    per_chunk = LAYOUT.chunk_bytes // REQUEST

    def last_chunks_most(tail: int | None) -> int:
        events, _ = _restore(tmp_path, 0, tail)
        # The last chunk's requests are the last the I/O thread took from the window.
        last = sorted(events, key=lambda e: e[2])[-per_chunk:]
        assert sum(e[1] for e in last) == LAYOUT.chunk_bytes
        return _most_in_flight(last)

    # Control: uncapped, its requests are in flight together.
    assert last_chunks_most(None) > BOUND
    assert last_chunks_most(BOUND) <= BOUND
