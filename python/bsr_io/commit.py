"""Rank agreement and the commit rule.

Ranks agree through the `torch.distributed` key-value store of their process
group rather than through collectives, because a collective cannot give up on a
dead or stalled peer without leaving the group out of step for the next request.

Each request has a namespace every rank derives alike (the caller's request id and
its use count, or, unnamed, the request's number in call order and a digest of its
content). Each phase of it (the hit agreement, the commit vote, an early abort) ends
with ONE decision key, written by the first rank to decide with an atomic
compare-and-set; every live rank reads back the same value. A rank that times out
writes "abort"; one that arrives later finds the decision taken and adopts it, never
agreeing afresh on stale values. A decision names the posts it was made from (a
random nonce per post): a rank adopts a hit or a commit only when its own post is
among them, so a namespace that still held another request's decision can only end
that rank's request `zero`. Once every rank has read a decision its keys are deleted;
what a missing rank leaves behind expires (`expire_s`). Outcomes therefore match per
request, whatever a rank's delay, and the store holds a bounded number of keys.
"""

from __future__ import annotations

import secrets
import threading
import time
from collections import OrderedDict, deque
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from bsr_io.errors import BsrValueError, DecisionUnknown

if TYPE_CHECKING:
    from torch.distributed import ProcessGroup
    from torch.distributed.distributed_c10d import Store

COMMIT = "commit"
ABORT = "abort"
_NS_PREFIX = "req/"
_AUTO_PREFIX = "auto/"
_AT = "at/"  # at/<rank>: "<number> <tag>;..." of the last unnamed requests a rank began
_HISTORY = 8
# Waits poll the store (store.wait logs a warning on every timeout), backing off from
# 1 ms to 50 ms: a quick agreement costs little, a long wait few requests.
_POLL_FIRST_S, _POLL_MAX_S, _POLL_GROWTH = 0.001, 0.05, 1.5
_FOLLOW_EVERY_S = 0.05  # how often an unnamed request that waits looks for its peers


@dataclass(frozen=True)
class Decision:
    commit: bool
    reason: str  # why not, when commit is False; "" otherwise


class Agreement:
    """How this rank agrees with its peers. `Agreement.local()` is the single-process case.

    `expire_s` (default max(60 s, 10 x timeout_s)): how long the keys of a request that a
    rank never finished stay in the store; it must exceed the longest delay a live rank
    may still have within one phase."""

    def __init__(
        self,
        rank: int,
        world_size: int,
        store: Store | None = None,
        timeout_s: float = 30.0,
        *,
        scope: str | None = None,
        expire_s: float | None = None,
    ) -> None:
        if world_size < 1 or not 0 <= rank < world_size:
            raise BsrValueError(f"rank {rank} is not in a world of size {world_size}")
        if world_size > 1 and store is None:
            raise BsrValueError("a multi-rank Agreement needs a torch.distributed store")
        if timeout_s <= 0:
            raise BsrValueError(f"timeout_s must be positive, got {timeout_s}")
        self.rank = rank
        self.world_size = world_size
        self.timeout_s = timeout_s
        self.expire_s = max(60.0, 10 * timeout_s) if expire_s is None else expire_s
        if self.expire_s <= timeout_s:
            raise BsrValueError(f"expire_s ({self.expire_s}) must exceed timeout_s ({timeout_s})")
        self._store: Any = store  # torch's Store; None (never used) when world_size == 1
        # Agreements over the same process group share their request numbering, so a
        # new Restorer per request cannot restart at 1 and meet an old request's keys.
        self._ids = _Numbering() if scope is None else _SCOPES.setdefault(scope, _Numbering())
        self._keep_keys = False  # tests only: the control that shows keys would pile up

    @classmethod
    def local(cls) -> Agreement:
        return cls(0, 1)

    @classmethod
    def from_process_group(
        cls, group: ProcessGroup | None = None, timeout_s: float = 30.0, **kw: Any
    ) -> Agreement:
        """Agree among the ranks of `group` (default: the world) through its store."""
        import torch.distributed as dist
        from torch.distributed import distributed_c10d as c10d

        if not dist.is_initialized():
            raise BsrValueError(
                "torch.distributed is not initialised; call init_process_group first"
            )
        rank = dist.get_rank(group)
        world = dist.get_world_size(group)
        name = "world" if group is None else c10d._get_process_group_name(group)
        store = c10d.PrefixStore(f"bsr-io/{name}/", c10d._get_default_store())
        scope = f"{id(c10d._get_default_store())}/{name}"
        return cls(rank, world, store, timeout_s, scope=scope, **kw)

    def request(self, request_id: str | None = None, tag: str = "") -> str:
        """The key namespace of one request, the same on every rank.

        `request_id` is the caller's (a serving engine's request id); the k-th use of
        one id is `req/<id>#<k>/`, so a retried request never reads the decisions of its
        earlier attempt. None numbers the requests in call order (`auto/<n>/<tag>/`);
        `tag` should be a digest of the request's content (the same on every rank), so
        that a rank whose count fell behind (its probe failed before it got here) can
        find its peers on the same request and catch up instead of drifting."""
        self._sweep()
        if request_id is None or request_id == "":
            n = self._ids.next_auto(tag)
            self._publish()
            return f"{_AUTO_PREFIX}{n}/{tag}/"
        return self._ids.named(request_id, self.expire_s)

    def agree_min(self, value: int, request: str | None = None) -> tuple[int, str]:
        """(minimum of `value` over ranks, "") or (0, why) when the ranks did not agree.

        Every rank posts its value; the first rank to see all of them, or to time out,
        writes the decision with compare-and-set and every rank returns what is stored.
        A rank arriving after a timeout adopts that decision, never its own late view."""
        if value < 0:
            raise BsrValueError(f"value must be >= 0, got {value}")
        if self.world_size == 1:
            return value, ""
        request = self._ids.resolve(request or self.request())
        try:
            got, _ = _decide_when_all(
                self, request, "hit/", str(value), lambda vs: str(min(map(int, vs)))
            )
        except Exception as exc:  # noqa: BLE001 - the store's host rank is gone
            # Peers may have decided with this rank's post, but this rank will not vote:
            # their vote cannot commit without it.
            return 0, f"rank agreement failed: {exc}"
        if got.startswith(ABORT):
            return 0, got.split(":", 1)[1]
        return int(got), ""

    def open_vote(self, request: str | None = None) -> Vote:
        """The commit vote of `request` (a namespace from `request()`, or a request id)."""
        if not request:
            request = self.request()
        elif not request.startswith((_NS_PREFIX, _AUTO_PREFIX)):
            request = self.request(request)
        return Vote(self, self._ids.resolve(request))

    def _publish(self) -> None:
        """Tell the peers which unnamed requests this rank began, under which numbers."""
        if self.world_size == 1:
            return
        try:
            self._store.set(f"{_AT}{self.rank}", self._ids.history())
        except Exception:  # noqa: BLE001, S110 - the agreement itself reports the store
            pass

    # -- keys' lifetimes ----------------------------------------------------------------
    def _finished(self, ns: str) -> None:
        """This rank has read the decision under `ns`: the last of the ranks to do so
        deletes the phase's keys; the others note the phase, to expire it if some rank
        never reads it (any of them may survive the others, so each keeps its list)."""
        if self._keep_keys:
            return
        try:
            readers = int(self._store.add(f"{ns}done", 1))
            if readers >= self.world_size:
                _delete(self, ns)
            else:
                self._ids.note_unfinished(ns, time.monotonic() + self.expire_s)
        except Exception:  # noqa: BLE001, S110 - a store that is gone holds no keys
            pass

    def _sweep(self) -> None:
        """Delete the keys of phases some rank never finished, `expire_s` after (one
        check per phase this rank did not finish last; most were deleted meanwhile)."""
        if self.world_size == 1 or self._keep_keys:
            return
        for ns in self._ids.expired(time.monotonic()):
            try:
                if self._store.check([f"{ns}done"]):
                    _delete(self, ns)
            except Exception:  # noqa: BLE001, S110 - retried by nobody; the store is gone
                pass


def _delete(a: Agreement, ns: str) -> None:
    # Posts first, the decision last: a rank that still finds the decision adopts it, and
    # one that finds no posts can only time out (abort), never decide afresh.
    for r in range(a.world_size):
        a._store.delete_key(f"{ns}{r}")
    a._store.delete_key(f"{ns}decision")
    a._store.delete_key(f"{ns}done")


class _Numbering:
    """Request namespaces shared by the Agreements of one process group: the unnamed
    requests' count, each caller id's use count, where an unnamed request moved when
    this rank caught up with its peers, and the phases this rank left for expiry."""

    _MOVED_KEEP = 1 << 12  # namespaces moved recently (open_vote follows them)
    _IDS_MAX = 1 << 20  # caller ids remembered, at most (memory bound)

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._auto = 0
        self._recent: deque[tuple[int, str]] = deque(maxlen=_HISTORY)
        # id -> (uses, time of the last use); kept 2 x expire_s, so an id that returns
        # after being forgotten meets no key of its earlier uses (deleted or expired).
        self._uses: OrderedDict[str, tuple[int, float]] = OrderedDict()
        self._moved: OrderedDict[str, str] = OrderedDict()
        self._unfinished: deque[tuple[float, str]] = deque()

    def next_auto(self, tag: str) -> int:
        with self._lock:
            self._auto += 1
            self._recent.append((self._auto, tag))
            return self._auto

    def history(self) -> str:
        with self._lock:
            return ";".join(f"{n} {t}" for n, t in self._recent)

    def number_of(self, tag: str) -> int | None:
        """The number this rank gave the latest unnamed request with `tag`."""
        with self._lock:
            return next((n for n, t in reversed(self._recent) if t == tag), None)

    def catch_up(self, by: int) -> None:
        """This rank's count was `by` behind its peers': shift it, and the numbers it
        gave its recent requests (so the same gap is not found again)."""
        with self._lock:
            self._auto += by
            self._recent = deque(((m + by, t) for m, t in self._recent), maxlen=_HISTORY)

    def named(self, request_id: str, expire_s: float) -> str:
        now = time.monotonic()
        with self._lock:
            k = self._uses.pop(request_id, (-1, now))[0] + 1
            self._uses[request_id] = (k, now)
            while self._uses:
                oldest = next(iter(self._uses.values()))[1]
                if now - oldest <= 2 * expire_s and len(self._uses) <= self._IDS_MAX:
                    break
                self._uses.popitem(last=False)
        return f"{_NS_PREFIX}{request_id}#{k}/"

    def move(self, old: str, new: str) -> None:
        with self._lock:
            self._moved[old] = new
            while len(self._moved) > self._MOVED_KEEP:
                self._moved.popitem(last=False)

    def resolve(self, ns: str) -> str:
        with self._lock:
            for _ in range(len(self._moved)):
                if ns not in self._moved:
                    break
                ns = self._moved[ns]
            return ns

    def note_unfinished(self, ns: str, due: float) -> None:
        with self._lock:
            self._unfinished.append((due, ns))

    def expired(self, now: float) -> list[str]:
        out = []
        with self._lock:
            while self._unfinished and self._unfinished[0][0] <= now:
                out.append(self._unfinished.popleft()[1])
        return out


_SCOPES: dict[str, _Numbering] = {}


class _Backoff:
    def __init__(self, deadline: float) -> None:
        self.deadline = deadline
        self.delay = _POLL_FIRST_S

    def sleep(self) -> None:
        time.sleep(max(0.0, min(self.delay, self.deadline - time.monotonic())))
        self.delay = min(self.delay * _POLL_GROWTH, _POLL_MAX_S)


def _follow(a: Agreement, request: str) -> str | None:
    """For an unnamed request `auto/<n>/<tag>/` its peers have not joined: whether this
    rank's count fell behind theirs (its probe of an earlier request failed before it
    was numbered). A tag both this rank and a peer numbered recently tells: when the
    peer's number for it is higher by d, this rank moves its count and this request up
    by d and returns the request's new namespace. None when nothing says it is behind.

    Tags must be digests of the requests' content; with no tag nothing is compared."""
    if not request.startswith(_AUTO_PREFIX):
        return None
    n_text, _, tag = request[len(_AUTO_PREFIX) :].rstrip("/").partition("/")
    if not tag:
        return None
    behind = 0
    for r in range(a.world_size):
        if r == a.rank or not a._store.check([f"{_AT}{r}"]):
            continue
        for entry in _text(a._store.get(f"{_AT}{r}")).split(";")[::-1]:
            their_n, _, their_tag = entry.partition(" ")
            mine = a._ids.number_of(their_tag) if their_n else None
            if mine is not None:  # the latest request both numbered decides
                behind = max(behind, int(their_n) - mine)
                break
    if behind <= 0:
        return None
    a._ids.catch_up(behind)
    a._publish()
    return f"{_AUTO_PREFIX}{int(n_text) + behind}/{tag}/"


def _decide_when_all(
    a: Agreement, request: str, phase: str, mine: str, combine: Callable[[list[str]], str]
) -> tuple[str, str]:
    """Post `mine` under `request + phase`, then return (the decision, the request's
    namespace): `combine(values)` once every rank has posted, or an abort on timeout;
    whoever writes first decides for all."""
    store = a._store
    nonce = secrets.token_hex(8)
    ns = request + phase
    store.set(f"{ns}{a.rank}", f"{nonce} {mine}")
    deadline = time.monotonic() + a.timeout_s
    wait = _Backoff(deadline)
    looked = time.monotonic()
    moved_once = False
    while True:
        decision = f"{ns}decision"
        keys = [f"{ns}{r}" for r in range(a.world_size)]
        if store.check([decision]):
            got = _text(store.get(decision))
            break
        if store.check(keys):
            posts = [_text(store.get(k)).split(" ", 1) for k in keys]
            proposal = combine([v for _, v in posts])
            if not proposal.startswith(ABORT):  # an abort holds for everyone, whoever reads
                proposal += " " + ",".join(n for n, _ in posts)
        elif time.monotonic() >= deadline:
            missing = [r for r in range(a.world_size) if not store.check([keys[r]])]
            proposal = f"{ABORT}:timeout waiting for ranks {missing}"
        else:
            if time.monotonic() - looked >= _FOLLOW_EVERY_S:
                looked = time.monotonic()
                moved = _follow(a, request)
                if moved is not None:
                    # Close the namespace left behind first: a peer may have decided
                    # there with this rank's post, and then that decision holds.
                    left = f"{ABORT}:rank {a.rank} moved to {moved}"
                    got = _text(store.compare_set(decision, "", left))
                    if got != left:
                        break
                    a._finished(ns)
                    if not moved_once:  # the peers are busy with the request before:
                        moved_once = True  # give them one more timeout to come here
                        deadline += a.timeout_s
                        wait.deadline = deadline
                    a._ids.move(request, moved)
                    request, ns = moved, moved + phase
                    store.set(f"{ns}{a.rank}", f"{nonce} {mine}")
                    continue
            wait.sleep()
            continue
        if time.monotonic() > deadline + a.timeout_s and not proposal.startswith(ABORT):
            # Stalled between reading the posts and deciding: decide nothing new late.
            proposal = f"{ABORT}:rank {a.rank} decided too late"
        got = _text(store.compare_set(decision, "", proposal))
        break
    a._finished(ns)
    return _adopt(got, nonce, a.rank), request


def _adopt(got: str, nonce: str, rank: int) -> str:
    """The decision's value for this rank: its value when this rank's post is among
    those it was made from, else an abort (the namespace held another request's)."""
    if got.startswith(ABORT):
        return got
    value, _, nonces = got.rpartition(" ")
    if nonce in nonces.split(","):
        return value
    return f"{ABORT}:rank {rank} found a decision made without its post (another request's)"


def _text(value: object) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)


class Vote:
    """One request's commit vote. `aborted()` lets a rank stop early when a peer failed."""

    def __init__(self, agreement: Agreement, request: str) -> None:
        self._a = agreement
        self._request = request
        self._ns = request + "vote/"

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
            except Exception:  # noqa: BLE001, S110 - cast() reports the unreachable store
                pass

    def _decide(self, proposal: str) -> str:
        return _text(self._a._store.compare_set(self._decision_key, "", proposal))

    def cast(self, ok: bool, reason: str = "") -> Decision:
        """Vote, then return the decision every live rank reads back.

        Raises DecisionUnknown when this rank voted to commit but the store failed
        before it could read the decision: the peers may have committed with its vote,
        so a local `zero` could split the ranks. The caller must fail the request on
        every rank (a serving engine: report the load failed; vLLM then recomputes)."""
        if self._a.world_size == 1:
            return Decision(ok, "" if ok else reason)
        if not ok:
            try:
                return self._refuse(reason)
            except Exception as exc:  # noqa: BLE001 - the store's host rank is gone
                # This rank never posted a "1": no peer can have committed.
                return Decision(False, f"rank agreement failed: {exc}")
        try:
            got, _ = _decide_when_all(self._a, self._request, "vote/", "1", _combine_votes)
        except Exception as exc:
            raise DecisionUnknown(
                f"rank {self._a.rank} voted to commit, then lost the store before reading "
                f"the decision: {exc}"
            ) from exc
        return _parse(got)

    def _refuse(self, reason: str) -> Decision:
        a = self._a
        # The post names this rank too: a peer may combine the posts into the decision
        # before this rank's own abort lands, and the reason must say whose it was.
        why = f"rank {a.rank}: {reason}"
        a._store.set(f"{self._ns}{a.rank}", f"{secrets.token_hex(8)} 0:{why}")
        got = self._decide(f"{ABORT}:{why}")
        a._finished(self._ns)
        # Whatever is stored is an abort: a commit needs this rank's "1".
        return _parse(got if got.startswith(ABORT) else f"{ABORT}:{reason}")


def _combine_votes(votes: list[str]) -> str:
    bad = [v[2:] for v in votes if v != "1"]
    return COMMIT if not bad else f"{ABORT}:{bad[0]}"


def _parse(value: str) -> Decision:
    if value == COMMIT:
        return Decision(True, "")
    return Decision(False, value.split(":", 1)[1] if ":" in value else value)
