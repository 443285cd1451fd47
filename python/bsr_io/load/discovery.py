"""Discovery without residency: find the reusable prefix from metadata alone.

For each chunk key, in order, the source is the highest tier (first in the
store's order) whose index says it holds the whole record; the local hit ends at
the first chunk no tier holds. Per allocator group hits are reported too, since
a hybrid model's groups can be evicted or lost separately. No payload byte is
read here. Given a deadline, discovery runs on a runner thread and is waited for
until then: a metadata call that stalls (a header read on a hung drive, a stat on a
dead mount) ends the request's hit on this rank, never the caller's progress.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, TypeVar

from bsr_io._core import BsrError
from bsr_io.errors import TierDown
from bsr_io.model.keys import ChunkKey
from bsr_io.model.layout import KVLayout
from bsr_io.tiers.files.bounded import run_within

if TYPE_CHECKING:
    from bsr_io.tiers.base import Tier

T = TypeVar("T")


class DiscoveryTimedOut(BsrError):
    """Discovery did not finish by its deadline: a metadata call (a stat, a record's
    header read, a pool query) stalled on a hung device, mount or node. The request
    has no hit on this rank; the stalled call is left to end on its own thread."""


def _by(deadline: float | None, what: str, work: Callable[[], T]) -> T:
    """`work()`, waited for until `deadline` (time.monotonic; None: no limit) on a
    runner thread (kept between calls: starting a thread per probe cost more than a
    one-chunk probe's own work, most of it on a loaded or cold machine), so that a
    stalled call costs the deadline, never a hang. A stalled call holds its runner;
    the next call takes another."""
    if deadline is None:
        return work()

    def kept() -> tuple[bool, Any]:
        # What `work` raised is handed back as a value: a TimeoutError of its own must
        # not read as the deadline passing.
        try:
            return True, work()
        except BaseException as exc:  # noqa: BLE001 - handed to the waiter
            return False, exc

    try:
        ok, value = run_within(deadline - time.monotonic(), kept)
    except TimeoutError:
        raise DiscoveryTimedOut(
            f"{what} did not finish by its deadline (a tier's metadata call stalled: a hung "
            "device, mount or storage node?)"
        ) from None
    if not ok:
        raise value
    return value  # type: ignore[no-any-return]


@dataclass
class Plan:
    """What a restore will do: the agreed hit and where each hit chunk comes from."""

    token_count: int
    chunk_tokens: int
    keys: list[ChunkKey]
    hit_chunks: int  # agreed over groups and ranks
    local_hit_chunks: int  # this rank alone, before agreement
    sources: list[int]  # tier index per hit chunk
    tier_names: list[str]
    group_hits: dict[str, int] = field(default_factory=dict)
    reason: str = ""  # why the hit is zero or short, when known
    request_id: str | None = None  # the caller's id of this request, if it gave one
    request: str = ""  # the request's agreement namespace, the same on every rank
    # Seconds spent finding this rank's hit ("discover_s") and agreeing on it ("agree_s").
    timings: dict[str, float] = field(default_factory=dict)

    @property
    def hit_tokens(self) -> int:
        return self.hit_chunks * self.chunk_tokens

    def source_names(self) -> list[str]:
        return [self.tier_names[t] for t in self.sources]


def holds(tier: Tier, key: ChunkKey, group: str | None = None) -> bool:
    try:
        return tier.contains(key, group)
    except TierDown:
        return False  # a tier that is down holds nothing for discovery


def holds_all(tier: Tier, key: ChunkKey, groups: Sequence[str]) -> bool:
    """Whether `tier` holds every group of `key`: one question unless it answers per group."""
    if tier.per_group:
        return all(holds(tier, key, g) for g in groups)
    return holds(tier, key)


def sources_of(
    tiers: Sequence[Tier], keys: Sequence[ChunkKey], deadline: float | None = None
) -> list[int]:
    """Source tier per leading key: the first tier whose index holds the whole record.
    Stops at the first key no tier holds. Metadata only; DiscoveryTimedOut when it has
    not finished by `deadline` (time.monotonic)."""
    return _by(deadline, "finding the records' tiers", lambda: _sources_of(tiers, keys))


def _sources_of(tiers: Sequence[Tier], keys: Sequence[ChunkKey]) -> list[int]:
    for t in tiers:
        t.prepare_probe(keys)
    sources: list[int] = []
    for key in keys:
        src = next((i for i, t in enumerate(tiers) if holds(t, key)), None)
        if src is None:
            break
        sources.append(src)
    return sources


def discover(
    tiers: Sequence[Tier],
    keys: Sequence[ChunkKey],
    layout: KVLayout,
    deadline: float | None = None,
) -> tuple[list[int], dict[str, int]]:
    """(source tier per leading chunk, leading hit per allocator group), metadata only;
    DiscoveryTimedOut when it has not finished by `deadline` (time.monotonic)."""
    return _by(deadline, "discovery", lambda: _discover(tiers, keys, layout))


def _discover(
    tiers: Sequence[Tier], keys: Sequence[ChunkKey], layout: KVLayout
) -> tuple[list[int], dict[str, int]]:
    for t in tiers:
        # A tier that answers many keys in one call (a remote pool) is handed the request's
        # keys first; its per-chunk answers below then come from that one call.
        t.prepare_probe(keys)
    names = [g.name for g in layout.groups]
    # A chunk is restorable from the first tier whose record holds every group.
    sources: list[int] = []
    for key in keys:
        src = next((i for i, t in enumerate(tiers) if holds_all(t, key, names)), None)
        if src is None:
            break
        sources.append(src)
    # Every group reaches at least that far; past it, say how far each one alone goes.
    group_hits: dict[str, int] = {}
    for g in names:
        n = len(sources)
        while n < len(keys) and any(holds(t, keys[n], g) for t in tiers):
            n += 1
        group_hits[g] = n
    return sources, group_hits


def miss_reason(
    token_count: int, chunk_tokens: int, tier_names: Sequence[str], group_hits: dict[str, int]
) -> str:
    """Why discovery found no leading chunk on this rank, from what it saw."""
    if token_count < chunk_tokens:
        return (
            f"prompt shorter than one chunk ({token_count} tokens < chunk_tokens "
            f"{chunk_tokens}): a partial chunk is never stored"
        )
    tiers = ", ".join(tier_names)
    found = sorted(g for g, n in group_hits.items() if n > 0)
    if not found:
        return f"no record of the first chunk in any tier ({tiers})"
    lacking = sorted(g for g, n in group_hits.items() if n == 0)
    if lacking:
        return (
            f"group {', '.join(lacking)} has no record of chunk 0 in any tier ({tiers}); "
            f"group {', '.join(found)} has"
        )
    return f"no one tier ({tiers}) holds every group of chunk 0: each group's is elsewhere"
