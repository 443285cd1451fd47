"""When a benchmark's target applies: targets are steady-state figures (a restore's rate
or CPU per GiB against a reference), set for chunks of megabytes and states of
gigabytes. On a small input the same figures measure fixed costs, so a report says the
target does not apply, and why, instead of "NOT met"."""

from __future__ import annotations

from bsr_io.model.layout import KVLayout
from bsr_io.model.sizes import GiB, MiB, fmt_size

MIN_CHUNK_BYTES = MiB  # below it per-record costs (open, header, hash call) set the time
MIN_STATE_BYTES = GiB  # below it the probe, the commit and the first reads are not amortised
MIN_WINDOW_FILLS = 4  # the window refills this many times: a steady state to measure


def not_applicable(lay: KVLayout, chunks: int, window: int) -> str | None:
    """Why a steady-state target does not apply to `chunks` chunks of `lay` through
    `window` slots (one clause), or None where it does."""
    if lay.chunk_bytes < MIN_CHUNK_BYTES:
        return (
            f"{lay.name}'s {fmt_size(lay.chunk_bytes)} chunks are under "
            f"{fmt_size(MIN_CHUNK_BYTES)}, so per-record costs, not the bytes, set the time"
        )
    need = max(-(-MIN_STATE_BYTES // lay.chunk_bytes), MIN_WINDOW_FILLS * window)
    if chunks < need:
        return (
            f"{chunks} chunk(s) ({fmt_size(chunks * lay.chunk_bytes)}) are too few to reach a "
            f"steady state (the targets need at least {fmt_size(MIN_STATE_BYTES)} and "
            f"{MIN_WINDOW_FILLS} x W chunks: --tokens >= {need * lay.chunk_tokens})"
        )
    return None


def verdict(met: bool | None, reason: str | None, *, again: bool = False) -> str:
    """'met', 'NOT met' or 'target not applicable: <reason>' (`again`: the reason was
    given earlier in the same report: 'target not applicable, as above')."""
    if reason is not None or met is None:
        if again:
            return "target not applicable, as above"
        return f"target not applicable: {reason or 'not measured'}"
    return "met" if met else "NOT met"
