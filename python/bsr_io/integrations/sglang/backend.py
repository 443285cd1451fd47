"""`BsrHiCacheStorage`: bsr-io's store as SGLang HiCache's storage tier (interface v1).

SGLang builds it from `--hicache-storage-backend dynamic` and the extra config
(`cls(storage_config, kwargs)`), then calls `register_mem_pool_host(pool)`; the engines
and the store open there, once the page size is known. Every configuration error raises
on that path (SGLang's attach), naming the key. Its I/O calls run on SGLang's prefetch
and backup threads, where an exception or a None silently ends the storage tier for the
process: they always return, a failure being `False` (or 0 hits).

- `batch_exists`: the leading pages the in-memory catalog holds (no file-system call);
  0 while a given-up read may still write the pool (see below). The catalog is this
  rank's records by the store's one listing (`NamespaceView`), listed again every
  `rescan_s` on a thread: a rank that does not write (MLA) sees the writer's pages, and
  every rank sees records removed, within that interval.
- `batch_get_v1`: the leading pages some tier holds are read through the window of W,
  straight into the host pool's pages with O_DIRECT where the memory allows it (hashed
  where they landed), through a slot otherwise (hashed while copied). A page is `True`
  only once its bytes are verified in place; the first that fails or times out, and every
  page after it, is `False` (SGLang uses the leading run).
- A stalled direct read: at the deadline (`timeout_s`) it is given up, but the kernel
  still owns its pages and writes them when the device answers. SGLang frees a batch's
  `False` pages for reuse as soon as the call returns (the prefetch thread's last ack),
  so the call does not return while the kernel may write any of them: it waits for the
  kernel to return those pages (bounded by the device: the engine ends the read when the
  kernel completes it, on a real drive within the kernel's I/O timeout and its retries),
  answering `batch_exists` 0 meanwhile so that no new load is started. Past
  `KERNEL_RETURN_LOG_S` it says so in the log, and goes on waiting: it never hands SGLang
  a page the kernel may still write (an engine break-down leaves the read with the
  kernel for good: the prefetch thread then stays here, and the storage tier serves no
  more hits, which is safe, where returning would not be). No later load reads into a
  range the kernel owns, through whatever page view (`bsr_io.load.memory`).
- `batch_set_v1`: pages already stored are `True` at once; the others are gathered
  into slots and written crash-safe (temp file, fdatasync, rename). Only the storage
  writer writes (MLA: one rank); the others report `True` (the writer holds them).
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
from sglang.srt.mem_cache.hicache_storage import HiCacheStorage

from bsr_io._core import Engine, MemoryRegistration
from bsr_io.engine import REGISTER_TIMEOUT_S
from bsr_io.integrations.sglang.config import Settings
from bsr_io.integrations.sglang.identity import RankIdentity
from bsr_io.integrations.sglang.pages import HostPages, PoolPages
from bsr_io.load.discovery import sources_of
from bsr_io.load.memory import owned_by_kernel, wait_returned
from bsr_io.load.records import LoadOptions, windowed_install
from bsr_io.load.window import chunk_ranges
from bsr_io.model.keys import ChunkKey
from bsr_io.save.records import save_records
from bsr_io.store import Store, open_store
from bsr_io.tiers.base import Tier
from bsr_io.tiers.files.fresh import NamespaceView

logger = logging.getLogger(__name__)

# How long a batch waits for the kernel to return pages of a given-up read before it
# logs that it is still waiting (it never stops waiting: see the module doc).
KERNEL_RETURN_LOG_S = 30.0


class BsrHiCacheStorage(HiCacheStorage):  # type: ignore[misc]  # SGLang ships no types
    def __init__(self, storage_config: Any, kwargs: dict[str, Any] | None = None) -> None:
        extra = dict(getattr(storage_config, "extra_config", None) or {})
        if not extra.get("interface_v1"):
            raise ValueError(
                "the bsr HiCache backend serves the zero-copy v1 interface only: "
                'set "interface_v1": 1 in the extra_config'
            )
        self.settings = s = Settings.from_extra_config(extra)
        for d in s.store_dirs:
            if not os.path.isdir(d):
                raise ValueError(f"'store_dir' {d!r} is not a directory")
        if s.lower_dir is not None and not os.path.isdir(s.lower_dir):
            raise ValueError(f"'lower_dir' {s.lower_dir!r} is not a directory")
        self.identity = RankIdentity.of(storage_config, s.model)
        self.pages: PoolPages | None = None
        self.store: Store | None = None
        self._read_engine: Engine | None = None
        self._write_engine: Engine | None = None
        self._registration: MemoryRegistration | None = None
        self._fingerprint = ""
        self._catalog: NamespaceView | None = None  # this rank's records, by page hash
        self._lock = threading.Lock()
        self._read_lock = threading.Lock()  # the read engine's W slots serve one batch
        # Batches waiting for the kernel to return pages of reads given up: while any
        # is, batch_exists answers 0 (no new load into the pool).
        self._kernel_waits = 0
        self.stats: dict[str, int] = dict.fromkeys(
            ("get_pages", "get_ok", "get_failed", "direct_pages", "set_pages", "set_written"), 0
        )

    # -- set-up -------------------------------------------------------------------------
    def register_mem_pool_host(self, mem_pool_host: Any) -> None:
        """Open the engines and the store for this pool's pages; ValueError (naming what
        does not fit) for a pool whose pages the backend cannot read."""
        super().register_mem_pool_host(mem_pool_host)
        s = self.settings
        pages = PoolPages.of(mem_pool_host)
        layout = pages.layout
        backend = None if s.io_backend == "auto" else s.io_backend
        nbytes = layout.chunk_bytes
        self._read_engine = Engine(s.window, nbytes, queue_depth=s.queue_depth, backend=backend)
        self._write_engine = Engine(s.window, nbytes, queue_depth=s.queue_depth, backend=backend)
        ssd: str | list[str] = s.store_dirs[0] if len(s.store_dirs) == 1 else list(s.store_dirs)
        store = open_store(
            self._write_engine, ssd, layout=layout, ssd_bytes=s.capacity, lower_dir=s.lower_dir
        )
        pool: Tier | None = None
        if s.mooncake is not None:
            from bsr_io.tiers.mooncake import MooncakeTier  # imports Mooncake only here

            pool = MooncakeTier(s.mooncake, layout=layout)
            store = Store([*store.tiers, pool])
        self.pages, self.store, self._fingerprint = pages, store, layout.fingerprint()
        if s.direct_reads:
            try:  # once: the kernel pins the pool's pages now, not per read
                bufs: list[Any] = list(pages.views)  # numpy arrays: buffers to the engine
                self._registration = self._read_engine.register_memory(bufs, REGISTER_TIMEOUT_S)
            except (OSError, ValueError) as exc:
                logger.info("bsr HiCache: pool memory not registered (%s); reads still direct", exc)
        ours = self._key("").namespace()  # model, world, rank, layout
        dirs = [Path(d) / "chunks" for d in s.store_dirs]
        if s.lower_dir is not None:
            dirs.append(Path(s.lower_dir) / "chunks")
        catalog = NamespaceView(dirs, ours)
        if pool is not None:  # a pool no listing sees: its records are pinned
            for k in pool.keys():
                if k.namespace() == ours:
                    catalog.saved(k.chunk_hash, pinned=True)
        catalog.start(s.rescan_s)
        self._catalog = catalog
        logger.info(
            "bsr HiCache: %s, %d records of %d bytes held, W=%d, engine %s",
            layout.name,
            len(catalog),
            nbytes,
            s.window,
            self._read_engine.backend,
        )

    def on_host_pools_registered(self) -> None:
        """SGLang's attach is done registering pools: refuse sidecar pools (Mamba, SWA,
        indexer), whose v2 calls this backend does not serve, so the attach fails
        naming them instead of every prefetch finding no hit."""
        extra = sorted(str(n) for n in getattr(self, "registered_pools", {}) if str(n) != "kv")
        if extra:
            raise ValueError(
                f"the bsr HiCache backend stores the KV pool only; this model also has {extra}"
            )

    def _key(self, page_key: str) -> ChunkKey:
        return self.identity.key(page_key, self._fingerprint or "0" * 32)

    def _tiers(self) -> list[Tier]:
        assert self.store is not None
        return list(self.store.tiers)

    # -- the v1 interface ---------------------------------------------------------------
    def batch_exists(self, keys: list[str], extra_info: Any = None) -> int:
        try:
            with self._lock:
                if self._kernel_waits or self._catalog is None:
                    return 0  # unhealthy (a given-up read may still write the pool), or no pool
                return self._catalog.leading([self._key(k).chunk_hash for k in keys])
        except Exception:
            logger.exception("bsr HiCache: batch_exists failed; reporting no hit")
            return 0

    def batch_get_v1(
        self, keys: list[str], host_indices: torch.Tensor, extra_info: Any = None
    ) -> list[bool]:
        try:
            ok = self._get(list(keys), host_indices)
        except Exception:
            logger.exception("bsr HiCache: batch_get_v1 failed; no page reported")
            ok = 0
        return [i < ok for i in range(len(keys))]

    def batch_set_v1(
        self, keys: list[str], host_indices: torch.Tensor, extra_info: Any = None
    ) -> list[bool]:
        try:
            return self._set(list(keys), host_indices)
        except Exception:
            logger.exception("bsr HiCache: batch_set_v1 failed; no page stored")
            return [False] * len(keys)

    # -- reads and writes ---------------------------------------------------------------
    def _get(self, keys: list[str], host_indices: torch.Tensor) -> int:
        """How many leading pages landed verified in the host pool."""
        if not keys or self.pages is None or self._read_engine is None:
            return 0
        deadline = time.monotonic() + self.settings.timeout_s
        ckeys = [self._key(k) for k in keys]
        runs = self.pages.page_runs(host_indices)
        if len(runs) != len(keys):
            raise ValueError(f"{len(keys)} keys for {len(runs)} pages of host indices")
        tiers = self._tiers()
        sources = sources_of(tiers, ckeys)  # metadata only: the leading pages held
        if not sources:
            self._forget(ckeys[:1])
            return 0
        n = len(sources)
        dest = HostPages(self.pages, runs[:n], self.settings.direct_reads)
        opts = LoadOptions(deadline=deadline)
        try:
            with self._read_lock:
                report, error = windowed_install(
                    self._read_engine,
                    tiers,
                    ckeys[:n],
                    sources,
                    dest,
                    opts,
                    self._read_engine.slot_bytes,
                    self._read_engine.window,
                )
        finally:
            # However the load ended (an exception too: SGLang then frees every page of
            # the batch), no page goes back while the kernel may still write it.
            self._until_returned(dest)
        # The window installs in order: its first `installed` pages are in place and
        # verified; a failure or a timeout stops it at the page that failed.
        ok = report.installed if report is not None else 0
        if report is not None and (report.failed_chunks or report.unusable):
            ok = min(ok, *report.failed_chunks, *report.unusable)
        if error and ok >= n:
            ok = 0  # an error the report does not place: trust no page
        self._count(
            get_pages=len(keys),
            get_ok=ok,
            get_failed=len(keys) - ok,
            direct_pages=report.direct if report is not None else 0,
        )
        if ok < len(keys):
            self._forget(ckeys[ok : ok + 1])  # the page that failed, or that no tier held
            if error:
                logger.warning("bsr HiCache: %d of %d pages read: %s", ok, len(keys), error)
        return ok

    def _until_returned(self, dest: HostPages) -> None:
        """Return only once the kernel owns none of the batch's pages (reads given up
        may still write them): SGLang frees them when this batch answers. Unhealthy
        meanwhile (batch_exists 0); never gives up (see the module doc)."""
        ranges = [r for i in range(dest.capacity_chunks) for r in chunk_ranges(dest, i)]
        if owned_by_kernel(ranges) is None:
            return
        with self._lock:
            self._kernel_waits += 1
        try:
            waited = 0.0
            while not wait_returned(ranges, KERNEL_RETURN_LOG_S):
                waited += KERNEL_RETURN_LOG_S
                logger.error(
                    "bsr HiCache: a batch of %d host page(s) still owned by the kernel "
                    "%.0f s after reads into it were given up (a stalled device); holding "
                    "them from SGLang, and no new loads, until the kernel returns them",
                    dest.capacity_chunks,
                    waited,
                )
        finally:
            with self._lock:
                self._kernel_waits -= 1

    def _forget(self, keys: Sequence[ChunkKey]) -> None:
        """Drop pages no tier delivered from the catalog, so batch_exists stops
        offering them (a record that was only slow is found again by the next listing
        or write)."""
        if self._catalog is not None:
            for k in keys:
                self._catalog.forget(k.chunk_hash)

    def _set(self, keys: list[str], host_indices: torch.Tensor) -> list[bool]:
        catalog = self._catalog
        if (
            not keys
            or self.pages is None
            or self.store is None
            or self._write_engine is None
            or catalog is None
        ):
            return [False] * len(keys)
        self._count(set_pages=len(keys))
        if not self.identity.writer:
            return [True] * len(keys)  # MLA: the storage writer rank stores the page
        runs = self.pages.page_runs(host_indices)
        if len(runs) != len(keys):
            raise ValueError(f"{len(keys)} keys for {len(runs)} pages of host indices")
        ckeys = [self._key(k) for k in keys]
        todo = [i for i, k in enumerate(ckeys) if k.chunk_hash not in catalog]
        result = [True] * len(keys)
        if not todo:
            return result
        failed: dict[int, BaseException] = {}

        def done(i: int, error: BaseException | None) -> None:
            if error is not None:
                failed[i] = error

        layout = self.pages.layout
        written = save_records(
            self._write_engine,
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
                catalog.saved(ckeys[i].chunk_hash, pinned=pooled)
        if failed:
            first = next(iter(failed.values()))
            logger.warning(
                "bsr HiCache: %d of %d pages not stored: %s", len(failed), len(todo), first
            )
        self._count(set_written=written)
        return result

    def _count(self, **deltas: int) -> None:
        with self._lock:
            for k, v in deltas.items():
                self.stats[k] += v

    # -- the rest of SGLang's interface -------------------------------------------------
    def exists(self, key: str) -> bool:
        return self.batch_exists([key]) == 1

    def get(self, key: str, target_location: Any = None, target_sizes: Any = None) -> None:
        return None  # the v1 interface only (interface_v1 is required)

    def batch_get(
        self, keys: list[str], target_locations: Any = None, target_sizes: Any = None
    ) -> list[None]:
        return [None] * len(keys)

    def set(
        self, key: str, value: Any = None, target_location: Any = None, target_sizes: Any = None
    ) -> bool:
        return False

    def batch_set(
        self,
        keys: list[str],
        values: Any = None,
        target_locations: Any = None,
        target_sizes: Any = None,
    ) -> bool:
        return False

    def clear(self) -> None:
        """Remove this rank's records (SGLang's flush of its cache)."""
        if self.store is None:
            return
        ours = self._key("")
        for k in self.store.keys():
            if (k.model, k.world_size, k.rank, k.layout_fingerprint) == (
                ours.model,
                ours.world_size,
                ours.rank,
                ours.layout_fingerprint,
            ):
                self.store.remove(k)
        if self._catalog is not None:
            self._catalog.clear()

    def get_stats(self) -> None:
        return None  # SGLang's metrics object is its own backends'; see `stats`

    def close(self) -> None:
        if self._catalog is not None:
            self._catalog.close()  # its thread lists the store: stopped first
        if self.store is not None:
            self.store.close()
        if self._registration is not None:
            self._registration.close()
        for e in (self._read_engine, self._write_engine):
            if e is not None:
                e.close()
