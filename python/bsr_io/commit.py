"""Rank agreement and the commit rule.

Ranks agree through the `torch.distributed` key-value store of their process
group rather than through collectives, because a collective cannot give up on a
dead or stalled peer without leaving the group out of step for the next request.

Each request has an identity every rank shares (the caller's request id, or the
request's number in call order) and so its own key namespace. Each phase of it
(the hit agreement, the commit vote, an early abort) ends with ONE decision key,
written by the first rank to decide with an atomic compare-and-set; every live
rank reads back the same value. A rank that times out writes "abort"; one that
arrives later finds the decision taken and adopts it, never agreeing afresh on
stale values. Outcomes therefore match per request, whatever a rank's delay.
"""

from __future__ import annotations

import threading
import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from torch.distributed import ProcessGroup
    from torch.distributed.distributed_c10d import Store

COMMIT = "commit"
_POLL_S = 0.005  # store.wait logs a warning on every timeout, so poll with check()
ABORT = "abort"


@dataclass(frozen=True)
class Decision:
    commit: bool
    reason: str  # why not, when commit is False; "" otherwise


class Agreement:
    """How this rank agrees with its peers. `Agreement.local()` is the single-process case."""

    def __init__(
        self,
        rank: int,
        world_size: int,
        store: Store | None = None,
        timeout_s: float = 30.0,
        *,
        scope: str | None = None,
    ) -> None:
        if world_size < 1 or not 0 <= rank < world_size:
            raise ValueError(f"rank {rank} is not in a world of size {world_size}")
        if world_size > 1 and store is None:
            raise ValueError("a multi-rank Agreement needs a torch.distributed store")
        if timeout_s <= 0:
            raise ValueError(f"timeout_s must be positive, got {timeout_s}")
        self.rank = rank
        self.world_size = world_size
        self.timeout_s = timeout_s
        self._store: Any = store  # torch's Store; None (never used) when world_size == 1
        # Agreements over the same process group share their request numbering, so a
        # new Restorer per request cannot restart at 1 and meet an old request's keys.
        self._ids = _Numbering() if scope is None else _SCOPES.setdefault(scope, _Numbering())

    @classmethod
    def local(cls) -> Agreement:
        return cls(0, 1)

    @classmethod
    def from_process_group(
        cls, group: ProcessGroup | None = None, timeout_s: float = 30.0
    ) -> Agreement:
        """Agree among the ranks of `group` (default: the world) through its store."""
        import torch.distributed as dist
        from torch.distributed import distributed_c10d as c10d

        if not dist.is_initialized():
            raise ValueError("torch.distributed is not initialised; call init_process_group first")
        rank = dist.get_rank(group)
        world = dist.get_world_size(group)
        name = "world" if group is None else c10d._get_process_group_name(group)
        store = c10d.PrefixStore(f"bsr-io/{name}/", c10d._get_default_store())
        return cls(rank, world, store, timeout_s, scope=f"{id(c10d._get_default_store())}/{name}")

    def request(self, request_id: str | None = None, tag: str = "") -> str:
        """The key namespace of one request, the same on every rank.

        `request_id` is the caller's (a serving engine's request id); None numbers the
        requests in call order, which ranks calling in the same order share. The k-th
        use of one id gets its own namespace, so a retried request never reads the
        decisions of its earlier attempt."""
        return self._ids.namespace(request_id, tag)

    def agree_min(self, value: int, request: str | None = None) -> tuple[int, str]:
        """(minimum of `value` over ranks, "") or (0, why) when the ranks did not agree.

        Every rank posts its value; the first rank to see all of them, or to time out,
        writes the decision with compare-and-set and every rank returns what is stored.
        A rank arriving after a timeout adopts that decision, never its own late view."""
        if value < 0:
            raise ValueError(f"value must be >= 0, got {value}")
        if self.world_size == 1:
            return value, ""
        ns = (request or self.request()) + "hit/"
        try:
            got = _decide_when_all(self, ns, str(value), lambda vs: str(min(map(int, vs))))
        except Exception as exc:  # noqa: BLE001 - the store's host rank is gone
            return 0, f"rank agreement failed: {exc}"
        if got.startswith(ABORT):
            return 0, got.split(":", 1)[1]
        return int(got), ""

    def open_vote(self, request: str | None = None) -> Vote:
        """The commit vote of `request` (a namespace from `request()`, or a request id)."""
        if not request:
            request = self.request()
        elif not request.startswith(_NS_PREFIX):
            request = self.request(request)
        return Vote(self, request + "vote/")


_NS_PREFIX = "req/"


class _Numbering:
    """Request namespaces: automatic numbers, and how often each caller id was used."""

    _KEEP = 1 << 16  # ids remembered for retries; older ones start again at 0

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._auto = 0
        self._uses: OrderedDict[str, int] = OrderedDict()

    def namespace(self, request_id: str | None, tag: str) -> str:
        with self._lock:
            if request_id is None or request_id == "":
                self._auto += 1
                request_id = f"auto-{self._auto}" + (f"-{tag}" if tag else "")
            k = self._uses.pop(request_id, -1) + 1
            self._uses[request_id] = k
            while len(self._uses) > self._KEEP:
                self._uses.popitem(last=False)
        return f"{_NS_PREFIX}{request_id}#{k}/"


_SCOPES: dict[str, _Numbering] = {}


def _decide_when_all(a: Agreement, ns: str, mine: str, combine: Callable[[list[str]], str]) -> str:
    """Post `mine`, then return the decision under `ns`: `combine(values)` once every
    rank has posted, or an abort on timeout; whoever writes first decides for all."""
    store = a._store
    decision = f"{ns}decision"
    store.set(f"{ns}{a.rank}", mine)
    keys = [f"{ns}{r}" for r in range(a.world_size)]
    deadline = time.monotonic() + a.timeout_s
    while True:
        if store.check([decision]):
            return _text(store.get(decision))
        missing = [k for k in keys if not store.check([k])]
        if not missing:
            proposal = combine([_text(store.get(k)) for k in keys])
        elif time.monotonic() >= deadline:
            ranks = [k.rsplit("/", 1)[1] for k in missing]
            proposal = f"{ABORT}:timeout waiting for ranks {ranks}"
        else:
            time.sleep(_POLL_S)
            continue
        return _text(store.compare_set(decision, "", proposal))


def _text(value: object) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)


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
            return _text(a._store.get(self._decision_key)).startswith(ABORT)
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
        return _text(self._a._store.compare_set(self._decision_key, "", proposal))

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
        if not ok:
            a._store.set(f"{self._ns}{a.rank}", f"0:{reason}")
            return _parse(self._decide(f"{ABORT}:rank {a.rank}: {reason}"))

        def combine(votes: list[str]) -> str:
            bad = [v[2:] for v in votes if v != "1"]
            return COMMIT if not bad else f"{ABORT}:{bad[0]}"

        return _parse(_decide_when_all(a, self._ns, "1", combine))


def _parse(value: str) -> Decision:
    if value == COMMIT:
        return Decision(True, "")
    return Decision(False, value.split(":", 1)[1] if ":" in value else value)
