"""`BsrHiCacheStorage`: bsr-io's store as SGLang HiCache's storage tier (interfaces v1, v2).

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
- v2 (hybrid models): every registered host pool is its own allocator group
  (`PoolGroup`); `batch_exists_v2` folds the pools' hit policies (`hybrid.fold_hits`),
  `batch_get_v2` cuts every pool at the first page any pool (or the KV read just
  before) failed, each pool's read bounded by its own `timeout_s` and held, as v1's
  is, until the kernel returns its pages; `batch_set_v2` counts a page stored only when
  every pool's record is.
- `batch_set_v1`: pages already stored are `True` at once; the others are gathered
  into slots and written crash-safe (temp file, fdatasync, rename). Only the storage
  writer writes (MLA: one rank); the others report `True` (the writer holds them).
"""

from __future__ import annotations

import logging
import os
import threading
import time
from typing import Any

import torch
from sglang.srt.mem_cache.hicache_storage import HiCacheStorage, PoolTransferResult

from bsr_io.integrations.sglang.config import Settings
from bsr_io.integrations.sglang.group import PoolGroup
from bsr_io.integrations.sglang.hybrid import PoolQuery, commit_cut, fold_hits, stored_together
from bsr_io.integrations.sglang.identity import RankIdentity
from bsr_io.integrations.sglang.pages import HostPages, PoolPages
from bsr_io.load.memory import owned_by_kernel, wait_returned
from bsr_io.load.window import chunk_ranges
from bsr_io.model.keys import ChunkKey
from bsr_io.store import Store

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
        self._config = storage_config
        self.identity = RankIdentity.of(storage_config, s.model)
        # Every pool served, by SGLang's name: "kv" (the anchor, unless it is logical
        # and holds no bytes: DeepSeek-V4) and each sidecar registered through v2.
        self.groups: dict[str, PoolGroup] = {}
        self._logical_kv = False
        self._lock = threading.Lock()
        # Batches waiting for the kernel to return pages of reads given up: while any
        # is, batch_exists answers 0 (no new load into any pool).
        self._kernel_waits = 0
        self.stats: dict[str, int] = dict.fromkeys(
            ("get_pages", "get_ok", "get_failed", "direct_pages", "set_pages", "set_written"), 0
        )

    # -- set-up -------------------------------------------------------------------------
    def register_mem_pool_host(self, mem_pool_host: Any) -> None:
        """Open the engines and the store for the anchor pool's pages; ValueError
        (naming what does not fit) for a pool whose pages the backend cannot read. A
        logical anchor (DeepSeek-V4's: indices only, its bytes in the v2 pools) opens
        nothing."""
        super().register_mem_pool_host(mem_pool_host)
        if getattr(mem_pool_host, "kv_buffer", None) is None and _is_logical(mem_pool_host):
            self._logical_kv = True
            logger.info("bsr HiCache: logical KV anchor; its pages live in the v2 pools")
            return
        self._open("kv", mem_pool_host)

    def register_mem_host_pool_v2(self, host_pool: Any, host_pool_name: Any) -> None:
        """A sidecar pool (at attach, or added later): its own allocator group."""
        super().register_mem_host_pool_v2(host_pool, host_pool_name)
        name = str(host_pool_name)
        if name == "kv":
            if "kv" not in self.groups and not self._logical_kv:
                self._open("kv", host_pool)
            return
        if getattr(host_pool, "get_page_buffer_meta", None) is None:
            raise ValueError(f"host pool {name!r} ({type(host_pool).__name__}) has no pages")
        self._open(name, host_pool)

    def _open(self, name: str, pool: Any) -> None:
        old = self.groups.get(name)
        # Mamba states are per TP rank even beside MLA's shared KV (SGLang backs them
        # up on every rank).
        identity = RankIdentity.of(self._config, self.settings.model, tp_sharded=name == "mamba")
        self.groups[name] = PoolGroup(name, pool, self.settings, identity)
        if old is not None:
            old.close()

    def on_host_pools_registered(self) -> None:
        """SGLang's attach is done registering pools: each was opened (or refused,
        naming it) as it came; say what is served."""
        logger.info("bsr HiCache: pools %s", sorted(self.groups))

    # The anchor pool's group, as the v1 calls and the tests see it.
    @property
    def pages(self) -> PoolPages | None:
        g = self.groups.get("kv")
        return g.pages if g is not None else None

    @property
    def store(self) -> Store | None:
        g = self.groups.get("kv")
        return g.store if g is not None else None

    def _key(self, page_key: str, pool: str = "kv") -> ChunkKey:
        return self.groups[pool].key(page_key)

    # -- the v1 interface ---------------------------------------------------------------
    def batch_exists(self, keys: list[str], extra_info: Any = None) -> int:
        try:
            with self._lock:
                if self._kernel_waits:
                    return 0  # unhealthy: a given-up read may still write a pool
            kv = self.groups.get("kv")
            if kv is not None:
                return kv.leading(keys)
            if self._logical_kv and self.groups:
                # No KV bytes: the pages every pool holds (v2's query is the real one).
                return min(g.leading(keys) for g in self.groups.values())
            return 0
        except Exception:
            logger.exception("bsr HiCache: batch_exists failed; reporting no hit")
            return 0

    def batch_get_v1(
        self, keys: list[str], host_indices: torch.Tensor, extra_info: Any = None
    ) -> list[bool]:
        if self._logical_kv:
            return [True] * len(keys)  # no KV bytes; the v2 pools carry the page
        try:
            kv = self.groups.get("kv")
            ok = 0
            if kv is not None:
                deadline = time.monotonic() + self.settings.timeout_s
                ok = kv.read(list(keys), host_indices, deadline, self._until_returned, self._count)
        except Exception:
            logger.exception("bsr HiCache: batch_get_v1 failed; no page reported")
            ok = 0
        return [i < ok for i in range(len(keys))]

    def batch_set_v1(
        self, keys: list[str], host_indices: torch.Tensor, extra_info: Any = None
    ) -> list[bool]:
        if self._logical_kv:
            return [True] * len(keys)  # no KV bytes; the v2 pools carry the page
        try:
            kv = self.groups.get("kv")
            if kv is None:
                return [False] * len(keys)
            return kv.write(list(keys), host_indices, self._count)
        except Exception:
            logger.exception("bsr HiCache: batch_set_v1 failed; no page stored")
            return [False] * len(keys)

    # -- the v2 interface: every pool of a page under one commit ------------------------
    def batch_exists_v2(
        self, keys: list[str], pool_transfers: Any = None, extra_info: Any = None
    ) -> PoolTransferResult:
        """The prefixes on which every pool's policy holds, from the catalogs only."""
        try:
            with self._lock:
                if self._kernel_waits:
                    return PoolTransferResult(0, {}, [])
            keys = list(keys)
            kv = self.groups.get("kv")
            kv_pages = len(keys) if self._logical_kv else (kv.leading(keys) if kv else 0)
            queries = []
            for t in pool_transfers or []:
                name = str(t.name)
                g = self.groups.get(name)
                queries.append(
                    PoolQuery(
                        name,
                        str(getattr(t.hit_policy, "value", t.hit_policy)),
                        g.held(keys[:kv_pages]) if g is not None else [],
                        window=len(t.keys) if t.keys else 1,
                        group_pages=int(t.group_pages or 1),
                    )
                )
            hits = fold_hits(kv_pages, queries)
            return PoolTransferResult(hits.kv_pages, hits.pool_pages, hits.restorable)
        except Exception:
            logger.exception("bsr HiCache: batch_exists_v2 failed; reporting no hit")
            return PoolTransferResult(0, {}, [])

    def batch_get_v2(self, transfers: list[Any], extra_info: Any = None) -> dict[str, list[bool]]:
        """Every pool's pages read and verified in place; the first page any pool
        fails ends the batch for every pool."""
        named = {str(t.name): list(t.keys or []) for t in transfers}
        done = dict.fromkeys(named, 0)
        try:
            chain = max(named.values(), key=len, default=[])
            at = {k: i for i, k in enumerate(chain)}
            kv = self.groups.get("kv")
            # The KV pool's pages come through v1 just before (SGLang's order); a page
            # it failed left its catalog then, so the same batch ends there for every
            # pool here too.
            cut = kv.leading(chain) if kv is not None and "kv" not in named else len(chain)
            # The longest pools first: a failure found early shortens every later read.
            for t in sorted(transfers, key=lambda t: -len(t.keys or [])):
                name, ks = str(t.name), named[str(t.name)]
                g = self.groups.get(name)
                if g is None:
                    logger.warning("bsr HiCache: batch_get_v2 for unregistered pool %r", name)
                    cut = 0
                    break
                want = sum(1 for k in ks if at.get(k, cut) < cut)  # pages before the cut
                if want and t.host_indices is not None:
                    per = g.pages.page_size
                    if t.host_indices.numel() != len(ks) * per:
                        raise ValueError(
                            f"{name}: {t.host_indices.numel()} host indices for {len(ks)} pages"
                        )
                    # Each pool's read has its own `timeout_s`, as the KV's v1 read
                    # has: a pool held for the kernel (a stall) has spent the batch's
                    # time, and the pages before its cut must still land in the rest.
                    done[name] = g.read(
                        ks[:want],
                        t.host_indices[: want * per],
                        time.monotonic() + self.settings.timeout_s,
                        self._until_returned,
                        self._count,
                    )
                if done[name] < len(ks):
                    cut = min(cut, at.get(ks[done[name]], 0))
            verdict = commit_cut(named, done)
            return {
                n: [v and at.get(k, -1) < cut for k, v in zip(named[n], verdict[n], strict=True)]
                for n in named
            }
        except Exception:
            logger.exception("bsr HiCache: batch_get_v2 failed; no page reported")
            return {n: [False] * len(k) for n, k in named.items()}

    def batch_set_v2(self, transfers: list[Any], extra_info: Any = None) -> dict[str, list[bool]]:
        """Every pool's records written; a page is stored only when every pool's
        record of it is published."""
        named = {str(t.name): list(t.keys or []) for t in transfers}
        ok: dict[str, list[bool]] = {}
        for t in transfers:
            name, ks = str(t.name), named[str(t.name)]
            try:
                g = self.groups.get(name)
                if g is None or t.host_indices is None:
                    raise ValueError(f"batch_set_v2: no registered pool {name!r} or no indices")
                ok[name] = g.write(ks, t.host_indices, self._count)
            except Exception:
                logger.exception("bsr HiCache: batch_set_v2: %s not stored", name)
                ok[name] = [False] * len(ks)
        return stored_together(named, ok)

    # -- kernel-owned pages ----------------------------------------------------------
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
        """Remove this rank's records of every pool (SGLang's flush of its cache)."""
        for g in self.groups.values():
            g.clear()

    def get_stats(self) -> None:
        return None  # SGLang's metrics object is its own backends'; see `stats`

    def close(self) -> None:
        for g in self.groups.values():
            g.close()


def _is_logical(pool: Any) -> bool:
    """A pool of indices only (DeepSeek-V4's KV anchor): SGLang gives it no page meta."""
    try:
        return pool.get_page_buffer_meta(torch.arange(int(pool.page_size))) is None
    except Exception:  # noqa: BLE001 - a real pool's meta may refuse these indices
        return False
