"""The conformance cases' LMCache host (cases.py `Host`): bsr-io's storage plugin loaded
by the real LMCache 0.5.6 engine from its config (only the GPU is stood in for, by the
lab's CPU paged connector), driven through LMCache's `store`, `retrieve` and the
plugin's `batched_contains` (LMCache's lookup).

A seed's state is the lab harness's `make_state` for that seed. Reads go through the
plugin's staging slots into LMCache's L1 objects, then into the paged cache; a failed
retrieve's objects go back to L1, whose next retrieve (another prefix) reuses them."""

from __future__ import annotations

from collections.abc import Callable
from contextlib import AbstractContextManager
from pathlib import Path
from typing import Any

import pytest
from conformance.cases import CHUNKS, Background, Loaded, Options, Saved, failing_lease

from bsr_io.integrations.lmcache.config import lmcache_settings
from bsr_io.integrations.lmcache.plugin import BsrStoragePlugin
from bsr_io.save import records as save_records_module

h = pytest.importorskip("bsr_lab.lmcache.harness")
SHAPE = h.Shape()
W = 4


class LMCacheHost:
    window = W

    def __init__(self, store: Path, opts: Options) -> None:
        assert opts.lower is None, "the plugin has no lower file tier"
        self.engines = h.Engines(SHAPE)
        settings = lmcache_settings(store, window=W, timeout_s=opts.timeout_s)
        self.eng = self.engines(l1_chunks=4 * CHUNKS, settings=settings)
        plugin = self.eng.storage_manager.storage_backends.get("bsr")
        if not isinstance(plugin, BsrStoragePlugin):  # LMCache only logs a plugin's error
            self.engines.close()
            raise AssertionError(
                f"no bsr plugin: {list(self.eng.storage_manager.storage_backends)}"
            )
        self.plugin = plugin

    def _keys(self, src: Any) -> list[Any]:
        return list(h._keys(self.eng, src.tokens, 0, CHUNKS))

    def save(self, seed: int) -> Saved:
        src = h.make_state(SHAPE, CHUNKS, seed=seed)
        keys = self._keys(src)
        paths = [self.plugin.tier.path_of(self.plugin.chunk_key(k)) for k in keys]
        try:
            h.store_windowed(self.eng, src, W)
            self.plugin.flush()
        except Exception as exc:  # noqa: BLE001 - what the host is told
            return Saved(False, paths, f"{type(exc).__name__}: {exc}", exc)
        # LMCache learns of a put only by looking it up.
        return Saved(self.plugin.batched_contains(keys) == CHUNKS, paths)

    def offered(self, seed: int) -> int:
        return int(self.plugin.batched_contains(self._keys(h.make_state(SHAPE, CHUNKS, seed))))

    def load(self, seed: int) -> Loaded:
        src = h.make_state(SHAPE, CHUNKS, seed=seed)
        h.drop_l1(self.eng)
        dst = h.empty_like(src)
        mask = self.eng.retrieve(src.tokens, **dst.kwargs())
        n = int(mask.sum()) // SHAPE.chunk_tokens
        return Loaded(
            n, h.restored_equal(src, dst, n * SHAPE.chunk_tokens), str(self.plugin.last_short_get)
        )

    def start_load(self, seed: int) -> Background[None]:
        return Background(lambda s, _: self.load(s), seed, None)

    def unhealthy(self) -> bool:
        return False  # a retrieve returns at its deadline

    def reuse(self, pending: Any, seed: int) -> bool:
        """LMCache's next retrieve (another prefix) stages in the L1 objects handed back."""
        pending.src = h.make_state(SHAPE, CHUNKS, seed=seed)
        pending.dst = h.empty_like(pending.src)
        h.drop_l1(self.eng)
        mask = self.eng.retrieve(pending.src.tokens, **pending.dst.kwargs())
        return bool(mask.all())

    def holds(self, pending: Any, seed: int) -> bool:
        return bool(h.restored_equal(pending.src, pending.dst, CHUNKS * SHAPE.chunk_tokens))

    def relist(self, during: Callable[[], object]) -> None:
        during()  # no listing of its own (the case table says so)

    def free_slots(self) -> int:
        engines = (self.plugin.read_engine, self.plugin.write_engine)
        return min(int(e.free_slots()) for e in engines)

    def broken_lease(self) -> AbstractContextManager[None]:
        return failing_lease(save_records_module)

    def close(self) -> None:
        self.engines.close()


make = LMCacheHost
