"""The conformance cases' SGLang host (tests/conformance/cases.py `Host`): SGLang's own
host pool and the backend SGLang's storage factory builds, driven through the v1 calls
HiCache makes (`batch_set_v1`, `batch_exists`, `batch_get_v1`).

A prefix is 4 pages; a seed's bytes are `pools.fill`'s for that seed. Saves write from
pages 1-4; each load lands in pages of its own, and a failed load's tail is reused as
SGLang reuses it: another prefix's bytes written there. Roles "writer" and "reader" are
the two ranks of an MLA model at TP=2 (rank 0 stores every page, rank 1 none).
"""

from __future__ import annotations

from collections.abc import Callable
from contextlib import AbstractContextManager
from pathlib import Path
from typing import Any

import pytest
import torch
from conformance.cases import CHUNKS, Background, Loaded, Options, Saved, failing_lease
from pools import fill, keys, make_backend, mha_pool, mla_pool, page_bytes

from bsr_io.save import records as save_records_module
from bsr_io.tiers.files import fresh

SAVE_AT = 1  # first page of the region saves are made from
SCRATCH = 60  # first page of the region a seed's expected bytes are made in
LOADS = range(8, 56, CHUNKS)  # first pages of the regions loads land in, in turn


def _pages(first: int) -> torch.Tensor:
    return torch.arange(first * 16, (first + CHUNKS) * 16)


class SGLangHost:
    def __init__(self, store: Path, opts: Options) -> None:
        store.mkdir(parents=True, exist_ok=True)
        mla = bool(opts.role)
        self.pool = mla_pool("page_first") if mla else mha_pool("page_first")
        extra: dict[str, Any] = {
            "timeout_s": opts.timeout_s,
            "rescan_s": opts.rescan_s,
            "window": 4,
        }
        if opts.lower is not None:
            extra["lower_dir"] = str(opts.lower)
        rank = 1 if opts.role == "reader" else 0
        self.b = make_backend(
            store, self.pool, tp_rank=rank, tp_size=2 if mla else 1, mla=mla, **extra
        )
        self.window = 4
        self._next = 0
        self._last = 0

    def region(self) -> torch.Tensor:
        first = LOADS[self._next % len(LOADS)]
        self._next += 1
        return _pages(first)

    def expected(self, seed: int) -> list[bytes]:
        at = _pages(SCRATCH)
        fill(self.pool, at, seed)
        return page_bytes(self.pool, at)

    def save(self, seed: int) -> Saved:
        at = _pages(SAVE_AT)
        fill(self.pool, at, seed)
        ks = keys(CHUNKS, str(seed))
        ok = self.b.batch_set_v1(ks, at)
        assert self.b.store is not None
        tier = self.b.store.tiers[0]
        paths = [tier.path_of(self.b._key(k)) for k in ks]  # type: ignore[attr-defined]
        self._last = seed
        return Saved(all(ok), paths, str(ok))

    def offered(self, seed: int) -> int:
        return int(self.b.batch_exists(keys(CHUNKS, str(seed))))

    def load_into(self, seed: int, at: torch.Tensor) -> Loaded:
        got = self.b.batch_get_v1(keys(CHUNKS, str(seed)), at)
        n = next((i for i, g in enumerate(got) if not g), CHUNKS)
        assert not any(got[n:]), f"a page after a failed one answered True: {got}"
        right = page_bytes(self.pool, at)[:n] == self.expected(seed)[:n]
        return Loaded(n, right, str(got))

    def load(self, seed: int) -> Loaded:
        return self.load_into(seed, self.region())

    def start_load(self, seed: int) -> Background[torch.Tensor]:
        return Background(self.load_into, seed, self.region())

    def unhealthy(self) -> bool:
        # SGLang learns a backend's health only from batch_exists: no hit for a stored page.
        return self.offered(self._last) == 0

    def reuse(self, pending: Any, seed: int) -> bool:
        """SGLang frees the pages past the verified ones and writes another prefix there."""
        tail = pending.dest[pending.ok * 16 :]
        fill(self.pool, tail, seed)
        pending.reused = page_bytes(self.pool, tail)
        pending.tail = tail
        return True

    def holds(self, pending: Any, seed: int) -> bool:
        return bool(page_bytes(self.pool, pending.tail) == pending.reused)

    def relist(self, during: Callable[[], object]) -> None:
        """The catalog's next listing (its thread's pass), with `during` run after the
        listing read the directory and before it ends (a wrapper of the listing call:
        a test double, to make the interleaving certain)."""
        real = fresh.chunk_hashes

        def listing_then(ns_dir: Path) -> set[int]:
            listed = real(ns_dir)
            during()
            return listed

        catalog, _ = _parts(self.b)
        with pytest.MonkeyPatch.context() as mp:
            mp.setattr(fresh, "chunk_hashes", listing_then)
            catalog.refresh()

    def free_slots(self) -> int:
        _, engines = _parts(self.b)
        return min(int(e.free_slots()) for e in engines)

    def broken_lease(self) -> AbstractContextManager[None]:
        return failing_lease(save_records_module)

    def close(self) -> None:
        self.b.close()


def _parts(b: Any) -> tuple[Any, list[Any]]:
    """The KV pool's catalog (the view its listing thread refreshes) and its read and
    write engines, wherever this version of the backend keeps them."""
    g = getattr(b, "groups", {}).get("kv")
    if g is not None:
        return g.catalog, [g.read_engine, g.write_engine]
    return b._catalog, [b._read_engine, b._write_engine]  # noqa: SLF001


make = SGLangHost
