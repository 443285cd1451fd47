"""One SGLang host pool's records: an allocator group of one layout in the store.

Each pool the backend serves (the KV pool, and with the v2 interface every sidecar:
an indexer, SWA, Mamba or DeepSeek-V4 pool) has its own record shape, so its own
engines (slots of its page's size), its own store view (its layout) and its own catalog
(`NamespaceView` of its namespace, listed again every `rescan_s`). Every pool's record
of a page is keyed by the same SGLang page key; the pool's name and geometry go into
the layout fingerprint, so the pools' records never stand in for each other.

`read` and `write` are the v1 paths of one pool (see the backend's module doc): a page
is read only once verified in place, a stalled direct read keeps the call until the
kernel returns the page (`hold`), pages already stored are not written again.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch

from bsr_io._core import Engine
from bsr_io.integrations.sglang.config import Settings
from bsr_io.integrations.sglang.identity import RankIdentity
from bsr_io.integrations.sglang.pages import HostPages, PoolPages
from bsr_io.load.discovery import sources_of
from bsr_io.load.memory import HostMemory, register_memory
from bsr_io.load.records import LoadOptions, windowed_install
from bsr_io.model.keys import ChunkKey
from bsr_io.save.records import save_records
from bsr_io.store import Store, open_store
from bsr_io.tiers.base import Tier
from bsr_io.tiers.files.fresh import NamespaceView

logger = logging.getLogger("bsr_io.integrations.sglang.backend")


class PoolGroup:
    """The records of one registered host pool. ValueError (naming what does not fit)
    for a pool whose pages cannot be read."""

    def __init__(self, name: str, pool: Any, settings: Settings, identity: RankIdentity) -> None:
        s = self.settings = settings
        self.name, self.pool, self.identity = name, pool, identity
        self.pages = pages = PoolPages.of(pool, name)
        layout = pages.layout
        backend = None if s.io_backend == "auto" else s.io_backend
        nbytes = layout.chunk_bytes
        self.read_engine = Engine(s.window, nbytes, queue_depth=s.queue_depth, backend=backend)
        self.write_engine = Engine(s.window, nbytes, queue_depth=s.queue_depth, backend=backend)
        self.memory: HostMemory | None = None  # the pool's owner, registered
        self.read_lock = threading.Lock()  # the read engine's W slots serve one batch
        ssd: str | list[str] = s.store_dirs[0] if len(s.store_dirs) == 1 else list(s.store_dirs)
        store = open_store(
            self.write_engine, ssd, layout=layout, ssd_bytes=s.capacity, lower_dir=s.lower_dir
        )
        mooncake: Tier | None = None
        if s.mooncake is not None:
            from bsr_io.tiers.mooncake import MooncakeTier  # imports Mooncake only here

            mooncake = MooncakeTier(s.mooncake, layout=layout)
            store = Store([*store.tiers, mooncake])
        self.store = store
        self.fingerprint = layout.fingerprint()
        if s.direct_reads:
            # Once: the kernel pins the pool's pages now, not per read. The pool's memory
            # has one owner (memory.py): every batch's pages are a view of it.
            bufs: list[Any] = list(pages.views)  # numpy arrays: buffers to the engine
            why = "the kernel refused it"
            try:
                self.memory = register_memory(self.read_engine, bufs)
            except TimeoutError as exc:
                why = str(exc)
            if self.memory is None or self.memory.registration(self.read_engine) is None:
                logger.info(
                    "bsr HiCache: %s memory not registered (%s); reads still direct", name, why
                )
        ours = self.key("").namespace()  # model, world, rank, layout (the pool's own)
        dirs = [Path(d) / "chunks" for d in s.store_dirs]
        if s.lower_dir is not None:
            dirs.append(Path(s.lower_dir) / "chunks")
        self.catalog = catalog = NamespaceView(dirs, ours)
        if mooncake is not None:  # a pool no listing sees: its records are pinned
            for k in mooncake.keys():
                if k.namespace() == ours:
                    catalog.saved(k.chunk_hash, pinned=True)
        catalog.start(s.rescan_s)
        logger.info(
            "bsr HiCache: pool %s, %s, %d records of %d bytes held, W=%d, engine %s",
            name,
            layout.name,
            len(catalog),
            nbytes,
            s.window,
            self.read_engine.backend,
        )

    def key(self, page_key: str) -> ChunkKey:
        return self.identity.key(page_key, self.fingerprint)

    def held(self, keys: Sequence[str]) -> list[bool]:
        """Whether this pool's record of each page is in the catalog (no system call)."""
        hashes = self.catalog.hashes()
        return [self.key(k).chunk_hash in hashes for k in keys]

    def leading(self, keys: Sequence[str]) -> int:
        return self.catalog.leading([self.key(k).chunk_hash for k in keys])

    def forget(self, keys: Sequence[ChunkKey]) -> None:
        """Pages no tier delivered leave the catalog (a record that was only slow is
        found again by the next listing or write)."""
        for k in keys:
            self.catalog.forget(k.chunk_hash)

    # -- reads --------------------------------------------------------------------------
    def read(
        self,
        keys: list[str],
        host_indices: torch.Tensor,
        deadline: float,
        hold: Callable[[HostPages], None],
        count: Callable[..., None],
    ) -> int:
        """How many leading pages landed verified in the pool. `hold(dest)` returns only
        once the kernel owns none of the batch's pages."""
        if not keys:
            return 0
        ckeys = [self.key(k) for k in keys]
        runs = self.pages.page_runs(host_indices)
        if len(runs) != len(keys):
            raise ValueError(f"{len(keys)} keys for {len(runs)} pages of {self.name} indices")
        tiers = list(self.store.tiers)
        sources = sources_of(tiers, ckeys)  # metadata only: the leading pages held
        if not sources:
            self.forget(ckeys[:1])
            return 0
        n = len(sources)
        dest = HostPages(self.pages, runs[:n], self.settings.direct_reads)
        try:
            with self.read_lock:
                report, error = windowed_install(
                    self.read_engine,
                    tiers,
                    ckeys[:n],
                    sources,
                    dest,
                    LoadOptions(deadline=deadline),
                    self.read_engine.slot_bytes,
                    self.read_engine.window,
                )
        finally:
            # However the load ended (an exception too: SGLang then frees every page of
            # the batch), no page goes back while the kernel may still write it.
            hold(dest)
        # The window installs in order: its first `installed` pages are in place and
        # verified; a failure or a timeout stops it at the page that failed.
        ok = report.installed if report is not None else 0
        if report is not None and (report.failed_chunks or report.unusable):
            ok = min(ok, *report.failed_chunks, *report.unusable)
        if error and ok >= n:
            ok = 0  # an error the report does not place: trust no page
        count(
            get_pages=len(keys),
            get_ok=ok,
            get_failed=len(keys) - ok,
            direct_pages=report.direct if report is not None else 0,
        )
        if ok < len(keys):
            self.forget(ckeys[ok : ok + 1])  # the page that failed, or that no tier held
            if error:
                logger.warning(
                    "bsr HiCache: %s: %d of %d pages read: %s", self.name, ok, len(keys), error
                )
        return ok

    # -- writes -------------------------------------------------------------------------
    def write(
        self, keys: list[str], host_indices: torch.Tensor, count: Callable[..., None]
    ) -> list[bool]:
        """Each page stored (or already held); a non-writer rank answers True (the
        writer rank stores the shared record)."""
        if not keys:
            return []
        count(set_pages=len(keys))
        if not self.identity.writer:
            return [True] * len(keys)
        runs = self.pages.page_runs(host_indices)
        if len(runs) != len(keys):
            raise ValueError(f"{len(keys)} keys for {len(runs)} pages of {self.name} indices")
        ckeys = [self.key(k) for k in keys]
        todo = [i for i, k in enumerate(ckeys) if k.chunk_hash not in self.catalog]
        result = [True] * len(keys)
        if not todo:
            return result
        failed: dict[int, BaseException] = {}

        def done(i: int, error: BaseException | None) -> None:
            if error is not None:
                failed[i] = error

        layout = self.pages.layout
        written = save_records(
            self.write_engine,
            self.store,
            [ckeys[i] for i in todo],
            [layout] * len(todo),
            HostPages(self.pages, [runs[i] for i in todo], direct_reads=False),
            deadline=time.monotonic() + self.settings.timeout_s,
            on_done=done,
        )
        pooled = self.settings.mooncake is not None  # also in a pool no listing sees
        for j, i in enumerate(todo):
            if j in failed:
                result[i] = False
            else:
                self.catalog.saved(ckeys[i].chunk_hash, pinned=pooled)
        if failed:
            first = next(iter(failed.values()))
            logger.warning(
                "bsr HiCache: %s: %d of %d pages not stored: %s",
                self.name,
                len(failed),
                len(todo),
                first,
            )
        count(set_written=written)
        return result

    # -- the rest -----------------------------------------------------------------------
    def clear(self) -> None:
        """Remove this pool's records of this rank."""
        ours = self.key("")
        for k in self.store.keys():
            if (k.model, k.world_size, k.rank, k.layout_fingerprint) == (
                ours.model,
                ours.world_size,
                ours.rank,
                ours.layout_fingerprint,
            ):
                self.store.remove(k)
        self.catalog.clear()

    def close(self) -> None:
        self.catalog.close()  # its thread lists the store: stopped first
        self.store.close()
        if self.memory is not None:
            self.memory.unregister(self.read_engine)
        for e in (self.read_engine, self.write_engine):
            e.close()
