"""A bounded, all-or-nothing retrieve for LMCache 0.5.6's `LMCacheEngine`.

LMCache's synchronous `retrieve` fetches every hit chunk of every tier into L1 memory
objects and only then makes one GPU transfer, so staging equals the restored state,
and a hit larger than what L1 can free makes the disk path busy-wait forever. It also
keeps whatever prefix happened to load, per rank.

`BoundedRetriever.retrieve` has the same signature and return value (a CPU bool mask
over `tokens`) and walks the hit in windows of at most W chunks: `batched_get` W
chunks from their tier, hand them to the GPU connector, release them, next window.
L1 staging held by the retrieve is therefore at most W chunks whatever the hit.
The commit rule is bsr-io's: the mask is all True over the requested chunks only when
every chunk of the request loaded and installed on every rank; any failure gives an
all-False mask, which vLLM's adapter reports as failed blocks and recomputes. It never
raises into the caller.

The seam is the engine instance's `retrieve` attribute (`install`), which vLLM's
adapter calls as `self.lmcache_engine.retrieve(...)`: no LMCache class is patched.
It reads these LMCache internals, pinned by tests/integrations/lmcache/test_seam.py:
`engine.token_database.process_tokens`, `engine.storage_manager.get_block_mapping` /
`batched_get`, `engine.gpu_connector.batched_to_gpu`, `engine.is_healthy`,
`engine.stats_monitor`, and the config flags that select other retrieve paths.
"""

from __future__ import annotations

import logging
import threading
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch

from bsr_io.errors import BsrValueError

if TYPE_CHECKING:
    # LMCache ships no types: these name the seam and read as Any (pyproject's override).
    from lmcache.utils import CacheEngineKey
    from lmcache.v1.cache_engine import LMCacheEngine

    from bsr_io.commit import Agreement, Vote

    # (key, first token, end token) per chunk, as LMCache's token database yields them.
    ChunkInfo = tuple[CacheEngineKey, int, int]

logger = logging.getLogger(__name__)

# Engine modes whose retrieve is not the synchronous whole-plan path we replace.
_UNSUPPORTED = {
    "async_loading": "enable_async_loading stages through prefetch, not retrieve",
    "use_layerwise": "layerwise retrieve goes through retrieve_layer",
    "save_only_first_rank": "MLA first-rank broadcast is not windowed",
    "remove_after_retrieve": "PD receiver mode removes chunks after retrieve",
}


@dataclass
class RetrieveReport:
    """What one bounded retrieve did (`BoundedRetriever.last`)."""

    outcome: str  # "complete": every requested chunk installed; "zero": nothing reused
    requested_tokens: int
    restored_tokens: int
    chunks: int
    windows: int = 0
    staging_peak_bytes: int = 0  # most bytes of memory objects this retrieve held at once
    seconds: float = 0.0
    reason: str = ""
    locations: dict[str, int] = field(default_factory=dict)  # chunks per tier


def unsupported_reasons(engine: LMCacheEngine) -> list[str]:
    """Why `engine` cannot take the bounded retrieve (empty when it can)."""
    reasons: list[str] = []
    if getattr(engine, "async_loading", False):
        reasons.append(_UNSUPPORTED["async_loading"])
    if getattr(engine, "use_layerwise", False):
        reasons.append(_UNSUPPORTED["use_layerwise"])
    if getattr(engine, "save_only_first_rank", False):
        reasons.append(_UNSUPPORTED["save_only_first_rank"])
    if getattr(engine, "remove_after_retrieve", False):
        reasons.append(_UNSUPPORTED["remove_after_retrieve"])
    return reasons


class BoundedRetriever:
    """Windowed retrieve for one `LMCacheEngine`.

    `window`: most chunks staged at once (W). `agreement`: a `bsr_io.commit.Agreement`
    for tensor-parallel ranks (None: this rank decides alone). Every rank must call
    `retrieve` for the same requests in the same order, as vLLM's workers do.
    """

    def __init__(
        self, engine: LMCacheEngine, window: int, agreement: Agreement | None = None
    ) -> None:
        if window < 1:
            raise BsrValueError(f"window must be at least 1 chunk, got {window}")
        self.engine = engine
        self.window = window
        self.agreement = agreement
        self.last: RetrieveReport | None = None
        self._lock = threading.Lock()  # one retrieve at a time, as the vLLM worker calls it

    @torch.inference_mode()
    def retrieve(
        self, tokens: torch.Tensor | list[int], mask: torch.Tensor | None = None, **kwargs: Any
    ) -> torch.Tensor:
        with self._lock:
            ret_mask, report = self._retrieve(tokens, mask, kwargs)
        self.last = report
        level = (
            logging.INFO if report.outcome == "complete" or not report.chunks else logging.WARNING
        )
        logger.log(
            level,
            "bsr-io retrieve: %s, %d/%d tokens, %d chunks in %d windows, staging peak %d B%s",
            report.outcome,
            report.restored_tokens,
            report.requested_tokens,
            report.chunks,
            report.windows,
            report.staging_peak_bytes,
            f" ({report.reason})" if report.reason else "",
        )
        return ret_mask

    def _retrieve(
        self, tokens: torch.Tensor | list[int], mask: torch.Tensor | None, kwargs: dict[str, Any]
    ) -> tuple[torch.Tensor, RetrieveReport]:
        eng = self.engine
        t0 = time.perf_counter()
        ret_mask = torch.zeros(len(tokens), dtype=torch.bool)
        requested = int(mask.sum().item()) if mask is not None else len(tokens)
        report = RetrieveReport("zero", requested, 0, 0)
        stats = eng.stats_monitor.on_retrieve_request(requested)
        vote = self.agreement.open_vote(str(kwargs.get("req_id", ""))) if self.agreement else None
        ok, reason = True, ""
        chunk_infos: list[ChunkInfo] = []
        try:
            if not eng.is_healthy():
                raise _Fail("LMCache reports itself unhealthy")
            chunk_infos = [
                (key, start, end)
                for start, end, key in eng.token_database.process_tokens(
                    tokens=tokens, mask=mask, request_configs=kwargs.get("request_configs")
                )
            ]
            report.chunks = len(chunk_infos)
            # Discovery from metadata only (backends' batched_contains), prefix by tier.
            mapping: dict[str, list[ChunkInfo]] = (
                eng.storage_manager.get_block_mapping(chunk_infos) if chunk_infos else {}
            )
            found = sum(len(blocks) for blocks in mapping.values())
            report.locations = {loc: len(blocks) for loc, blocks in mapping.items()}
            if found < len(chunk_infos):
                raise _Fail(f"only {found} of {len(chunk_infos)} requested chunks are stored")
            self._install(mapping, kwargs, report, vote)
        except _Fail as exc:
            ok, reason = False, str(exc)
        except Exception as exc:  # never raise into LMCache's caller: recompute instead
            logger.exception("bsr-io retrieve failed")
            ok, reason = False, f"{type(exc).__name__}: {exc}"
        if vote is not None:
            try:
                decision = vote.cast(ok, reason)
                ok, reason = decision.commit, decision.reason
            except Exception as exc:  # the agreement itself failed: nobody may commit alone
                logger.exception("bsr-io retrieve: rank agreement failed")
                ok, reason = False, f"rank agreement failed: {type(exc).__name__}: {exc}"
        if ok and chunk_infos:
            for _, start, end in chunk_infos:
                ret_mask[start:end] = True
            report.outcome = "complete"
        report.restored_tokens = int(ret_mask.sum().item())
        report.reason = "" if ok else reason
        report.seconds = time.perf_counter() - t0
        eng.stats_monitor.on_retrieve_finished(stats, report.restored_tokens)
        return ret_mask, report

    def _install(
        self,
        mapping: dict[str, list[ChunkInfo]],
        kwargs: dict[str, Any],
        report: RetrieveReport,
        vote: Vote | None,
    ) -> None:
        eng = self.engine
        for location, blocks in mapping.items():
            for i in range(0, len(blocks), self.window):
                if vote is not None and vote.aborted():
                    raise _Fail("another rank aborted the restore")
                batch = blocks[i : i + self.window]
                objs = list(
                    eng.storage_manager.batched_get(
                        keys=[key for key, _, _ in batch], location=location
                    )
                    or []
                )
                held = [o for o in objs if o is not None]
                try:
                    if len(held) != len(batch) or len(objs) != len(batch):
                        backend = eng.storage_manager.storage_backends.get(location)
                        why = getattr(backend, "last_short_get", "")
                        raise _Fail(
                            f"{location} returned {len(held)} of {len(batch)} chunks "
                            f"in window {report.windows}" + (f" ({why})" if why else "")
                        )
                    staged = sum(o.get_size() for o in held)
                    report.staging_peak_bytes = max(report.staging_peak_bytes, staged)
                    eng.gpu_connector.batched_to_gpu(
                        held, [s for _, s, _ in batch], [e for _, _, e in batch], **kwargs
                    )
                finally:
                    # Release this window before fetching the next: that is the bound.
                    for obj in held:
                        obj.ref_count_down()
                report.windows += 1
        if vote is not None and vote.aborted():
            raise _Fail("another rank aborted the restore")


class _Fail(Exception):
    """An expected reason for zero reuse (logged without a traceback)."""


def install(
    engine: LMCacheEngine, window: int, agreement: Agreement | None = None
) -> BoundedRetriever:
    """Route `engine.retrieve` through a `BoundedRetriever`; returns it.

    Raises ValueError when the engine runs a retrieve mode this does not replace.
    """
    reasons = unsupported_reasons(engine)
    if reasons:
        raise BsrValueError("bounded retrieve not installed: " + "; ".join(reasons))
    current = installed(engine)
    if current is not None:
        current.window, current.agreement = window, agreement
        return current
    retriever = BoundedRetriever(engine, window, agreement)
    engine.retrieve = retriever.retrieve  # instance attribute: shadows the class method
    engine._bsr_retriever = retriever
    return retriever


def uninstall(engine: LMCacheEngine) -> None:
    """Give the engine its stock retrieve back."""
    if getattr(engine, "_bsr_retriever", None) is not None:
        del engine.retrieve
        engine._bsr_retriever = None


def installed(engine: LMCacheEngine) -> BoundedRetriever | None:
    retriever: BoundedRetriever | None = getattr(engine, "_bsr_retriever", None)
    return retriever


def bounded_retrieve(
    engine: LMCacheEngine,
    tokens: torch.Tensor | list[int],
    mask: torch.Tensor | None = None,
    *,
    window: int,
    agreement: Agreement | None = None,
    **kwargs: Any,
) -> torch.Tensor:
    """One bounded retrieve without installing anything on the engine."""
    return BoundedRetriever(engine, window, agreement).retrieve(tokens, mask, **kwargs)
