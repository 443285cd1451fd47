"""The conformance cases' core host: a caller of the `Restorer` API (cases.py `Host`).

Saves through `Restorer.save` from a paged host cache, loads by `probe` and `restore`
into one; its pages are 32 KiB blocks over page-aligned memory, so restores read
straight into them (O_DIRECT) as a host KV cache's do. Reusing a failed load's pages
is what the API offers a caller: a restore of another prefix through a NEW cache view
over the same memory (a per-request cache)."""

from __future__ import annotations

from collections.abc import Callable
from contextlib import AbstractContextManager
from pathlib import Path
from typing import Any

import torch
from conformance.cases import CHUNKS, Background, Loaded, Options, Saved, failing_lease

from bsr_io import Engine
from bsr_io.cli.synthetic import fill_destination, synthetic_chunk, synthetic_tokens
from bsr_io.load.kvcache import PagedKVCache
from bsr_io.model.layout import AllocatorGroup, KVLayout
from bsr_io.restore import Restorer
from bsr_io.save import records as save_records_module
from bsr_io.store import Store
from bsr_io.tiers import LowerTier, SSDTier

LAYOUT = KVLayout("conf", (AllocatorGroup("kv", torch.bfloat16, (1024,), 16),), chunk_tokens=16)
W = 4


class CoreHost:
    window = W

    def __init__(self, store: Path, opts: Options) -> None:
        self.engine = Engine(W, LAYOUT.chunk_bytes)
        self.ssd = SSDTier(store, None, self.engine, layout=LAYOUT)
        tiers: list[Any] = [self.ssd]
        if opts.lower is not None:
            tiers.append(LowerTier(opts.lower, layout=LAYOUT))
        self.tiers = tiers
        self.r = Restorer(
            Store(tiers), LAYOUT, window=W, engine=self.engine, model="m", timeout_s=opts.timeout_s
        )

    def _tokens(self, seed: int) -> Any:
        return synthetic_tokens(seed, CHUNKS * LAYOUT.chunk_tokens)

    def save(self, seed: int) -> Saved:
        tokens = self._tokens(seed)
        cache = PagedKVCache.allocate(LAYOUT, len(tokens))
        fill_destination(cache, LAYOUT, CHUNKS, seed)
        paths = [self.ssd.path_of(k) for k in self.r.keys(tokens)]
        try:
            self.r.save(tokens, cache)
        except Exception as exc:  # noqa: BLE001 - what the caller is told
            return Saved(False, paths, f"{type(exc).__name__}: {exc}", exc)
        return Saved(True, paths)

    def offered(self, seed: int) -> int:
        return int(self.r.probe(self._tokens(seed)).hit_chunks)

    def load_into(self, seed: int, cache: PagedKVCache) -> Loaded:
        res = self.r.restore(self.r.probe(self._tokens(seed)), cache)
        n = res.committed_chunks
        return Loaded(n, _holds(cache, seed, n), f"{res.outcome}: {res.reason}")

    def load(self, seed: int) -> Loaded:
        return self.load_into(seed, PagedKVCache.allocate(LAYOUT, CHUNKS * LAYOUT.chunk_tokens))

    def start_load(self, seed: int) -> Background[PagedKVCache]:
        cache = PagedKVCache.allocate(LAYOUT, CHUNKS * LAYOUT.chunk_tokens)
        return Background(self.load_into, seed, cache)

    def unhealthy(self) -> bool:
        return False  # a restore returns at its deadline: the caller never waits past it

    def reuse(self, pending: Any, seed: int) -> bool:
        """A restore of `seed` through a new view over the failed load's memory."""
        view = PagedKVCache(LAYOUT, pending.dest.tensors, [list(range(CHUNKS))])
        pending.view = view
        return self.load_into(seed, view).verified == CHUNKS

    def holds(self, pending: Any, seed: int) -> bool:
        return _holds(pending.view, seed, CHUNKS)

    def relist(self, during: Callable[[], object]) -> None:
        during()  # no listing of its own (the case table says so)

    def free_slots(self) -> int:
        return int(self.engine.free_slots())

    def broken_lease(self) -> AbstractContextManager[None]:
        return failing_lease(save_records_module)

    def close(self) -> None:
        for t in self.tiers:
            t.close()
        self.engine.close()


def _holds(cache: PagedKVCache, seed: int, n: int) -> bool:
    return all(cache.chunk_bytes(i) == synthetic_chunk(LAYOUT, seed, i).tobytes() for i in range(n))


make = CoreHost
