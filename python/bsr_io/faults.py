"""Fault injection for tiers: a documented test double.

A `FaultPlan` lists `Fault`s; `FaultPlan.wrap(tier, rank)` puts a `FaultyTier` around a
tier that a fault names. Faults that damage data do it for real where they can (a
"corrupt" fault flips a payload byte in the stored record, a "missing" fault removes
the record just before the read), so the tier's own verification and quarantine run;
"error", "slow", "down" and "group_missing" are simulated at the interface.

Kinds:
  error          the read raises ChunkReadError (EIO, naming the record as a real one
                 would): proves nothing, so the record stays
  corrupt        a payload byte of the stored record is flipped, then the read runs
  clobber        a read straight into the destination's memory lands, then a byte of it
                 is flipped there (the memory's owner writing the blocks): the stored
                 record is fine, and a read through a slot gets it intact
  missing        the record is removed just before the read (probe said present)
  slow           the read sleeps `delay_s` first
  down           the tier raises TierDown: on everything when `chunks` is None, else
                 on reads of those chunks (the tier dies mid-restore)
  group_missing  probe(keys, group=g) for g in `groups` stops at the chunk
  hang           the read is not done for `delay_s` (a stalled device or mount)
  hang_probe     asking whether the tier holds the chunk (discovery's stat or header
                 read) takes `delay_s` (a hung drive or mount under a metadata call)

Every way a tier is read is wrapped: reads into a slot (`submit_read`) and reads
straight into the destination's memory (`submit_read_into`, O_DIRECT into a host
cache's blocks or a pool's scatter read), where the wrapped tier has it.

`chunks` are positions in the request (chunk index 0, 1, ...). A FaultyTier learns
them only through the public Tier interface (`prepare_probe(keys)`, which discovery
calls with the request's keys, or a probe of more than one key) or from the caller
(`wrap(..., keys=)`, `bind(tiers, keys)`); nothing in the core knows about faults.
A key it cannot place matches only faults with `chunks=None`. `ranks` limits a fault
to some ranks, `times` to its first n firings.

Plans travel to other processes as JSON, e.g. in the environment:
    BSR_IO_FAULTS='[{"kind": "error", "tier": "L2", "chunks": [3], "ranks": [1]}]'
(or BSR_IO_FAULTS=@plan.json).
"""

from __future__ import annotations

import errno
import json
import os
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

from bsr_io._core import Engine, Slot
from bsr_io.errors import BsrTypeError, BsrValueError, ChunkMissing, ChunkReadError, TierDown
from bsr_io.model.keys import ChunkKey
from bsr_io.model.layout import KVLayout
from bsr_io.model.record import HEADER_BYTES
from bsr_io.tiers.base import DirectChunk, Payload, PendingChunk, Tier
from bsr_io.tiers.files import FileTier, RecordId
from bsr_io.tiers.memory import MemoryTier

T = TypeVar("T")
KINDS = (
    "error",
    "corrupt",
    "missing",
    "slow",
    "down",
    "group_missing",
    "hang",
    "clobber",
    "hang_probe",
)
ENV = "BSR_IO_FAULTS"


def _set(values: Iterable[Any] | None, kind: type) -> frozenset[Any] | None:
    if values is None:
        return None
    if isinstance(values, (str, bytes, int)):
        values = [values]
    return frozenset(kind(v) for v in values)


@dataclass(frozen=True)
class Fault:
    kind: str
    tier: str = "L2"
    chunks: frozenset[int] | None = None
    groups: frozenset[str] | None = None
    ranks: frozenset[int] | None = None
    delay_s: float = 0.0
    times: int | None = None

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise BsrValueError(f"unknown fault kind {self.kind!r}; choose one of {list(KINDS)}")
        object.__setattr__(self, "chunks", _set(self.chunks, int))
        object.__setattr__(self, "groups", _set(self.groups, str))
        object.__setattr__(self, "ranks", _set(self.ranks, int))
        if self.kind == "group_missing" and not self.groups:
            raise BsrValueError("a group_missing fault needs `groups`")
        if self.delay_s < 0 or (self.times is not None and self.times < 1):
            raise BsrValueError("delay_s must be >= 0 and times >= 1")

    def to_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {"kind": self.kind, "tier": self.tier}
        for name in ("chunks", "groups", "ranks"):
            v = getattr(self, name)
            if v is not None:
                out[name] = sorted(v)
        if self.delay_s:
            out["delay_s"] = self.delay_s
        if self.times is not None:
            out["times"] = self.times
        return out


@dataclass
class FaultPlan:
    faults: list[Fault] = field(default_factory=list)

    @classmethod
    def from_json(cls, text: str) -> FaultPlan:
        doc = json.loads(text)
        if isinstance(doc, dict):
            doc = doc.get("faults", [])
        if not isinstance(doc, list) or not all(isinstance(f, dict) for f in doc):
            raise BsrValueError("a fault plan is a JSON list of objects (or {'faults': [...]})")
        try:
            return cls([Fault(**f) for f in doc])
        except TypeError as exc:
            raise BsrValueError(f"bad fault in plan: {exc}") from None

    def to_json(self) -> str:
        return json.dumps([f.to_dict() for f in self.faults])

    @classmethod
    def from_env(cls, var: str = ENV) -> FaultPlan:
        text = os.environ.get(var, "").strip()
        if not text:
            return cls()
        if text.startswith("@"):
            text = Path(text[1:]).read_text()
        return cls.from_json(text)

    def for_tier(self, name: str, rank: int) -> list[Fault]:
        return [f for f in self.faults if f.tier == name and (f.ranks is None or rank in f.ranks)]

    def wrap(self, tier: Tier, rank: int = 0, keys: Sequence[ChunkKey] | None = None) -> Tier:
        """`tier` inside a FaultyTier when a fault of this rank names it, else `tier`.

        `keys`: the request's chunk keys, so that `chunks=` positions mean the request's.
        """
        faults = self.for_tier(tier.name, rank)
        if not faults:
            return tier
        faulty = FaultyTier(tier, faults, rank)
        if keys is not None:
            faulty.bind(keys)
        return faulty

    def wrap_all(
        self, tiers: Sequence[Tier], rank: int = 0, keys: Sequence[ChunkKey] | None = None
    ) -> list[Tier]:
        return [self.wrap(t, rank, keys) for t in tiers]


def bind(tiers: Iterable[Tier], keys: Sequence[ChunkKey]) -> None:
    """Tell every FaultyTier among `tiers` the request's chunk keys (see module doc)."""
    for t in tiers:
        if isinstance(t, FaultyTier):
            t.bind(keys)


def _record_of(tier: Tier, key: ChunkKey) -> object | None:
    """The identity a file tier's own read error would carry for `key`'s record."""
    if not isinstance(tier, FileTier):
        return None
    try:
        return RecordId.of(os.stat(tier.path_of(key)))
    except OSError:
        return None


def _flip_payload_byte(tier: Tier, key: ChunkKey) -> None:
    if isinstance(tier, FileTier):
        path = tier.path_of(key)
        fd = os.open(path, os.O_RDWR)
        try:
            size = os.fstat(fd).st_size
            pos = HEADER_BYTES + max(0, size - HEADER_BYTES) // 2
            (b,) = os.pread(fd, 1, pos) or b"\0"
            os.pwrite(fd, bytes([b ^ 0x5A]), pos)
        finally:
            os.close(fd)
    elif isinstance(tier, MemoryTier):
        with tier._lock:
            entry = tier._entries.get(key)
            if entry is not None:
                entry.data[len(entry.data) // 2] ^= 0x5A
    else:
        raise BsrTypeError(f"cannot corrupt records of {type(tier).__name__}")


def _stalled(
    until: float, hang_s: float, wait: Callable[[float | None], T]
) -> Callable[[float | None], T]:
    """A read's `wait(timeout)` that is not done before `until`: a timeout shorter than
    what is left raises TimeoutError (the read stays pending, as the engine's own waits
    do); otherwise it sleeps out the hang and waits for the real read."""

    def finish(timeout: float | None) -> T:
        left = until - time.monotonic()
        if timeout is not None and timeout < left:
            time.sleep(max(0.0, timeout))
            raise TimeoutError(f"injected fault: read hung ({hang_s} s)")
        time.sleep(max(0.0, left))
        return wait(None if timeout is None else max(0.0, timeout - max(0.0, left)))

    return finish


def _clobbered(inner: DirectChunk, bufs: Sequence[Any], runs: Sequence[Any]) -> DirectChunk:
    """`inner`, whose bytes are changed where they landed once it ends: a payload byte in
    the middle of its first run is flipped in the destination's memory."""
    buf, at, _, length = runs[0]

    def finish(timeout: float | None) -> None:
        inner.wait(timeout)
        outer.expected_xxh3 = inner.expected_xxh3  # a pool's is final only now
        bufs[buf][at + length // 2] ^= 0x5A

    outer = DirectChunk(
        inner.key,
        finish,
        inner.done,
        expected_xxh3=inner.expected_xxh3,
        reject=inner.reject,
        abandon=inner.abandon,
        returned=inner.returned,
    )
    return outer


def _hung_direct(inner: DirectChunk, hang_s: float) -> DirectChunk:
    """`inner`, a read into the destination's memory, not done for `hang_s` seconds."""
    until = time.monotonic() + hang_s
    return DirectChunk(
        inner.key,
        _stalled(until, hang_s, inner.wait),
        lambda: time.monotonic() >= until and inner.done(),
        expected_xxh3=inner.expected_xxh3,
        reject=inner.reject,
        returned=lambda: time.monotonic() >= until and inner.returned(),
    )


def _hung(inner: PendingChunk, hang_s: float) -> PendingChunk:
    """`inner` (its slot already taken, as a stuck read's is) not done for `hang_s`
    seconds: a stalled device or mount."""
    until = time.monotonic() + hang_s
    deferred = inner.expected_xxh3 is not None
    return PendingChunk(
        inner.key,
        _stalled(until, hang_s, inner.wait),
        lambda: time.monotonic() >= until and inner.done(),
        expected_xxh3=inner.expected_xxh3,
        reject=inner.reject if deferred else None,
    )


class FaultyTier(Tier):
    """Wraps a tier and injects the given faults (a test double; see module doc)."""

    def __init__(self, inner: Tier, faults: Sequence[Fault], rank: int = 0) -> None:
        super().__init__(inner.name)
        self.inner = inner
        self.faults = list(faults)
        self.rank = rank
        self._fired = [0] * len(self.faults)
        self._index: dict[ChunkKey, int] = {}
        self.injected: list[tuple[str, int | None]] = []  # (kind, chunk index) per firing
        self._damaged: set[ChunkKey] = set()  # records a corrupt fault flipped, until rewritten
        if hasattr(inner, "submit_read_into"):
            # Only where the wrapped tier reads in place: the window asks with getattr.
            self.submit_read_into = self._submit_read_into

    @property
    def per_group(self) -> bool:  # type: ignore[override]
        # A missing group is injected group by group: discovery must ask for each.
        return self.inner.per_group or any(f.kind == "group_missing" for f in self.faults)

    def bind(self, keys: Sequence[ChunkKey]) -> None:
        """Learn the request's chunk positions."""
        self._index = {k: i for i, k in enumerate(keys)}

    def _firing(self, kind: str, key: ChunkKey | None, group: str | None = None) -> Fault | None:
        idx = self._index.get(key) if key is not None else None
        for n, f in enumerate(self.faults):
            if f.kind != kind or (f.times is not None and self._fired[n] >= f.times):
                continue
            if f.chunks is not None and (idx is None or idx not in f.chunks):
                continue
            if f.groups is not None and kind == "group_missing" and group not in f.groups:
                continue
            self._fired[n] += 1
            self.injected.append((kind, idx))
            return f
        return None

    def _down_everywhere(self) -> bool:
        return any(f.kind == "down" and f.chunks is None for f in self.faults) and bool(
            self._firing("down", None)
        )

    def _check_up(self, key: ChunkKey | None = None) -> None:
        if self._down_everywhere():
            raise TierDown("injected fault: tier down", key=key, tier=self.name)

    def prepare_probe(self, keys: Sequence[ChunkKey]) -> None:
        self.bind(keys)
        self.inner.prepare_probe(keys)

    def probe(self, keys: Sequence[ChunkKey], group: str | None = None) -> int:
        if len(keys) > 1:
            self.bind(keys)
        return super().probe(keys, group)

    def contains(self, key: ChunkKey, group: str | None = None) -> bool:
        self._check_up(key)
        if f := self._firing("hang_probe", key):
            time.sleep(f.delay_s)
        if group is not None and self._firing("group_missing", key, group):
            return False
        return self.inner.contains(key, group)

    @property
    def defers_verify(self) -> bool:  # type: ignore[override]
        # As the wrapped tier: a corrupted payload then reaches the fused install's check.
        return self.inner.defers_verify

    def _before_read(self, key: ChunkKey) -> Fault | None:
        """The faults every read path injects before reading; the "hang" fault, if one
        fires, for the caller to wrap its read in."""
        self._check_up(key)
        if self._firing("down", key):
            raise TierDown("injected fault: tier went down mid-restore", key=key, tier=self.name)
        if f := self._firing("slow", key):
            time.sleep(f.delay_s)
        if hang := self._firing("hang", key):
            return hang  # a stalled read: nothing else happens to it
        if self._firing("error", key):
            # As a real EIO mid-read would: naming the record file it failed on.
            raise ChunkReadError(
                "injected fault: I/O error",
                key=key,
                tier=self.name,
                cause=OSError(errno.EIO, os.strerror(errno.EIO)),
                record=_record_of(self.inner, key),
            )
        if self._firing("missing", key):
            self.inner.remove(key)
            raise ChunkMissing("injected fault: record vanished", key=key, tier=self.name)
        if self._firing("corrupt", key) and key not in self._damaged:
            # Once: a second flip of the same byte would mend the record.
            _flip_payload_byte(self.inner, key)  # the reader's checks must catch it
            self._damaged.add(key)
        return None

    def _submit_read_into(
        self,
        key: ChunkKey,
        engine: Engine | None,
        bufs: Sequence[Any],
        runs: Sequence[Any],
        *,
        inflight: int | None = None,
    ) -> DirectChunk:
        hang = self._before_read(key)
        direct: DirectChunk = self.inner.submit_read_into(  # type: ignore[attr-defined]
            key, engine, bufs, runs, inflight=inflight
        )
        if self._firing("clobber", key):
            direct = _clobbered(direct, bufs, runs)
        return direct if hang is None else _hung_direct(direct, hang.delay_s)

    def submit_read(self, key: ChunkKey, engine: Engine, *, verify: bool = True) -> PendingChunk:
        hang = self._before_read(key)
        # `verify` is passed on only when the wrapped tier defers the check (as window.py).
        kw = {} if verify else {"verify": False}
        pending = self.inner.submit_read(key, engine, **kw)
        return pending if hang is None else _hung(pending, hang.delay_s)

    def read_into(self, key: ChunkKey, engine: Engine) -> Slot:
        return self.submit_read(key, engine).wait()

    def write(self, key: ChunkKey, payload: Payload, layout: KVLayout) -> bool:
        self._check_up(key)
        self._damaged.discard(key)
        return self.inner.write(key, payload, layout)

    def remove(self, key: ChunkKey) -> bool:
        return self.inner.remove(key)

    def invalidate(self, key: ChunkKey, reason: str, *, record: object | None = None) -> None:
        self._check_up(key)
        if record is None:
            self.inner.invalidate(key, reason)
        else:
            self.inner.invalidate(key, reason, record=record)

    def keys(self) -> list[ChunkKey]:
        return self.inner.keys()

    def stats(self) -> dict[str, Any]:
        out = self.inner.stats()
        out["injected"] = len(self.injected)
        return out

    def close(self) -> None:
        self.inner.close()

    def __getattr__(self, name: str) -> Any:
        # Anything else (path_of, root, capacity_bytes...) is the inner tier's.
        return getattr(self.inner, name)
