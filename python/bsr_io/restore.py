"""Bounded-State Restoration: probe, windowed install, request-level commit.

A `Restorer` belongs to one rank. `probe` finds the reusable prefix from
metadata and agrees on it with the other ranks (minimum over groups and ranks);
`restore` streams it through W staging slots into the destination and then
votes; the prefix is committed on every rank or on none. `save` stores a
prefix through the same bounded staging.

`load_records` and `save_records` are the one load and save path under all of it:
the Restorer, and every integration whose host makes the commit decision itself
(vLLM's output aggregator), call them; none keeps a read, install or write loop
of its own.
"""

from __future__ import annotations

import time
import traceback
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, field
from typing import TYPE_CHECKING, Any, Final, Literal

from bsr_io._core import Engine, Slot
from bsr_io.commit import Agreement
from bsr_io.discovery import Plan, discover, sources_of
from bsr_io.engine import as_tensor, give_back, lease, register_cuda
from bsr_io.errors import EngineBusy, LayoutError
from bsr_io.keys import chunk_keys
from bsr_io.kvcache import Destination
from bsr_io.layout import KVLayout
from bsr_io.window import InstallReport, Window

if TYPE_CHECKING:
    from torch.distributed import ProcessGroup

    from bsr_io.commit import Vote
    from bsr_io.keys import ChunkKey
    from bsr_io.store import Store
    from bsr_io.tiers.base import Tier

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

    @property
    def complete(self) -> bool:
        return self.outcome == COMPLETE

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def _content_tag(keys: Sequence[ChunkKey]) -> str:
    # Rank-independent digest of the request's whole content (the last chunk's hash
    # chains over the prefix): the agreement matches unnamed requests across ranks by it,
    # and requests that share only a system prompt must not match.
    return f"{keys[-1].chunk_hash:032x}" if keys else "empty"


def _layout_mismatch(layout: KVLayout, dest: object) -> str:
    """Why `dest` cannot take chunks of `layout` ("" when it can, or cannot tell)."""
    theirs = getattr(dest, "layout", None)
    if theirs is None or not hasattr(theirs, "fingerprint"):
        return ""
    if theirs.fingerprint() == layout.fingerprint():
        return ""
    return (
        f"destination is laid out as {theirs.name!r} ({theirs.fingerprint()}), the restorer's "
        f"chunks as {layout.name!r} ({layout.fingerprint()}); installing would scramble the "
        "groups' bytes. Build the destination from the restorer's layout."
    )


def _extract(dest: Destination, index: int, slot: Slot, nbytes: int) -> None:
    """`dest.extract` into `slot`. If it raises, its frames (which hold a view of the
    slot) are dropped from the traceback, their text kept as a note: a caller keeping
    the exception must not keep the view, or the slot could not be released."""
    try:
        dest.extract(index, as_tensor(slot, length=nbytes))
    except BaseException as exc:
        exc.add_note("extract failed at:\n" + "".join(traceback.format_tb(exc.__traceback__)))
        raise exc.with_traceback(None) from None


def _windowed(
    engine: Engine,
    tiers: Sequence[Tier],
    keys: Sequence[ChunkKey],
    sources: Sequence[int],
    dest: Destination,
    *,
    chunk_bytes: int,
    sizes: Sequence[int] | None,
    width: int,
    deadline: float,
    should_stop: Callable[[], bool],
    install_threads: int,
    keep_going: bool = False,
) -> tuple[InstallReport | None, str]:
    """The windowed, verified install of `keys` from `sources`: (report, error)."""
    device = getattr(dest, "device", None)
    if device is not None and device.type == "cuda":
        # Page-locked slots make each install an asynchronous DMA copy.
        register_cuda(engine)
    engine.reset_peak()
    window = Window(engine, tiers, chunk_bytes, width, install_threads=install_threads)
    try:
        report = window.run(
            keys, sources, dest, should_stop=should_stop, slot_deadline=deadline,
            sizes=sizes, read_deadline=deadline, keep_going=keep_going,
        )  # fmt: skip
    except EngineBusy as exc:
        # Back-pressure, not a bad chunk: nothing was invalidated.
        return None, str(exc)
    return report, report.error


def _result(
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
    )


def load_records(
    engine: Engine,
    tiers: Sequence[Tier],
    keys: Sequence[ChunkKey],
    dest: Destination,
    *,
    deadline: float,
    sizes: Sequence[int] | None = None,
    chunk_bytes: int | None = None,
    width: int | None = None,
    should_stop: Callable[[], bool] = lambda: False,
    committed_tokens: int = 0,
    install_threads: int = 1,
    keep_going: bool = False,
) -> RestoreResult:
    """Load records `keys` into `dest` (record i into `dest`'s index i) through at most
    `width` of `engine`'s slots: metadata-only discovery of each record's tier, then the
    windowed install, verified (fused copy-and-hash where `dest` has `host_runs`).

    For a host that makes the commit decision itself (vLLM fails a request on every
    rank when one rank reports it failed): the result is this rank's `complete` or
    `zero`, with why. Chunk failures, timeouts (`deadline`, time.monotonic, bounds
    slot waits and reads) and a destination too small end `zero`; nothing raises for
    them. A closed or broken engine raises."""
    t0 = time.perf_counter()
    n = len(keys)
    if sizes is not None and len(sizes) != n:
        raise ValueError(f"{len(sizes)} record sizes for {n} keys")
    if chunk_bytes is None:
        chunk_bytes = max(sizes, default=0) if sizes is not None else engine.slot_bytes
    width = engine.window if width is None else width
    timings: dict[str, float] = {}
    sources = sources_of(tiers, keys)
    timings["discover_s"] = time.perf_counter() - t0
    report: InstallReport | None = None
    if len(sources) < n:
        reason = f"record {len(sources)} of {n} ({keys[len(sources)].short()}) is in no tier"
    elif should_stop():
        reason = "stopped before the load started"
    else:
        report, reason = _windowed(
            engine, tiers, keys, sources, dest, chunk_bytes=chunk_bytes, sizes=sizes,
            width=width, deadline=deadline, should_stop=should_stop,
            install_threads=install_threads, keep_going=keep_going,
        )  # fmt: skip
        if not reason and report is not None and report.installed < n:
            reason = "stopped before every record was installed"
    timings["total_s"] = time.perf_counter() - t0
    return _result(
        not reason, report, reason, hit_chunks=n, committed_tokens=committed_tokens,
        engine=engine, timings=timings,
    )  # fmt: skip


def save_records(
    engine: Engine,
    tier: Tier | Store,
    keys: Sequence[ChunkKey],
    layouts: Sequence[KVLayout],
    dest: Destination,
    *,
    deadline: float,
    skip_existing: bool = True,
    width: int | None = None,
    progress: Callable[[int], object] | None = None,
    on_done: Callable[[int, BaseException | None], object] | None = None,
) -> int:
    """Store record i of `dest` (`dest.extract(i, ...)`, `layouts[i].chunk_bytes` bytes)
    as `keys[i]` in `tier`; returns records written. `width` writers each lease one slot,
    gather a record into it and write it (checksummed, crash-safe), so at most `width`
    records are staged and in flight at once; a slot returns to the ring as soon as its
    write is done, failed or not. Slot waits end at `deadline` with EngineBusy.

    `on_done(i, error)`: called once per record (error None when it is stored or was
    already held); with it, one record's failure is reported there and the others go
    on; without it, the first failure raises."""
    if len(layouts) != len(keys):
        raise ValueError(f"{len(layouts)} layouts for {len(keys)} keys")
    width = engine.window if width is None else width

    def write(i: int) -> int:
        if skip_existing and tier.probe([keys[i]]) == 1:
            return 0
        nbytes = layouts[i].chunk_bytes
        slot = lease(engine, deadline)
        try:
            _extract(dest, i, slot, nbytes)
            slot.set_length(nbytes)
            tier.write(keys[i], slot, layouts[i])
        finally:
            # A put abandoned at its timeout (a pool tier) may still read the slot: it
            # keeps a view, and the slot returns to the ring when that put returns.
            give_back(slot)
            del slot
        return 1

    written = _each(write, len(keys), width, on_done, progress)
    dest.synchronize()
    return written


def write_staged(
    tier: Tier | Store,
    keys: Sequence[ChunkKey],
    layouts: Sequence[KVLayout],
    slots: Sequence[Slot],
    *,
    width: int,
    on_done: Callable[[int, BaseException | None], object] | None = None,
) -> int:
    """Write records already gathered into engine slots (`slots[i]` holds record i, its
    length set): for a host whose blocks must be copied out at once (vLLM's sliding-
    window blocks are reused from the next step on) and written later. `width` writes
    in flight; each slot goes back to the ring as soon as its own write ends, failed or
    not. Returns records written; failures as in `save_records`."""
    if not len(keys) == len(layouts) == len(slots):
        raise ValueError(f"{len(keys)} keys, {len(layouts)} layouts, {len(slots)} slots")
    held: list[Slot | None] = list(slots)

    def write(i: int) -> int:
        slot, held[i] = held[i], None  # this thread's slot now, and only its
        assert slot is not None
        try:
            return 1 if tier.write(keys[i], slot, layouts[i]) else 0
        finally:
            give_back(slot)
            del slot

    return _each(write, len(keys), width, on_done)


def _each(
    write: Callable[[int], int],
    n: int,
    width: int,
    on_done: Callable[[int, BaseException | None], object] | None,
    progress: Callable[[int], object] | None = None,
) -> int:
    """`write(i)` for i < n on `width` threads; the records written. With `on_done`, a
    record's failure goes there and the rest go on; without, the first one raises."""

    def one(i: int) -> int:
        if on_done is None:
            return write(i)
        try:
            w = write(i)
        except Exception as exc:  # noqa: BLE001 - handed to the caller's callback
            on_done(i, exc)
            return 0
        on_done(i, None)
        return w

    written = 0
    if n == 0:
        return 0
    with ThreadPoolExecutor(max_workers=min(width, n), thread_name_prefix="bsr-save") as pool:
        for w in pool.map(one, range(n)):
            written += w
            if progress is not None:
                progress(1)
    return written


class Restorer:
    """Restores and saves one rank's chunks with at most `window` chunks staged.

    `window` defaults to the engine's (every slot), or to 32 when the restorer makes its
    own engine; a smaller window leaves the rest of a shared engine's slots to others."""

    def __init__(
        self,
        store: Store,
        layout: KVLayout,
        *,
        window: int | None = None,
        engine: Engine | None = None,
        model: str = "model",
        rank: int | None = None,
        world_size: int | None = None,
        group: ProcessGroup | None = None,
        agreement: Agreement | None = None,
        timeout_s: float = 30.0,
        backend: str | None = None,
        install_threads: int = 1,
    ) -> None:
        if window is None:
            window = engine.window if engine is not None else 32
        if window < 1:
            raise ValueError(f"window must be at least 1 chunk, got {window}")
        self.store = store
        self.layout = layout
        self.model = model
        if agreement is None:
            import torch.distributed as dist

            if group is not None or (world_size or 1) > 1:
                agreement = Agreement.from_process_group(group, timeout_s)
            elif dist.is_available() and dist.is_initialized() and rank is None:
                agreement = Agreement.from_process_group(None, timeout_s)
            else:
                agreement = Agreement.local()
        self.agreement = agreement
        self.rank = agreement.rank if rank is None else rank
        self.world_size = agreement.world_size if world_size is None else world_size
        if (self.rank, self.world_size) != (agreement.rank, agreement.world_size) and (
            agreement.world_size > 1
        ):
            raise ValueError(
                f"rank {self.rank}/{self.world_size} does not match the process group "
                f"({agreement.rank}/{agreement.world_size})"
            )
        if engine is None:
            engine = Engine(window, layout.chunk_bytes, backend=backend)
        elif engine.window < window or engine.slot_bytes < layout.chunk_bytes:
            raise ValueError(
                f"engine has {engine.window} slots of {engine.slot_bytes} bytes; this restorer "
                f"needs {window} slots of at least {layout.chunk_bytes}"
            )
        self.engine = engine
        self.window = window
        # Fused installs of several chunks at once (window.py); 1: on the caller's thread.
        self.install_threads = install_threads
        # Bounds waits for a free slot (a shared engine) as it bounds the agreement.
        self.timeout_s = timeout_s if agreement.world_size == 1 else agreement.timeout_s

    @property
    def tiers(self) -> list[Tier]:
        return list(self.store.tiers)

    def keys(self, token_ids: Sequence[int]) -> list[ChunkKey]:
        return chunk_keys(token_ids, self.layout, self.model, self.rank, self.world_size)

    def probe(self, token_ids: Sequence[int], request_id: str | None = None) -> Plan:
        """The agreed reusable prefix, from metadata only (no payload is read).

        `request_id` names the request on every rank (a serving engine's request id);
        None numbers requests in call order, so ranks must then probe in the same
        order. The plan carries the request's identity on to `restore`."""
        keys = self.keys(token_ids)
        # Numbered before discovery: a discovery that raises must not leave this rank's
        # count of unnamed requests behind the others'.
        request = self.agreement.request(request_id, tag=_content_tag(keys))
        sources, group_hits = discover(self.tiers, keys, self.layout)
        agreed, reason = self.agreement.agree_min(len(sources), request)
        if not reason and agreed < len(sources):
            reason = f"hit shortened from {len(sources)} to {agreed} chunks by another rank"
        return Plan(
            token_count=len(token_ids),
            chunk_tokens=self.layout.chunk_tokens,
            keys=keys,
            hit_chunks=agreed,
            local_hit_chunks=len(sources),
            sources=sources[:agreed],
            tier_names=[t.name for t in self.tiers],
            group_hits=group_hits,
            reason=reason,
            request_id=request_id,
            request=request,
        )

    def restore(
        self, plan: Plan, dest: Destination, *, request_id: str | None = None
    ) -> RestoreResult:
        """Install the plan's hit into `dest` and commit it on all ranks, or on none.

        Raises LayoutError (after telling the peers to abort) for a destination built
        for another layout, and re-raises whatever the destination's install raises,
        also after the abort is published: peers never wait out the timeout."""
        if request_id is not None and request_id != plan.request_id:
            raise ValueError(
                f"restore of request {request_id!r} with the plan of {plan.request_id!r}"
            )
        t_start = time.perf_counter()
        n = plan.hit_chunks
        mismatch = _layout_mismatch(self.layout, dest)
        if n == 0:
            # The hit decision is shared: every rank knows it is zero, so no vote.
            if mismatch:
                raise LayoutError(mismatch)
            return RestoreResult(ZERO, 0, 0, 0, reason=plan.reason or "no reusable prefix")
        vote = self.agreement.open_vote(plan.request or None)
        try:
            report, error = self._install(plan, dest, vote, mismatch)
        except BaseException as exc:
            # Whatever escapes after discovery is this rank's failure: publish it first.
            vote.abort_early(f"{type(exc).__name__}: {exc}")
            vote.cast(False, f"{type(exc).__name__}: {exc}")
            raise
        t_installed = time.perf_counter()
        if error:
            vote.abort_early(error)
        decision = vote.cast(not error, error)
        t_done = time.perf_counter()
        timings = {
            "install_s": t_installed - t_start,
            "commit_s": t_done - t_installed,
            "total_s": t_done - t_start,
        }
        return _result(
            decision.commit, report, decision.reason, hit_chunks=n,
            committed_tokens=plan.hit_tokens, engine=self.engine, timings=timings,
        )  # fmt: skip

    def _install(
        self, plan: Plan, dest: Destination, vote: Vote, mismatch: str
    ) -> tuple[InstallReport | None, str]:
        """(InstallReport or None, error): the windowed install unless something already
        rules the restore out."""
        n = plan.hit_chunks
        if mismatch:
            raise LayoutError(mismatch)  # before any read: the caller's mistake
        capacity = getattr(dest, "capacity_chunks", n)
        if capacity < n:
            return None, f"destination has blocks for {capacity} chunks, the hit is {n}"
        if vote.aborted():
            # A late rank: the others decided already; do not read a byte.
            return None, "a peer rank aborted the restore"
        return _windowed(
            self.engine, self.tiers[: len(plan.tier_names)], plan.keys[:n], plan.sources[:n],
            dest, chunk_bytes=self.layout.chunk_bytes, sizes=None, width=self.window,
            deadline=time.monotonic() + self.timeout_s, should_stop=vote.aborted,
            install_threads=self.install_threads,
        )  # fmt: skip

    def save(
        self,
        token_ids: Sequence[int],
        dest: Destination,
        *,
        skip_existing: bool = True,
        progress: Callable[[int], object] | None = None,
    ) -> int:
        """Store every whole chunk of `token_ids` held by `dest`; returns chunks written.

        Each worker leases one slot, gathers a chunk into it and writes it, so at
        most `window` chunks are staged at once. A slot goes back to the ring as soon
        as its write is done, failed or not (a kept exception cannot pin it); with the
        engine shared (a restore running), workers wait for slots up to `timeout_s`.
        """
        keys = self.keys(token_ids)
        n = min(len(keys), getattr(dest, "capacity_chunks", len(keys)))
        return save_records(
            self.engine, self.store, keys[:n], [self.layout] * n, dest,
            deadline=time.monotonic() + self.timeout_s, skip_existing=skip_existing,
            width=self.window, progress=progress,
        )  # fmt: skip
