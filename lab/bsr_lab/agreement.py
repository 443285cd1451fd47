"""Rank agreement scenarios on real ranks (one process each, one gloo group, the group's
real TCPStore), run by `bsr_io.cli.ranks.launch` from tests/restore/test_agreement.py.

- `keys_on_rank`: many requests (hit agreement + vote); rank 0 counts the store's keys
  as it goes, then runs a control that keeps every key (the old behaviour).
- `drift_on_rank`: unnamed requests, one rank skips one (its probe failed before the
  request was numbered); every later request must end the same on both ranks.
- `reuse_on_rank`: a request id forgotten and used again meets no old decision.
- `expire_on_rank`: a rank that never comes leaves keys; they expire.
- `lost_store_on_rank`: rank 1 loses the store right after posting its commit vote (a
  documented test double around the real store provokes it): it must raise
  DecisionUnknown, never return a local zero, while rank 0 commits.
"""

from __future__ import annotations

import time
from typing import Any

import torch.distributed as dist
from torch.distributed import distributed_c10d as c10d

from bsr_io.commit import Agreement, _Numbering
from bsr_io.errors import DecisionUnknown


def _keys() -> int:
    return int(c10d._get_default_store().num_keys())


def _one(a: Agreement, i: int, rank: int, named: bool) -> tuple[int, bool]:
    ns = a.request(f"r{i}" if named else None, tag=f"{i:032x}")
    value, _ = a.agree_min(1000 + i + rank, ns)
    return value, a.open_vote(ns).cast(value > 0).commit


def keys_on_rank(
    rank: int, world_size: int, *, requests: int, control: int, every: int, named: bool
) -> dict[str, Any]:
    a = Agreement.from_process_group(timeout_s=20.0)
    dist.barrier()
    base = _keys()
    samples, wrong = [], 0
    t0 = time.perf_counter()
    for i in range(requests):
        value, committed = _one(a, i, rank, named)
        wrong += value != 1000 + i or not committed
        if (i + 1) % every == 0:
            samples.append(_keys())
    seconds = time.perf_counter() - t0
    dist.barrier()
    settled = _keys()
    keep = Agreement.from_process_group(timeout_s=20.0)
    keep._keep_keys = True  # the control: nothing is deleted, as before
    dist.barrier()
    before = _keys()
    for i in range(requests, requests + control):
        _one(keep, i, rank, named)
    dist.barrier()
    return {
        "rank": rank,
        "base": base,
        "samples": samples,
        "settled": settled,
        "control_before": before,
        "control_after": _keys(),
        "wrong": wrong,
        "seconds": seconds,
    }


def drift_on_rank(
    rank: int, world_size: int, *, requests: int, skip: int, repeat: int | None = None
) -> dict[str, Any]:
    """Rank 1 never numbers request `skip`. `repeat`: that request's content is the same
    as the one before it (a repeated prompt: the same tag)."""
    a = Agreement.from_process_group(timeout_s=1.0)
    out: list[Any] = []
    for i in range(requests):
        content = i - 1 if repeat is not None and i == repeat else i
        if rank == 1 and i == skip:
            out.append(None)
            continue
        ns = a.request(None, tag=f"{content:032x}")
        value, why = a.agree_min(100 + 100 * content + rank, ns)
        decision = a.open_vote(ns).cast(value > 0)
        out.append([value, decision.commit])
    return {"rank": rank, "results": out}


def reuse_on_rank(rank: int, world_size: int, *, keep_keys: bool) -> dict[str, Any]:
    _Numbering._IDS_MAX = 4  # forget ids quickly: "r" comes back as its first use
    a = Agreement.from_process_group(timeout_s=2.0, expire_s=3.0)
    a._keep_keys = keep_keys
    first = a.agree_min(10, a.request("r"))
    for i in range(8):
        a.agree_min(5, a.request(f"other{i}"))
    again_ns = a.request("r")
    again = a.agree_min(3, again_ns)
    return {"rank": rank, "first": list(first), "again": list(again), "ns": again_ns}


def expire_on_rank(rank: int, world_size: int, *, lone: int, lone_rank: int) -> dict[str, Any]:
    # expire_s leaves the lone requests (4 x 0.3 s of timeouts) a wide margin on a busy
    # machine: none of their keys may expire before they are counted (6 s was not
    # enough once, with CI and other tests sharing the 2 cores).
    a = Agreement.from_process_group(timeout_s=0.3, expire_s=12.0)
    dist.barrier()
    base = _keys()
    if rank == lone_rank:  # the other rank never comes to these
        for i in range(lone):
            a.agree_min(1, a.request(f"lone{i}"))
    dist.barrier()
    left = _keys()
    time.sleep(12.2)
    dist.barrier()
    together = [a.agree_min(7, a.request(f"both{i}")) for i in range(3)]
    dist.barrier()
    return {
        "rank": rank,
        "base": base,
        "left": left,
        "after": _keys(),
        "together": [list(t) for t in together],
    }


class _LoseAfterPost:
    """Test double: the real store until this rank's vote is posted, then every call
    fails as if the store's host were gone."""

    def __init__(self, inner: Any) -> None:
        self.inner = inner
        self.lost = False

    def __getattr__(self, name: str) -> Any:
        if self.lost:
            raise RuntimeError("store lost (test double)")
        return getattr(self.inner, name)

    def set(self, key: str, value: str) -> None:
        if self.lost:
            raise RuntimeError("store lost (test double)")
        self.inner.set(key, value)
        if "/vote/" in key:
            self.lost = True


def lost_store_on_rank(rank: int, world_size: int) -> dict[str, Any]:
    a = Agreement.from_process_group(timeout_s=3.0)
    ns = a.request("lost")
    hit = a.agree_min(4, ns)
    if rank == 1:
        a._store = _LoseAfterPost(a._store)
    try:
        d = a.open_vote(ns).cast(True)
        outcome = "commit" if d.commit else "zero"
    except DecisionUnknown as exc:
        outcome = f"unknown: {exc}"
    return {"rank": rank, "hit": list(hit), "outcome": outcome}
