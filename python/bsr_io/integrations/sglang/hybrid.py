"""SGLang's v2 hit policies over every pool of a page, and the one-commit cut.

Pure functions over what each pool holds or delivered, so the rules are stated once:

- `fold_hits`: the prefix lengths on which every pool's policy holds (ALL_PAGES: every
  page of the prefix; TRAILING_PAGES: the window of `len(keys)` pages that ends it;
  BLOCK_GROUPS: its leading whole groups, reported as its own count and, as SGLang
  defines it, never gating the KV). Every legal length is listed, not just the
  longest: a trailing window makes 5 restorable where 4 is not, and SGLang intersects
  the lists across ranks.
- `commit_cut`: a batch's pools read or written together; the first page any pool
  failed ends the batch for every pool (never KV without its indexer, never a window
  without the pages it ends).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

ALL_PAGES, TRAILING_PAGES, BLOCK_GROUPS = "all_pages", "trailing_pages", "block_groups"


@dataclass(frozen=True)
class PoolQuery:
    """One sidecar pool of a `batch_exists_v2`: its name, policy and geometry, and
    whether its record of each of the query's first `kv_pages` pages is held."""

    name: str
    policy: str
    held: Sequence[bool]
    window: int = 1  # TRAILING_PAGES: pages the window must hold
    group_pages: int = 1  # BLOCK_GROUPS: pages per group


@dataclass
class Hits:
    kv_pages: int  # the longest restorable prefix
    pool_pages: dict[str, int] = field(default_factory=dict)  # each pool's own boundary
    restorable: list[int] = field(default_factory=list)  # every restorable length, ascending


def fold_hits(kv_pages: int, pools: Sequence[PoolQuery]) -> Hits:
    """The restorable prefixes of a query whose KV pool holds its first `kv_pages`."""
    restorable = set(range(1, kv_pages + 1))
    own: dict[str, int] = {"kv": kv_pages} if kv_pages else {}
    for q in pools:
        held = list(q.held[:kv_pages]) + [False] * max(0, kv_pages - len(q.held))
        if q.policy == ALL_PAGES:
            boundary = held.index(False) if False in held else kv_pages
            legal = set(range(1, boundary + 1))
        elif q.policy == TRAILING_PAGES:
            n = max(1, q.window)
            legal = {p for p in range(1, kv_pages + 1) if all(held[max(0, p - n) : p])}
            boundary = max(legal, default=0)
        elif q.policy == BLOCK_GROUPS:
            g = max(1, q.group_pages)
            groups = 0
            while (groups + 1) * g <= kv_pages and all(held[groups * g : (groups + 1) * g]):
                groups += 1
            boundary, legal = groups * g, restorable
        else:
            raise ValueError(f"pool {q.name!r}: unknown hit policy {q.policy!r}")
        if boundary:
            own[q.name] = boundary
        restorable &= legal
    ordered = sorted(restorable)
    return Hits(ordered[-1] if ordered else 0, own, ordered)


def commit_cut(keys: Mapping[str, Sequence[str]], done: Mapping[str, int]) -> dict[str, list[bool]]:
    """Each pool's per-page verdict once the batch is cut at the first page (in the
    chain's order) that any pool did not complete. `keys[pool]`: the pool's page keys
    in chain order (pools carry the whole span or a window of it); `done[pool]`: how
    many leading pages of it completed."""
    if not keys:
        return {}
    chain = max(keys.values(), key=len)
    at = {k: i for i, k in enumerate(chain)}
    cut = len(chain)
    for name, ks in keys.items():
        n = done.get(name, 0)
        if n < len(ks):
            # A page outside the longest run has no place in the chain: cut it all.
            cut = min(cut, at.get(ks[n], 0))
    return {
        name: [i < done.get(name, 0) and at.get(k, -1) in range(cut) for i, k in enumerate(ks)]
        for name, ks in keys.items()
    }


def stored_together(
    keys: Mapping[str, Sequence[str]], ok: Mapping[str, Sequence[bool]]
) -> dict[str, list[bool]]:
    """A page counts as stored only when every pool's record of it is published: each
    pool's verdict per page, False where any pool that carries the page failed it."""
    failed = {
        k for name, ks in keys.items() for k, good in zip(ks, ok[name], strict=True) if not good
    }
    return {
        name: [good and k not in failed for k, good in zip(ks, ok[name], strict=True)]
        for name, ks in keys.items()
    }
