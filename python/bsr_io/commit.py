"""Rank agreement and the commit rule.

Ranks agree through the `torch.distributed` key-value store of their process
group rather than through collectives, because a collective cannot give up on a
dead or stalled peer without leaving the group out of step for the next request.
Each request gets its own key namespace; every rank posts its vote, then the
first rank to reach a decision writes it with an atomic compare-and-set, and all
live ranks read back the same value. A rank that times out waiting for votes
tries to write "abort"; if a "commit" is already there it follows it instead, so
live ranks never disagree.
"""

from __future__ import annotations

import datetime
import time
from dataclasses import dataclass

COMMIT = "commit"
_POLL_S = 0.005  # store.wait logs a warning on every timeout, so poll with check()
ABORT = "abort"


@dataclass(frozen=True)
class Decision:
    commit: bool
    reason: str  # why not, when commit is False; "" otherwise


class Agreement:
    """How this rank agrees with its peers. `Agreement.local()` is the single-process case."""

    def __init__(self, rank: int, world_size: int, store=None, timeout_s: float = 30.0) -> None:
        if world_size < 1 or not 0 <= rank < world_size:
            raise ValueError(f"rank {rank} is not in a world of size {world_size}")
        if world_size > 1 and store is None:
            raise ValueError("a multi-rank Agreement needs a torch.distributed store")
        if timeout_s <= 0:
            raise ValueError(f"timeout_s must be positive, got {timeout_s}")
        self.rank = rank
        self.world_size = world_size
        self.timeout_s = timeout_s
        self._store = store
        self._seq = 0

    @classmethod
    def local(cls) -> Agreement:
        return cls(0, 1)

    @classmethod
    def from_process_group(cls, group=None, timeout_s: float = 30.0) -> Agreement:
        """Agree among the ranks of `group` (default: the world) through its store."""
        import torch.distributed as dist
        from torch.distributed import distributed_c10d as c10d

        if not dist.is_initialized():
            raise ValueError("torch.distributed is not initialised; call init_process_group first")
        rank = dist.get_rank(group)
        world = dist.get_world_size(group)
        name = "world" if group is None else c10d._get_process_group_name(group)
        store = dist.PrefixStore(f"bsr-io/{name}/", c10d._get_default_store())
        return cls(rank, world, store, timeout_s)

    # Each request (probe or restore) takes the next sequence number on every rank,
    # so ranks calling in the same order meet in the same key namespace.
    def _next(self, kind: str, tag: str) -> str:
        self._seq += 1
        return f"{kind}/{self._seq}/{tag}/"

    def _wait(self, keys: list[str], deadline: float) -> bool:
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            return all(self._store.check([k]) for k in keys)
        try:
            self._store.wait(keys, datetime.timedelta(seconds=remaining))
            return True
        except Exception:  # DistStoreError on timeout; a dead server looks the same
            return False

    def agree_min(self, value: int, tag: str = "") -> int | None:
        """Minimum of `value` over ranks, or None when a peer did not answer in time."""
        if self.world_size == 1:
            return value
        ns = self._next("min", tag)
        self._store.set(f"{ns}{self.rank}", str(value))
        keys = [f"{ns}{r}" for r in range(self.world_size)]
        if not self._wait(keys, time.monotonic() + self.timeout_s):
            return None
        return min(int(self._store.get(k)) for k in keys)

    def open_vote(self, tag: str = "") -> Vote:
        return Vote(self, self._next("vote", tag))


class Vote:
    """One request's commit vote. `aborted()` lets a rank stop early when a peer failed."""

    def __init__(self, agreement: Agreement, ns: str) -> None:
        self._a = agreement
        self._ns = ns

    @property
    def _decision_key(self) -> str:
        return f"{self._ns}decision"

    def aborted(self) -> bool:
        """True once any rank has decided to abort (cheap: one store check)."""
        a = self._a
        if a.world_size == 1:
            return False
        try:
            if not a._store.check([self._decision_key]):
                return False
            return a._store.get(self._decision_key).decode().startswith(ABORT)
        except Exception:  # noqa: BLE001 - store unreachable: stop, the vote will abort
            return True

    def abort_early(self, reason: str) -> None:
        """Publish an abort now so peers stop installing."""
        if self._a.world_size > 1:
            try:
                self._decide(f"{ABORT}:rank {self._a.rank}: {reason}")
            except Exception:  # noqa: BLE001 - cast() reports the unreachable store
                pass

    def _decide(self, proposal: str) -> str:
        got = self._a._store.compare_set(self._decision_key, "", proposal)
        return got.decode() if isinstance(got, bytes) else str(got)

    def cast(self, ok: bool, reason: str = "") -> Decision:
        """Vote, then return the decision every live rank reads back."""
        if self._a.world_size == 1:
            return Decision(ok, "" if ok else reason)
        try:
            return self._cast(ok, reason)
        except Exception as exc:  # noqa: BLE001 - the store's host rank is gone
            # Without the store no rank can have read a commit that includes this one.
            return Decision(False, f"rank agreement failed: {exc}")

    def _cast(self, ok: bool, reason: str) -> Decision:
        a = self._a
        a._store.set(f"{self._ns}{a.rank}", "1" if ok else f"0:{reason}")
        if not ok:
            return _parse(self._decide(f"{ABORT}:rank {a.rank}: {reason}"))
        keys = [f"{self._ns}{r}" for r in range(a.world_size)]
        deadline = time.monotonic() + a.timeout_s
        while True:
            # Stop waiting as soon as someone has decided (an early abort, say).
            if a._store.check([self._decision_key]):
                return _parse(a._store.get(self._decision_key).decode())
            missing = [k for k in keys if not a._store.check([k])]
            if not missing:
                votes = [a._store.get(k).decode() for k in keys]
                bad = [v[2:] for v in votes if v != "1"]
                proposal = COMMIT if not bad else f"{ABORT}:{bad[0]}"
                return _parse(self._decide(proposal))
            if time.monotonic() >= deadline:
                ranks = [k.rsplit("/", 1)[1] for k in missing]
                return _parse(self._decide(f"{ABORT}:timeout waiting for ranks {ranks}"))
            time.sleep(_POLL_S)


def _parse(value: str) -> Decision:
    if value == COMMIT:
        return Decision(True, "")
    return Decision(False, value.split(":", 1)[1] if ":" in value else value)
