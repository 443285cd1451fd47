"""`BsrStoragePlugin`: LMCache 0.5.6 storage plugin serving chunks from bsr-io's SSD tier.

Loaded by LMCache's `storage_plugin_launcher` from config (see `config.py`). Chunks
are bsr-io records (header, checksum, atomic publish) in an `SSDTier`, read and
written by the Rust engine with O_DIRECT and io_uring, through bsr-io's one load and
save path (`load_records` / `save_records`): reads go through an engine of W slots,
W deep, installed (copied and verified in one pass) into LMCache L1 memory objects
allocated with `busy_loop=False`, so a get can fail but never spins; puts are
written W at a time through a second engine of W slots.

Rules kept toward LMCache's retrieve:
- `batched_get_blocking` returns a contiguous prefix of filled objects and None from
  the first failure on; an object is returned only after its bytes were read and
  verified; nothing raises (errors become None and are logged).
- The record payload is the memory object's bytes as LMCache lays them out
  (`KV_2LTD`); the bsr-io layout here only sizes and fingerprints the records.

When `bsr.bounded_retrieve` is on (the default) the plugin also routes its engine's
`retrieve` through `retrieve.BoundedRetriever` (W chunks staged at a time, all or
nothing): the engine is found as the `LMCacheEngine` whose config object this plugin
was built with.
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
import queue
import threading
import time
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

import numpy as np
from lmcache.utils import CacheEngineKey
from lmcache.v1.memory_management import MemoryFormat, MemoryObj
from lmcache.v1.storage_backend.abstract_backend import StoragePluginInterface

from bsr_io._core import Engine
from bsr_io.errors import BsrValueError, ChunkError, LayoutError
from bsr_io.integrations.lmcache import retrieve
from bsr_io.integrations.lmcache.config import Settings
from bsr_io.load.kvcache import HostBuffers
from bsr_io.load.records import LoadOptions, load_records
from bsr_io.model.keys import ChunkKey
from bsr_io.model.layout import AllocatorGroup, KVLayout
from bsr_io.save.records import save_records
from bsr_io.store import Store
from bsr_io.tiers.base import Tier
from bsr_io.tiers.ssd import SSDTier

if TYPE_CHECKING:
    # LMCache ships no types: its classes name the seam and read as Any (see pyproject).
    from lmcache.v1.config import LMCacheEngineConfig
    from lmcache.v1.metadata import LMCacheMetadata
    from lmcache.v1.storage_backend.local_cpu_backend import LocalCPUBackend

logger = logging.getLogger(__name__)

# What LMCache calls back with once a put's record is stored.
PutCallback = Callable[[CacheEngineKey], None]
L1_WAIT_S = 2.0  # longest wait for L1 room to stage a chunk a get was asked for
# A queued put: the key, its L1 object (one reference held by the plugin), the callback.
Put = tuple[CacheEngineKey, MemoryObj, PutCallback | None]


def layout_from_metadata(metadata: LMCacheMetadata) -> KVLayout:
    """bsr-io layout with one group per LMCache KV group, sized like LMCache's chunks."""
    ct = metadata.chunk_size
    groups: list[AllocatorGroup] = []
    for i, (shape, dtype) in enumerate(
        zip(metadata.get_shapes(ct), metadata.get_dtypes(), strict=True)
    ):
        kv, layers, tokens, hidden = (int(d) for d in shape)
        if tokens != ct:
            raise LayoutError(
                f"LMCache KV group {i} has shape {tuple(shape)}: {tokens} tokens per chunk, "
                f"expected chunk_size {ct} (the kv_2LTD layout)"
            )
        groups.append(AllocatorGroup(f"lmcache{i}", dtype, (kv, layers, hidden), ct))
    return KVLayout("lmcache-kv2ltd", tuple(groups), ct)


# LMCache's base class is untyped (Any to mypy): subclassing it is the seam.
class BsrStoragePlugin(StoragePluginInterface):  # type: ignore[misc]
    def __init__(
        self,
        dst_device: str = "cpu",
        config: LMCacheEngineConfig | None = None,
        metadata: LMCacheMetadata | None = None,
        local_cpu_backend: LocalCPUBackend | None = None,
        loop: asyncio.AbstractEventLoop | None = None,
    ) -> None:
        super().__init__(dst_device, config, metadata, local_cpu_backend, loop)
        if config is None or metadata is None:
            raise BsrValueError("BsrStoragePlugin needs LMCache's config and metadata")
        if local_cpu_backend is None:
            raise BsrValueError(
                "BsrStoragePlugin stages reads in LMCache's L1: set max_local_cpu_size > 0"
            )
        if config.enable_async_loading or config.use_layerwise:
            raise BsrValueError(
                "BsrStoragePlugin serves LMCache's synchronous retrieve only "
                "(enable_async_loading and use_layerwise must be off)"
            )
        self.settings = Settings.from_extra_config(config.extra_config)
        self.layout = layout_from_metadata(metadata)
        self._fingerprint = self.layout.fingerprint()
        self._shapes = metadata.get_shapes(metadata.chunk_size)
        self._dtypes = metadata.get_dtypes()
        self._fmt = MemoryFormat.KV_MLA_FMT if metadata.use_mla else MemoryFormat.KV_2LTD
        s = self.settings
        backend = None if s.io_backend == "auto" else s.io_backend
        cb = self.layout.chunk_bytes
        self.read_engine = Engine(s.window, cb, queue_depth=s.queue_depth, backend=backend)
        self.write_engine = Engine(s.window, cb, queue_depth=s.queue_depth, backend=backend)
        self.tier: Tier = SSDTier(s.path, s.capacity, self.write_engine, layout=self.layout)
        # Counted from the listing: keys() would read every record's header.
        held = self.tier.stats()["records"]
        if s.mooncake is not None:
            # A shared pool below the SSD tier: written through, read where L2 misses.
            from bsr_io.tiers.mooncake import MooncakeTier

            self.tier = Store([self.tier, MooncakeTier(s.mooncake, layout=self.layout)])
        self._pending: set[CacheEngineKey] = set()
        self._pending_lock = threading.Lock()
        self._read_lock = threading.Lock()  # the read engine's W slots serve one get at a time
        # Why the last get delivered fewer chunks than asked (a retrieve that then falls
        # short says so in its reason).
        self.last_short_get = ""
        self._queue: queue.Queue[Put | None] = queue.Queue()  # None: stop the writer
        self._writer = threading.Thread(target=self._write_loop, name="bsr-io-put", daemon=True)
        self._writer.start()
        self.retriever = self._install_bounded_retrieve() if s.bounded_retrieve else None
        logger.info(
            "bsr-io plugin: tier %s (%d records), W=%d, engine backend %s, bounded retrieve %s",
            s.path,
            held,
            s.window,
            self.read_engine.backend,
            "on" if self.retriever else "off",
        )

    def __str__(self) -> str:
        return "BsrStoragePlugin"

    # -- keys ---------------------------------------------------------------------------
    def chunk_key(self, key: CacheEngineKey) -> ChunkKey:
        """bsr-io key for an LMCache key: its string form (model, ranks, hash, dtype,
        tags) hashed to 128 bits, so every field LMCache distinguishes keeps records apart."""
        digest = hashlib.blake2b(key.to_string().encode(), digest_size=16, person=b"bsr-lmc")
        return ChunkKey(
            key.model_name,
            key.world_size,
            key.worker_id,
            self._fingerprint,
            int.from_bytes(digest.digest(), "little"),
        )

    # -- discovery ----------------------------------------------------------------------
    def contains(self, key: CacheEngineKey, pin: bool = False) -> bool:
        try:
            return self.tier.contains(self.chunk_key(key))
        except Exception:
            logger.exception("bsr-io plugin: contains failed")
            return False

    def batched_contains(self, keys: list[CacheEngineKey], pin: bool = False) -> int:
        n = 0
        for key in keys:
            if not self.contains(key, pin):
                break
            n += 1
        return n

    def exists_in_put_tasks(self, key: CacheEngineKey) -> bool:
        with self._pending_lock:
            return key in self._pending

    # Records are files; lookup pins have nothing to hold in memory. Capacity eviction
    # is LRU in the tier, and a restore that loses a chunk to it gets zero reuse.
    def pin(self, key: CacheEngineKey) -> bool:
        return self.contains(key)

    def unpin(self, key: CacheEngineKey) -> bool:
        return self.contains(key)

    # -- reads --------------------------------------------------------------------------
    def get_blocking(self, key: CacheEngineKey) -> MemoryObj | None:
        return self.batched_get_blocking([key])[0]

    def batched_get_blocking(self, keys: list[CacheEngineKey]) -> list[MemoryObj | None]:
        with self._read_lock:
            return self._get_prefix(keys)

    def _get_prefix(self, keys: list[CacheEngineKey]) -> list[MemoryObj | None]:
        """The leading stored chunks of `keys`, each in a fresh L1 object, up to the first
        that no tier can deliver verified (every bad record the load met is withdrawn)."""
        tiers = self.tier.tiers if isinstance(self.tier, Store) else [self.tier]
        ckeys = [self.chunk_key(k) for k in keys]
        objs: list[MemoryObj] = []
        self.last_short_get = ""
        try:
            for t in tiers:
                t.prepare_probe(ckeys)
            # The leading chunks some tier holds (metadata only), each with L1 room.
            while len(objs) < len(keys):
                if not any(_holds(t, ckeys[len(objs)]) for t in tiers):
                    self._short(f"chunk {len(objs)} of {len(keys)} is in no tier")
                    break
                obj = self._allocate()
                if obj is None:
                    self._short(f"L1 has no room to stage chunk {len(objs)} of {len(keys)}")
                    break
                objs.append(obj)
            if objs:
                bufs = [np.frombuffer(o.byte_array, dtype=np.uint8) for o in objs]
                res = load_records(
                    self.read_engine,
                    tiers,
                    ckeys[: len(objs)],
                    HostBuffers(bufs),
                    LoadOptions(
                        deadline=time.monotonic() + self.settings.timeout_s,
                        chunk_bytes=self.layout.chunk_bytes,
                        width=self.settings.window,
                        keep_going=True,
                    ),
                )
                del bufs
                if not res.complete:
                    # Chunks before the first failed one were installed and verified:
                    # LMCache takes that prefix (its retrieve then decides). Any other
                    # failure (a timeout) leaves nothing trustworthy.
                    good = min(res.failed_chunks) if res.failed_chunks else 0
                    self._short(f"load of {len(objs)} chunks kept {good}: {res.reason}")
                    for obj in objs[good:]:
                        obj.ref_count_down()
                    objs = objs[:good]
        except Exception as exc:
            if isinstance(exc, ChunkError):
                self._short(str(exc))
            else:
                logger.exception("bsr-io plugin: read failed")
                self.last_short_get = f"read failed: {type(exc).__name__}: {exc}"
            for obj in objs:
                obj.ref_count_down()
            objs = []
        return [*objs, *([None] * (len(keys) - len(objs)))]

    def _allocate(self) -> MemoryObj | None:
        """An L1 object for one chunk. L1 can be full for a moment of objects that puts
        in flight still hold (they are released as their records land): wait for room
        a little, bounded, rather than report a stored chunk as missing."""
        deadline = time.monotonic() + min(L1_WAIT_S, self.settings.timeout_s)
        while True:
            obj = self.local_cpu_backend.allocate(
                self._shapes, self._dtypes, self._fmt, eviction=True, busy_loop=False
            )
            if obj is not None or time.monotonic() >= deadline:
                return obj
            time.sleep(0.002)

    def _short(self, why: str) -> None:
        self.last_short_get = why
        logger.warning("bsr-io plugin: %s", why)

    # -- writes -------------------------------------------------------------------------
    def batched_submit_put_task(
        self,
        keys: Sequence[CacheEngineKey],
        objs: list[MemoryObj],
        transfer_spec: Any = None,
        on_complete_callback: PutCallback | None = None,
    ) -> None:
        for key, obj in zip(keys, objs, strict=False):
            if obj.get_size() != self.layout.chunk_bytes:
                continue  # a partial last chunk: bsr-io keeps whole chunks only
            with self._pending_lock:
                if key in self._pending:
                    continue
                self._pending.add(key)
            obj.ref_count_up()  # LMCache drops its reference when this call returns
            self._queue.put((key, obj, on_complete_callback))

    def _write_loop(self) -> None:
        """Writes what `batched_submit_put_task` queued, up to W records at once through
        the write engine's W slots (the one save path)."""
        while True:
            items = [self._queue.get()]
            while len(items) < self.settings.window and not self._queue.empty():
                items.append(self._queue.get_nowait())
            stop = any(item is None for item in items)
            batch = [item for item in items if item is not None]
            if batch:
                self._write_batch(batch)
            if stop:
                return

    def _write_batch(self, batch: list[Put]) -> None:
        def done(i: int, error: BaseException | None) -> None:
            key, obj, callback = batch[i]
            try:
                if error is not None:
                    logger.error("bsr-io plugin: could not store %s: %s", key.to_string(), error)
                elif callback is not None:
                    callback(key)
            except Exception:
                logger.exception("bsr-io plugin: put callback failed")

        try:
            bufs = [np.frombuffer(obj.byte_array, dtype=np.uint8) for _, obj, _ in batch]
            save_records(
                self.write_engine,
                self.tier,
                [self.chunk_key(k) for k, _, _ in batch],
                [self.layout] * len(batch),
                HostBuffers(bufs),
                skip_existing=False,
                deadline=time.monotonic() + self.settings.timeout_s,
                on_done=done,
            )
            del bufs
        except Exception:
            logger.exception("bsr-io plugin: could not store %d chunks", len(batch))
        finally:
            for key, obj, _ in batch:
                obj.ref_count_down()
                with self._pending_lock:
                    self._pending.discard(key)

    def flush(self, timeout_s: float = 60.0) -> None:
        """Wait until queued writes are on disk."""
        deadline = time.monotonic() + timeout_s
        while True:
            with self._pending_lock:
                if not self._pending:
                    return
            if time.monotonic() > deadline:
                raise TimeoutError("bsr-io plugin: writes did not finish in time")
            time.sleep(0.005)

    # -- management ---------------------------------------------------------------------
    def remove(self, key: CacheEngineKey, force: bool = True) -> bool:
        try:
            return self.tier.remove(self.chunk_key(key))
        except Exception:
            logger.exception("bsr-io plugin: remove failed")
            return False

    def get_allocator_backend(self) -> LocalCPUBackend:
        return self.local_cpu_backend  # puts then hand us LMCache's L1 objects, no copy

    def close(self) -> None:
        self._queue.put(None)
        self._writer.join(timeout=60)
        self.tier.close()
        self.read_engine.close()
        self.write_engine.close()

    def _install_bounded_retrieve(self) -> retrieve.BoundedRetriever | None:
        from lmcache.v1.cache_engine import LMCacheEngineBuilder

        engines = [e for e in LMCacheEngineBuilder._instances.values() if e.config is self.config]
        if len(engines) != 1:
            logger.warning(
                "bsr-io plugin: no LMCache engine owns this config; bounded retrieve not installed"
            )
            return None
        agreement = None
        if self.settings.agreement == "world":
            from bsr_io.commit import Agreement

            agreement = Agreement.from_process_group(None, self.settings.timeout_s)
        try:
            return retrieve.install(engines[0], self.settings.window, agreement)
        except ValueError as exc:
            logger.warning("bsr-io plugin: %s", exc)
            return None


def _holds(tier: Tier, key: ChunkKey) -> bool:
    try:
        return tier.contains(key)
    except Exception:
        return False  # a tier that cannot answer holds nothing for this get
