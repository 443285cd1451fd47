"""The one load path: a prefix's records from their tiers into a destination.

`load_records` is what the `Restorer` and every integration whose host makes the commit
decision itself (vLLM's output aggregator) call; none keeps a read or install loop of
its own. It reports this rank's `complete` or `zero`; committing is the caller's.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from typing import TYPE_CHECKING, Any, Final, Literal

from bsr_io._core import Engine
from bsr_io.engine import register_cuda
from bsr_io.errors import BsrValueError, EngineBusy
from bsr_io.load.discovery import DiscoveryTimedOut, sources_of
from bsr_io.load.kvcache import Destination
from bsr_io.load.window import TAIL_INFLIGHT, InstallReport, Window

if TYPE_CHECKING:
    from bsr_io.model.keys import ChunkKey
    from bsr_io.tiers.base import DirectChunk, Tier

# How a restore ends: every hit chunk committed on every rank, or nothing (the caller
# recomputes the prefix).
Outcome = Literal["complete", "zero"]
COMPLETE: Final = "complete"
ZERO: Final = "zero"


@dataclass
class RestoreResult:
    outcome: Outcome  # zero: no external reuse, the caller recomputes
    committed_tokens: int
    committed_chunks: int
    hit_chunks: int
    source_tiers: list[str] = field(default_factory=list)
    fallbacks: list[dict[str, Any]] = field(default_factory=list)
    reason: str = ""
    rws_peak_bytes: int = 0
    bytes_read: dict[str, int] = field(default_factory=dict)
    timings: dict[str, float] = field(default_factory=dict)
    l1_required_bytes: int | None = None  # whole-plan only: L1 it needs to stage the hit
    failed_chunks: list[int] = field(default_factory=list)  # no tier had a good copy
    timed_out: bool = False  # a read was still in flight at the deadline
    # Chunks whose destination blocks a read given up at its deadline (or left with the
    # kernel by an engine break-down) may still write: the caller must not reuse them.
    unusable_chunks: list[int] = field(default_factory=list)
    # With unusable chunks: whether every read given up into their blocks has ended and
    # left the memory to the caller (never, after an engine break-down with the read in
    # the kernel's hands). Until then those blocks are not the caller's to reuse.
    unusable_returned: Callable[[], bool] | None = field(default=None, repr=False)
    # When each step happened (time.perf_counter stamps: the install's, window.py
    # `InstallReport.marks`, and the restore's "start", "installed", "committed").
    marks: dict[str, float] = field(default_factory=dict, repr=False)

    @property
    def complete(self) -> bool:
        return self.outcome == COMPLETE

    def to_dict(self) -> dict[str, Any]:
        out = asdict(self)
        del out["unusable_returned"]
        return out


def _all_returned(reads: Sequence[DirectChunk]) -> Callable[[], bool]:
    """Whether every one of `reads` (direct reads given up) has left its memory to the
    caller; a plain function, so that copying a result (`asdict`) never copies them."""
    held = list(reads)

    def returned() -> bool:
        held[:] = [r for r in held if not r.returned()]
        return not held

    return returned


def _never() -> bool:
    return False


@dataclass(frozen=True)
class LoadOptions:
    """How one load runs. `deadline` (time.monotonic) bounds every slot wait and read;
    `sizes` are the records' byte lengths when they differ (a hybrid model's groups),
    `chunk_bytes` the largest (default: the largest size, or the engine's slot);
    `width` the slots in flight (default: the engine's W); `should_stop` is polled
    between records; `committed_tokens` is reported on success; `install_threads`
    copy slots into the destination; `keep_going` reads every record even after one
    failed (a caller that withdraws bad records as they are met); `tail_inflight`
    caps the last direct read's bytes in the kernel (window.py; None: no cap)."""

    deadline: float
    sizes: Sequence[int] | None = None
    chunk_bytes: int | None = None
    width: int | None = None
    should_stop: Callable[[], bool] = _never
    committed_tokens: int = 0
    install_threads: int = 1
    keep_going: bool = False
    tail_inflight: int | None = TAIL_INFLIGHT


def windowed_install(
    engine: Engine,
    tiers: Sequence[Tier],
    keys: Sequence[ChunkKey],
    sources: Sequence[int],
    dest: Destination,
    options: LoadOptions,
    chunk_bytes: int,
    width: int,
) -> tuple[InstallReport | None, str]:
    """The windowed, verified install of `keys` from `sources`: (report, error). An
    engine out of slots (back-pressure) is an error, never a bad chunk."""
    device = getattr(dest, "device", None)
    if device is not None and device.type == "cuda":
        # Page-locked slots make each install an asynchronous DMA copy.
        register_cuda(engine)
    engine.reset_peak()
    window = Window(
        engine,
        tiers,
        chunk_bytes,
        width,
        install_threads=options.install_threads,
        tail_inflight=options.tail_inflight,
    )
    try:
        report = window.run(
            keys,
            sources,
            dest,
            should_stop=options.should_stop,
            slot_deadline=options.deadline,
            sizes=options.sizes,
            read_deadline=options.deadline,
            keep_going=options.keep_going,
        )
    except EngineBusy as exc:
        # Back-pressure, not a bad chunk: nothing was invalidated.
        return None, str(exc)
    return report, report.error


def load_result(
    ok: bool,
    report: InstallReport | None,
    reason: str,
    *,
    hit_chunks: int,
    committed_tokens: int,
    engine: Engine,
    timings: dict[str, float],
) -> RestoreResult:
    return RestoreResult(
        outcome=COMPLETE if ok else ZERO,
        committed_tokens=committed_tokens if ok else 0,
        committed_chunks=hit_chunks if ok else 0,
        hit_chunks=hit_chunks,
        source_tiers=report.sources if report else [],
        fallbacks=report.fallbacks if report else [],
        reason="" if ok else reason,
        rws_peak_bytes=engine.peak_bytes(),
        bytes_read=report.bytes_read if report else {},
        timings={
            **timings,
            "read_wait_s": report.read_wait_s if report else 0.0,
            "install_copy_s": report.install_s if report else 0.0,
            # Chunks read straight into the destination (no slot, hashed in place).
            "direct_chunks": float(report.direct) if report else 0.0,
        },
        failed_chunks=report.failed_chunks if report else [],
        timed_out=report.timed_out if report else False,
        unusable_chunks=report.unusable if report else [],
        unusable_returned=_all_returned(report.given_up) if report and report.given_up else None,
        marks=dict(report.marks) if report else {},
    )


def _problems_seen(tiers: Sequence[Tier]) -> list[int]:
    """How many bad records each tier has withdrawn so far (tiers that keep files)."""
    return [len(getattr(t, "problems", ())) for t in tiers]


def _withdrawn(tiers: Sequence[Tier], seen: list[int], key: ChunkKey) -> str:
    """Why discovery just withdrew `key` ("" when it did not): a record whose header
    failed its check is quarantined and then held by no tier, and the load's reason
    must say so, not only that the record is missing."""
    why = [
        f"{t.name}: {p.reason}; record quarantined"
        for t, n in zip(tiers, seen, strict=True)
        for p in list(getattr(t, "problems", ()))[n:]
        if p.key == key
    ]
    return f" ({'; '.join(why)})" if why else ""


def load_records(
    engine: Engine,
    tiers: Sequence[Tier],
    keys: Sequence[ChunkKey],
    dest: Destination,
    options: LoadOptions,
) -> RestoreResult:
    """Load records `keys` into `dest` (record i into `dest`'s index i) through at most
    `width` of `engine`'s slots: metadata-only discovery of each record's tier, then the
    windowed install, verified (fused copy-and-hash where `dest` has `host_runs`), as
    `options` say.

    For a host that makes the commit decision itself (vLLM fails a request on every
    rank when one rank reports it failed): the result is this rank's `complete` or
    `zero`, with why. Chunk failures, timeouts (`options.deadline` bounds slot waits and
    reads) and a destination too small end `zero`; nothing raises for
    them. A closed or broken engine raises."""
    t0 = time.perf_counter()
    n = len(keys)
    sizes, chunk_bytes, width = options.sizes, options.chunk_bytes, options.width
    if sizes is not None and len(sizes) != n:
        raise BsrValueError(f"{len(sizes)} record sizes for {n} keys")
    if chunk_bytes is None:
        chunk_bytes = max(sizes, default=0) if sizes is not None else engine.slot_bytes
    width = engine.window if width is None else width
    timings: dict[str, float] = {}
    seen = _problems_seen(tiers)
    try:
        sources = sources_of(tiers, keys, options.deadline)
        stalled = ""
    except DiscoveryTimedOut as exc:
        sources, stalled = [], str(exc)
    timings["discover_s"] = time.perf_counter() - t0
    report: InstallReport | None = None
    if stalled:
        reason = stalled
    elif len(sources) < n:
        missing = keys[len(sources)]
        reason = f"record {len(sources)} of {n} ({missing.short()}) is in no tier"
        reason += _withdrawn(tiers, seen, missing)
    elif options.should_stop():
        reason = "stopped before the load started"
    else:
        report, reason = windowed_install(
            engine, tiers, keys, sources, dest, options, chunk_bytes, width
        )
        if not reason and report is not None and report.installed < n:
            reason = "stopped before every record was installed"
    timings["total_s"] = time.perf_counter() - t0
    return load_result(
        not reason,
        report,
        reason,
        hit_chunks=n,
        committed_tokens=options.committed_tokens,
        engine=engine,
        timings=timings,
    )
