"""Errors raised by the chunk store, its tiers and the restore.

One root, `BsrError` (defined by the engine module, `bsr_io._core`): the engine's own
errors (`BsrIoError`, also an `OSError` with errno) and every class here derive from
it, so `except BsrError` catches whatever bsr-io raises for a reason of its own.
A bad argument, the engine's or the package's, raises `BsrValueError` or `BsrTypeError`
(also made by the engine): a `BsrError` and the matching built-in, so a caller's
`except ValueError` (or `TypeError`) catches it as well.

A `ChunkError` always names the chunk key, the tier and the underlying cause, so a
restore can report which chunk failed where and fall back (lower tier or recompute)
without parsing messages.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar, Protocol

from bsr_io._core import BsrError
from bsr_io._core import BsrTypeError as BsrTypeError  # re-exported: the package's own
from bsr_io._core import BsrValueError as BsrValueError


class NamedChunk(Protocol):
    """What an error needs of the chunk it names: a short printable name. (A
    `bsr_io.model.keys.ChunkKey` is one; errors sit below the model, so they take it as
    data and never import it.)"""

    def short(self) -> str: ...


def _where(message: str, key: NamedChunk | None, tier: str | None) -> str:
    where = []
    if tier is not None:
        where.append(f"tier {tier}")
    if key is not None:
        where.append(f"chunk {key.short()}")
    return f"{message} ({', '.join(where)})" if where else message


@dataclass(frozen=True, slots=True)
class Unproven:
    """The `record` of a failure that proves nothing about the stored bytes (a timeout,
    an errno such as EIO or ENOMEM, an RPC failure, an unreachable node). Handed to
    `Tier.invalidate`, it withdraws nothing: the record is good until shown bad."""

    record: object | None
    why: str


def proves_bad(record: object | None) -> bool:
    """Whether `invalidate(..., record=record)` may withdraw: anything but `Unproven`."""
    return not isinstance(record, Unproven)


class ChunkError(BsrError):
    """A chunk could not be read from or written to a tier.

    `proven_bad` says whether the error shows the stored record itself is bad (only
    ChunkCorrupt does). For every other class `record` is wrapped in `Unproven`, so the
    window's `tier.invalidate(key, reason, record=exc.record)` after any chunk failure
    withdraws a record only on proof, whatever tier raised it."""

    proven_bad: ClassVar[bool] = False

    def __init__(
        self,
        message: str,
        *,
        key: NamedChunk | None = None,
        tier: str | None = None,
        cause: BaseException | str | None = None,
        record: object | None = None,
    ) -> None:
        self.key = key
        self.tier = tier
        self.cause = cause
        # The exact record that failed (a tier's own identity of it), so invalidation
        # can withdraw that record and never a newer one published at the same place.
        proven = self.proven_bad or isinstance(record, Unproven)
        self.record = record if proven else Unproven(record, type(self).__name__)
        text = _where(message, key, tier)
        if cause is not None:
            text = f"{text}: {cause}"
        super().__init__(text)


class ChunkMissing(ChunkError):
    """The tier does not hold the chunk (never written, evicted, or removed meanwhile)."""


class ChunkCorrupt(ChunkError):
    """The stored record failed verification (checksum, key, layout, length, a torn
    write): the one failure that withdraws it."""

    proven_bad = True


class ChunkReadError(ChunkError):
    """An I/O error, a timeout or a failed call while reading a record that the tier does
    hold: says nothing about the record's bytes, so nothing is withdrawn for it."""


class ChunkWriteError(ChunkError):
    """A record could not be stored (no space, no permission, I/O error).

    Nothing was published: earlier records are untouched.
    """


class TierDown(ChunkError):
    """The whole tier is unavailable (directory gone, unmounted, unreadable, a pool that
    does not answer): a fallback for this restore, never a withdrawn record."""


class DestinationUnusable(BsrError):
    """A read straight into the destination's memory may still write it: it was still
    in flight at its deadline (a stalled device or storage node), or the engine broke
    down while the kernel held it ("destination blocks still owned by the kernel",
    `KernelOwnedError`). Those blocks are not the caller's to reuse or to read another
    copy into; the restore ends `zero` and reports them (`unusable_chunks`). Says
    nothing about the record: nothing is withdrawn for it."""

    def __init__(
        self,
        message: str,
        *,
        key: NamedChunk | None = None,
        tier: str | None = None,
        cause: BaseException | str | None = None,
    ) -> None:
        self.key = key
        self.tier = tier
        text = _where(message, key, tier)
        super().__init__(f"{text}: {cause}" if cause is not None else text)


class KernelOwnedMemory(DestinationUnusable):
    """A load was asked to read into host memory that a read given up earlier may still
    write: the kernel owns that byte range until the read returns (`bsr_io.load.memory`),
    whichever view of the memory (a pool's pages, a per-request cache) asks. Refused
    before anything is read; says nothing about any record (not a bad chunk). `start`
    and `end` are the owned range's addresses."""

    def __init__(self, message: str, *, start: int, end: int) -> None:
        self.start, self.end = start, end
        super().__init__(message)


class CapacityError(BsrValueError):
    """A capacity or staging size too small for one chunk, or otherwise impossible."""


class LayoutError(BsrValueError):
    """A tensor or payload does not match the KV layout (dtype, shape, size)."""


class RecordFormatError(BsrValueError):
    """Bytes that are not a valid record header; the message says which check failed."""


class OldRecordFormat(RecordFormatError):
    """A record of another format version (an older bsr-io's): a miss, never an error,
    and left where it is."""


class DecisionUnknown(BsrError):
    """This rank voted to commit, then lost the agreement's store before it could read
    the decision: the peers may have committed. Fail the request on every rank (in a
    serving engine, report the load failed); never treat it as a local `zero`."""


class EngineBusy(BsrError):
    """No staging slot came free within the restore's timeout.

    Back-pressure from the engine's own state (a shared engine, a slot a caller still
    holds), not a chunk failure: nothing is invalidated, the restore ends `zero`."""


def expect_type(value: object, kind: type | tuple[type, ...], what: str) -> None:
    """BsrTypeError naming the argument `what` unless `value` is a `kind`."""
    if not isinstance(value, kind):
        kinds = kind if isinstance(kind, tuple) else (kind,)
        names = " or ".join("None" if k is type(None) else k.__name__ for k in kinds)
        raise BsrTypeError(f"{what} must be a {names}, got {type(value).__name__}")


def expect_methods(value: object, methods: tuple[str, ...], what: str) -> None:
    """BsrTypeError naming the argument `what` unless `value` has each of `methods` (a
    protocol such as the destination's, which isinstance cannot check)."""
    missing = [m for m in methods if not callable(getattr(value, m, None))]
    if missing:
        raise BsrTypeError(
            f"{what} must have {', '.join(methods)}; a {type(value).__name__} has no "
            f"{', '.join(missing)}"
        )
