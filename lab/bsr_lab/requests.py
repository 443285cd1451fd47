"""A rank serving a sequence of requests, some with this rank late at one phase.

Run on real ranks by `bsr_io.cli.ranks.launch` (tests, `bsr-lab bench faults`).
Every request restores the same stored state (or, for a "miss", tokens nobody
stored) into a fresh destination. A late rank sleeps `late_s` at the chosen phase:

  discovery   before `probe` (it reaches the hit agreement after the others)
  install     inside the install of chunk 1 (a slow destination copy)
  vote        after the last install, before the vote (`Destination.synchronize`)
  raise       its destination raises MemoryError at chunk 1 (an install that fails)

Those are test doubles of a slow or failing destination, documented as such; the
engine, files, store and process group are real. The result lists, per request,
the outcome, committed tokens, reason and seconds, so callers can check that every
request ends the same on every rank.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from bsr_io._core import Engine
from bsr_io.cli.synthetic import fill_state, synthetic_chunk, synthetic_tokens
from bsr_io.commit import Agreement
from bsr_io.load.kvcache import PagedKVCache
from bsr_io.model.layout import KVLayout, preset
from bsr_io.restore import Restorer
from bsr_io.store import open_store

PHASES = ("discovery", "install", "vote", "raise")


class _Late:
    """Destination double: late (or failing) at one phase of one rank's request."""

    def __init__(self, inner: PagedKVCache, phase: str, late_s: float) -> None:
        self.inner, self.phase, self.late_s = inner, phase, late_s
        self.layout: KVLayout = inner.layout
        self.capacity_chunks = inner.capacity_chunks

    def install(self, chunk_index: int, payload: torch.Tensor):
        if chunk_index == 1 and self.phase == "install":
            time.sleep(self.late_s)
        if chunk_index == 1 and self.phase == "raise":
            raise MemoryError("injected: the destination could not take chunk 1")
        return self.inner.install(chunk_index, payload)

    def extract(self, chunk_index: int, out: torch.Tensor) -> None:
        self.inner.extract(chunk_index, out)

    def synchronize(self) -> None:
        if self.phase == "vote":
            time.sleep(self.late_s)
        self.inner.synchronize()


def serve_on_rank(
    rank: int,
    world_size: int,
    *,
    root: str,
    requests: list[dict],
    layout: str = "tiny",
    tokens: int = 8 * 16,
    window: int = 2,
    seed: int = 5,
    model: str = "requests",
    timeout_s: float = 3.0,
    late_s: float = 4.5,
) -> dict[str, Any]:
    """Serve `requests` in order; each is {"late": {rank: phase}, "miss": bool, "id": str}."""
    lay = preset(layout)
    engine = Engine(window, lay.chunk_bytes)
    store = open_store(engine, Path(root) / f"l2-{rank}", layout=lay)
    token_ids, _ = fill_state(store.tier("L2"), lay, tokens, seed, rank, world_size, model)
    agreement = Agreement.from_process_group(timeout_s=timeout_s)
    r = Restorer(store, lay, window=window, engine=engine, model=model, agreement=agreement)
    dist.barrier()  # start the first request together, whatever each rank's setup took
    out = []
    for i, req in enumerate(requests):
        phase = (req.get("late") or {}).get(str(rank))
        if phase is not None and phase not in PHASES:
            raise ValueError(f"unknown phase {phase!r}; choose one of {PHASES}")
        ids = synthetic_tokens(seed + 1000 + i, tokens) if req.get("miss") else token_ids
        dest = PagedKVCache.allocate(lay, tokens)
        target = _Late(dest, phase, late_s) if phase is not None else dest
        t0 = time.monotonic()
        if phase == "discovery":
            time.sleep(late_s)
        try:
            plan = r.probe(ids, request_id=req["id"]) if req.get("id") else r.probe(ids)
            res = r.restore(plan, target)
        except MemoryError as exc:
            out.append(
                {
                    "outcome": "raised",
                    "committed_tokens": 0,
                    "reason": str(exc),
                    "seconds": time.monotonic() - t0,
                }
            )
            continue
        data_ok = None
        if res.complete:
            data_ok = all(
                dest.chunk_bytes(c) == synthetic_chunk(lay, seed, c, rank).tobytes()
                for c in range(res.committed_chunks)
            )
        out.append(
            {
                "outcome": res.outcome,
                "committed_tokens": res.committed_tokens,
                "reason": res.reason,
                "data_ok": data_ok,
                "seconds": time.monotonic() - t0,
            }
        )
    engine.close()
    return {"rank": rank, "requests": out}
