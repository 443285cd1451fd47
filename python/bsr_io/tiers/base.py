"""The tier interface shared by L1 (memory), L2 (local SSD), L3 (lower tier) and the Store.

Reads land in an engine staging slot and are verified (key, lengths, payload checksum)
before the slot is handed out; a failed check quarantines the record so discovery never
advertises it again. Probing reads metadata only.
"""

from __future__ import annotations

import sys
import threading
import time
from abc import ABC, abstractmethod
from collections.abc import Callable, Sequence
from contextvars import ContextVar, Token
from typing import Any

from bsr_io._core import Engine, EngineBrokenError, EngineClosedError, NoFreeSlot, Slot
from bsr_io.errors import CapacityError, LayoutError
from bsr_io.model.keys import ChunkKey
from bsr_io.model.layout import KVLayout

Payload = Any  # Slot | torch.Tensor (uint8, CPU) | any contiguous buffer of chunk_bytes

# The caller's engine state, not the tier's: passed through unchanged, never turned into
# a ChunkError (a full ring is back-pressure, not a failed chunk; a broken engine
# failed every read it had, good records included).
ENGINE_ERRORS = (NoFreeSlot, EngineClosedError, EngineBrokenError)

# The deadline (time.monotonic) of the reads this thread starts: set by the window for
# its run, so that a tier's own waits while starting a read (a record's header) end
# with the run's, without a deadline argument through every tier and wrapper.
_READ_DEADLINE: ContextVar[float | None] = ContextVar("bsr_io_read_deadline", default=None)
READ_TIMEOUT_S = 30.0  # without a run: the window's default deadline


def read_deadline() -> float:
    """When the reads started now must have ended: the running window's deadline, else
    READ_TIMEOUT_S from now."""
    deadline = _READ_DEADLINE.get()
    return time.monotonic() + READ_TIMEOUT_S if deadline is None else deadline


def reads_by(deadline: float) -> Token[float | None]:
    """Set this thread's read deadline until `reads_end(token)`."""
    return _READ_DEADLINE.set(deadline)


def reads_end(token: Token[float | None]) -> None:
    _READ_DEADLINE.reset(token)


class PendingChunk:
    """A chunk read that may still be in flight; `wait()` returns the verified slot.

    `wait` raises a ChunkError subclass if the read or its verification failed, and
    TimeoutError (the read stays in flight, call wait again) if `timeout` passes first.

    A read submitted with `verify=False` (tiers with `defers_verify`) returns the slot
    unchecked: `expected_xxh3` is the record header's payload hash, which the caller
    must compare (install.py hashes while it copies), and `reject(reason)` quarantines
    the record and returns the `ChunkCorrupt` to raise when it differs.

    `withdraw()`: give the read up unused while it is still queued in the engine (True:
    its slot is back in the ring; False, the default: it goes on).
    """

    def __init__(
        self,
        key: ChunkKey,
        finish: Callable[[float | None], Slot],
        done: Callable[[], bool] = lambda: True,
        *,
        expected_xxh3: int | None = None,
        reject: Callable[[str], Exception] | None = None,
        withdraw: Callable[[], bool] | None = None,
    ) -> None:
        self.key = key
        self._finish = finish
        self._done = done
        self._slot: Slot | None = None
        self.expected_xxh3 = expected_xxh3
        self._reject = reject
        self._withdraw = withdraw

    def withdraw(self) -> bool:
        """Give the read up unused if it never reached the kernel (see the class doc)."""
        return self._slot is None and self._withdraw is not None and self._withdraw()

    def reject(self, reason: str) -> Exception:
        """The payload failed the caller's check: withdraw the record, get the error."""
        if self._reject is None:
            raise RuntimeError("this read was verified by its tier; nothing to reject")
        return self._reject(reason)

    @classmethod
    def ready(cls, key: ChunkKey, slot: Slot) -> PendingChunk:
        return cls(key, lambda _t: slot)

    def done(self) -> bool:
        return self._slot is not None or self._done()

    def wait(self, timeout: float | None = None) -> Slot:
        if self._slot is None:
            self._slot = self._finish(timeout)
            self._finish = _spent
        return self._slot


class DirectUnavailable(Exception):
    """This chunk cannot be read straight into the destination here (the tier, or the
    drive holding it, reads only through slots): read it through a slot."""


class DirectChunk:
    """A chunk read straight into the destination's memory (no slot): `wait()` returns
    once the bytes are in place, unverified; the caller hashes them where they are
    (`xxh3_runs`) against `expected_xxh3` and calls `reject(reason)` on a mismatch.
    `expected_xxh3` is final once `wait()` returned (a pool's header arrives with the
    payload, so its tier sets it then).
    Raises ChunkError subclasses like `PendingChunk.wait`, TimeoutError meanwhile, and
    DestinationUnusable when the read may go on writing the memory after it returned
    (past its tier's deadline, or with the kernel after an engine break-down).

    `abandon()` gives the read up at the caller's deadline: True when it never started
    (the memory is untouched and the caller's again), False when it may still write
    (the caller must report those blocks unusable). By default a read once submitted
    counts as started.

    `returned()`: whether the memory is the caller's again. A read the kernel or a pool
    still holds is not; nor is one an engine break-down left in the kernel's hands (its
    memory is never given back). By default, `done()`.

    `wait_hashed()`, where the tier gives `hashed`: `wait()` that hashes the bytes as
    they land (`DirectRead.wait_xxh3`), returning (their xxh3, when the read ended on the
    `time.perf_counter` clock); None where it cannot (then `wait()` and hash in place)."""

    def __init__(
        self,
        key: ChunkKey,
        finish: Callable[[float | None], None],
        done: Callable[[], bool],
        *,
        expected_xxh3: int,
        reject: Callable[[str], Exception],
        abandon: Callable[[], bool] | None = None,
        returned: Callable[[], bool] | None = None,
        hashed: Callable[[float | None], tuple[int, float]] | None = None,
    ) -> None:
        self.key = key
        self._finish = finish
        self._hashed = hashed
        self._done = done
        self._returned = returned
        self._ended = False
        self.expected_xxh3 = expected_xxh3
        self.reject = reject
        self._abandon = abandon

    def done(self) -> bool:
        return self._ended or self._done()

    def returned(self) -> bool:
        """Whether the read's memory is the caller's again (see the class doc)."""
        return self._returned() if self._returned is not None else self.done()

    def abandon(self) -> bool:
        """Give the read up: whether it never started (see the class doc)."""
        return self._abandon() if self._abandon is not None else False

    def wait(self, timeout: float | None = None) -> None:
        if not self._ended:
            self._finish(timeout)
            self._ended = True

    def wait_hashed(self, timeout: float | None = None) -> tuple[int, float] | None:
        if self._hashed is None or self._ended:
            return None
        got = self._hashed(timeout)
        self._ended = True
        return got


def _spent(_timeout: float | None) -> Slot:
    raise RuntimeError("unreachable: PendingChunk already finished")


class Tier(ABC):
    """One place chunk records live."""

    name: str
    # Whether `submit_read(..., verify=False)` is supported: the payload check is then
    # left to the caller (see PendingChunk), which can fuse it with the install copy.
    defers_verify: bool = False
    # Whether `contains(key, group)` can differ between groups of one record. False for
    # tiers that keep a chunk's groups in one record: discovery asks them once per chunk.
    per_group: bool = False

    def __init__(self, name: str) -> None:
        self.name = name
        self._lock = threading.RLock()
        self._counts = dict(
            hits=0,
            misses=0,
            evictions=0,
            quarantined=0,
            reads=0,
            writes=0,
            bytes_read=0,
            bytes_written=0,
        )

    # -- discovery (metadata only) ------------------------------------------------------
    @abstractmethod
    def contains(self, key: ChunkKey, group: str | None = None) -> bool:
        """Whether the tier holds `key` (every group when `group` is None)."""

    def probe(self, keys: Sequence[ChunkKey], group: str | None = None) -> int:
        """How many leading `keys` the tier holds; reads no payload."""
        n = 0
        for key in keys:
            if not self.contains(key, group):
                self._count(misses=1)
                break
            n += 1
        return n

    def prepare_probe(self, keys: Sequence[ChunkKey]) -> None:  # noqa: B027 - optional
        """A request with these keys (in order) is about to be probed key by key. A tier
        that answers many keys in one call (a remote pool) asks now; by default, nothing."""

    # -- data ---------------------------------------------------------------------------
    @abstractmethod
    def submit_read(self, key: ChunkKey, engine: Engine) -> PendingChunk:
        """Start reading `key`'s payload into a free slot of `engine`."""

    def read_into(self, key: ChunkKey, engine: Engine) -> Slot:
        """The payload of `key` at offset 0 of an engine slot, verified."""
        return self.submit_read(key, engine).wait()

    @abstractmethod
    def write(self, key: ChunkKey, payload: Payload, layout: KVLayout) -> bool:
        """Store `payload` (exactly `layout.chunk_bytes`) as `key`, atomically.

        Returns False when the tier already held `key` (nothing written)."""

    @abstractmethod
    def remove(self, key: ChunkKey) -> bool:
        """Delete `key`'s record; False if there was none."""

    @abstractmethod
    def invalidate(self, key: ChunkKey, reason: str, *, record: object | None = None) -> None:
        """Withdraw `key` (quarantine it where the tier keeps files): never advertised again.

        `record` is the failing read's `ChunkError.record` when it has one: the tier then
        withdraws exactly that record, never a newer one stored under `key` since."""

    @abstractmethod
    def keys(self) -> list[ChunkKey]:
        """Every key the tier currently advertises (LRU order, oldest first)."""

    @abstractmethod
    def stats(self) -> dict[str, Any]:
        """records, bytes, capacity, hits, misses, evictions, quarantined, and I/O counts."""

    def _count(self, **deltas: int) -> None:
        with self._lock:
            for k, v in deltas.items():
                self._counts[k] += v

    def _stats(self, records: int, nbytes: int, capacity: int | None) -> dict[str, Any]:
        with self._lock:
            return dict(
                name=self.name, records=records, bytes=nbytes, capacity=capacity, **self._counts
            )

    def close(self) -> None:  # noqa: B027 - tiers without resources need not override
        """Release resources (open files, caches). The records stay."""


def read_waiting(tier: Tier, key: ChunkKey, engine: Engine, deadline: float) -> Slot:
    """`tier.read_into`, waiting for a free slot while the ring is full: a full ring is
    back-pressure, never a failed chunk (EngineBusy at `deadline`, time.monotonic)."""
    from bsr_io.engine import wait_for_slot

    while True:
        try:
            return tier.read_into(key, engine)
        except NoFreeSlot:
            pass
        wait_for_slot(engine, deadline)


def payload_view(payload: Payload, layout: KVLayout) -> memoryview:
    """A flat byte view of `payload`, checked to be exactly one chunk of `layout`."""
    want = layout.chunk_bytes
    # A tensor exists only once torch is loaded; asking sys.modules keeps this module
    # (and the commands that read a store without writing it) from loading torch.
    torch = sys.modules.get("torch")
    if torch is not None and isinstance(payload, torch.Tensor):
        if payload.dtype != torch.uint8:
            raise LayoutError(
                f"payload tensor must be uint8 chunk bytes, got dtype "
                f"{str(payload.dtype).removeprefix('torch.')} (use tensor.view(torch.uint8))"
            )
        if payload.device.type != "cpu":
            payload = payload.cpu()  # a device tensor is copied once to host memory
        if not payload.is_contiguous():
            raise LayoutError("payload tensor must be contiguous")
        view = memoryview(payload.numpy()).cast("B")
    else:
        try:
            view = memoryview(payload)
        except TypeError:
            raise LayoutError(
                f"payload must be a Slot, a uint8 tensor or a buffer, got {type(payload).__name__}"
            ) from None
        if not view.c_contiguous:
            raise LayoutError("payload buffer must be C-contiguous")
        view = view.cast("B") if view.format != "B" or view.ndim != 1 else view
    if view.nbytes != want:
        raise LayoutError(
            f"payload is {view.nbytes} bytes, a chunk of layout {layout.name} is {want} bytes"
        )
    return view


def check_payload(payload: Payload, layout: KVLayout) -> None:
    """LayoutError unless `payload` is exactly one chunk of `layout`."""
    if isinstance(payload, Slot):
        if len(payload) != layout.chunk_bytes:
            raise LayoutError(
                f"slot holds {len(payload)} bytes, a chunk of layout {layout.name} is "
                f"{layout.chunk_bytes} (call slot.set_length after filling it)"
            )
    else:
        payload_view(payload, layout).release()


def check_capacity(tier: str, capacity_bytes: int | None, record_bytes: int | None) -> None:
    """CapacityError unless `capacity_bytes` can hold at least one record."""
    if capacity_bytes is None:
        return
    if not isinstance(capacity_bytes, int) or capacity_bytes < 1:
        raise CapacityError(f"{tier}: capacity must be a positive number of bytes")
    if record_bytes is not None and capacity_bytes < record_bytes:
        raise CapacityError(
            f"{tier}: capacity {capacity_bytes} bytes cannot hold one chunk record "
            f"({record_bytes} bytes)"
        )


def check_slot_fits(tier: str, engine: Engine, key: ChunkKey, nbytes: int) -> None:
    if nbytes > engine.slot_bytes:
        raise CapacityError(
            f"{tier}: chunk {key.short()} is {nbytes} bytes but the engine's slots are "
            f"{engine.slot_bytes} bytes; build the Engine with slot_bytes >= layout.chunk_bytes"
        )
