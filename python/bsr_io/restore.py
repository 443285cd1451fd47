"""Bounded-State Restoration: probe, windowed install, request-level commit.

A `Restorer` belongs to one rank. `probe` finds the reusable prefix from
metadata and agrees on it with the other ranks (minimum over groups and ranks);
`restore` streams it through W staging slots into the destination and then
votes; the prefix is committed on every rank or on none. `save` stores a
prefix through the same bounded staging. The load and save themselves are the
one path every integration uses (`bsr_io.load.records`, `bsr_io.save.records`).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any, TypeAlias

from bsr_io._core import Engine
from bsr_io.commit import Agreement
from bsr_io.errors import BsrValueError, LayoutError, expect_methods, expect_type
from bsr_io.load.discovery import DiscoveryTimedOut, Plan, discover, miss_reason
from bsr_io.load.kvcache import Destination
from bsr_io.load.records import (
    COMPLETE,
    ZERO,
    LoadOptions,
    RestoreResult,
    load_result,
    windowed_install,
)
from bsr_io.load.window import TAIL_INFLIGHT, InstallReport
from bsr_io.model.keys import chunk_keys
from bsr_io.model.layout import KVLayout
from bsr_io.save.records import save_records
from bsr_io.store import Store

if TYPE_CHECKING:
    import numpy as np
    import numpy.typing as npt
    from torch.distributed import ProcessGroup

    from bsr_io.commit import Vote
    from bsr_io.model.keys import ChunkKey
    from bsr_io.tiers.base import Tier

    # What `chunk_keys` hashes: a sequence of ints or a 1-D integer array.
    TokenIds: TypeAlias = Sequence[int] | npt.NDArray[np.integer[Any]]

__all__ = ["COMPLETE", "ZERO", "RestoreResult", "Restorer"]


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
        tail_inflight: int | None = TAIL_INFLIGHT,
    ) -> None:
        expect_type(store, Store, "store")
        expect_type(layout, KVLayout, "layout")
        expect_type(engine, (Engine, type(None)), "engine")
        expect_type(agreement, (Agreement, type(None)), "agreement")
        expect_type(model, str, "model")
        if window is None:
            window = engine.window if engine is not None else 32
        if isinstance(window, bool) or not isinstance(window, int) or window < 1:
            raise BsrValueError(f"window must be an int of at least 1 chunk, got {window!r}")
        # A deadline of zero or less would end every restore `zero` without a read.
        if (
            isinstance(timeout_s, bool)
            or not isinstance(timeout_s, int | float)
            or not (timeout_s > 0)
        ):
            raise BsrValueError(f"timeout_s must be a number of seconds > 0, got {timeout_s!r}")
        if (
            isinstance(install_threads, bool)
            or not isinstance(install_threads, int)
            or (install_threads < 1)
        ):
            raise BsrValueError(f"install_threads must be an int >= 1, got {install_threads!r}")
        if tail_inflight is not None and (
            isinstance(tail_inflight, bool)
            or not isinstance(tail_inflight, int)
            or tail_inflight < 1
        ):
            raise BsrValueError(
                f"tail_inflight must be a byte count >= 1 or None, got {tail_inflight!r}"
            )
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
            raise BsrValueError(
                f"rank {self.rank}/{self.world_size} does not match the process group "
                f"({agreement.rank}/{agreement.world_size})"
            )
        if engine is None:
            engine = Engine(window, layout.chunk_bytes, backend=backend)
        elif engine.window < window or engine.slot_bytes < layout.chunk_bytes:
            raise BsrValueError(
                f"engine has {engine.window} slots of {engine.slot_bytes} bytes; this restorer "
                f"needs {window} slots of at least {layout.chunk_bytes}"
            )
        self.engine = engine
        self.window = window
        # Fused installs of several chunks at once (window.py); 1: on the caller's thread.
        self.install_threads = install_threads
        # The last chunk's bytes in the kernel at once (window.py; None: no cap).
        self.tail_inflight = tail_inflight
        # Bounds waits for a free slot (a shared engine) as it bounds the agreement.
        self.timeout_s = timeout_s if agreement.world_size == 1 else agreement.timeout_s

    @property
    def tiers(self) -> list[Tier]:
        return list(self.store.tiers)

    def keys(self, token_ids: TokenIds) -> list[ChunkKey]:
        return chunk_keys(token_ids, self.layout, self.model, self.rank, self.world_size)

    def probe(self, token_ids: TokenIds, request_id: str | None = None) -> Plan:
        """The agreed reusable prefix, from metadata only (no payload is read).

        `request_id` names the request on every rank (a serving engine's request id);
        None numbers requests in call order, so ranks must then probe in the same
        order. The plan carries the request's identity on to `restore`."""
        expect_type(request_id, (str, type(None)), "request_id")
        keys = self.keys(token_ids)
        # Numbered before discovery: a discovery that raises must not leave this rank's
        # count of unnamed requests behind the others'.
        request = self.agreement.request(request_id, tag=_content_tag(keys))
        t0 = time.perf_counter()
        try:
            deadline = time.monotonic() + self.timeout_s
            sources, group_hits = discover(self.tiers, keys, self.layout, deadline)
            stalled = ""
        except DiscoveryTimedOut as exc:
            # No hit on this rank; the others learn it from the agreement below.
            sources, group_hits, stalled = [], {}, str(exc)
        t1 = time.perf_counter()
        agreed, reason = self.agreement.agree_min(len(sources), request)
        timings = {"discover_s": t1 - t0, "agree_s": time.perf_counter() - t1}
        reason = stalled or reason
        if not reason and agreed < len(sources):
            reason = f"hit shortened from {len(sources)} to {agreed} chunks by another rank"
        if not reason and not sources:
            # Every zero says why: a README's `print("miss:", plan.reason)` is never blank.
            reason = miss_reason(
                len(token_ids), self.layout.chunk_tokens, [t.name for t in self.tiers], group_hits
            )
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
            timings=timings,
        )

    def restore(
        self, plan: Plan, dest: Destination, *, request_id: str | None = None
    ) -> RestoreResult:
        """Install the plan's hit into `dest` and commit it on all ranks, or on none.

        Raises LayoutError (after telling the peers to abort) for a destination built
        for another layout, and re-raises whatever the destination's install raises,
        also after the abort is published: peers never wait out the timeout."""
        expect_type(plan, Plan, "plan")
        expect_methods(dest, ("install", "synchronize"), "dest (a Destination)")
        if request_id is not None and request_id != plan.request_id:
            raise BsrValueError(
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
        result = load_result(
            decision.commit,
            report,
            decision.reason,
            hit_chunks=n,
            committed_tokens=plan.hit_tokens,
            engine=self.engine,
            timings=timings,
        )
        result.marks.update(start=t_start, installed=t_installed, committed=t_done)
        return result

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
        options = LoadOptions(
            deadline=time.monotonic() + self.timeout_s,
            should_stop=vote.aborted,
            install_threads=self.install_threads,
            tail_inflight=self.tail_inflight,
        )
        tiers = self.tiers[: len(plan.tier_names)]
        keys, sources = plan.keys[:n], plan.sources[:n]
        return windowed_install(
            self.engine, tiers, keys, sources, dest, options, self.layout.chunk_bytes, self.window
        )

    def save(
        self,
        token_ids: TokenIds,
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
        expect_methods(dest, ("extract",), "dest (a Destination)")
        keys = self.keys(token_ids)
        n = min(len(keys), getattr(dest, "capacity_chunks", len(keys)))
        return save_records(
            self.engine,
            self.store,
            keys[:n],
            [self.layout] * n,
            dest,
            deadline=time.monotonic() + self.timeout_s,
            skip_existing=skip_existing,
            width=self.window,
            progress=progress,
        )
