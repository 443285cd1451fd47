"""A tier in a Mooncake Store pool (a distributed KV pool shared by a fleet).

One object per chunk record, named "<prefix>/<key namespace>/<chunk hash>", holding
the same bytes as a record file: the 4096-byte header, then the payload.

- Discovery: one `batch_is_exist` per probe (`probe`, or `prepare_probe` before
  discovery's per-chunk questions); metadata only, no payload read.
- Reads scatter the object into a small registered header buffer and straight into an
  engine slot (the engine's arena is registered with the client once), then the same
  key, layout and checksum checks as every tier. Nothing is staged outside the W slots
  but the 4 KiB headers. Where the window offers a host destination's blocks
  (`submit_read_into`, TCP only) the payload is scattered straight into them instead:
  no slot and no install copy; the window hashes it in place.
- Data calls run on `io_threads` threads at `io_priority` (low by default): Mooncake's
  client spins in the calling thread until its transfer ends, and at normal priority
  each spinning caller takes a core from the transfer engine and the verification.
- Writes gather header and payload from registered memory; Mooncake's put is
  write-once and silent, so an existing object is reported as already held.
- Every client call runs on a worker thread with a deadline (`timeout_s`): a silent
  storage node costs a chunk failure after the deadline, never a hang. A read past
  its deadline keeps its slot until the transfer engine gives up on it, so the slot
  is never reused while Mooncake may still write into it; a read into the
  destination is waited for until then (Mooncake's transfer timeout) before it fails.
- Objects are removed only on proof that they are bad (key, header, size, checksum).
  A timeout, a failed RPC or an unreachable node proves nothing: the chunk falls back
  for this restore, the tier reports itself down for `down_s`, and the objects stay.

The pool of threads the calls run on, with their deadlines, is `calls`; the memory
registered with the pool (header buffers, engine arenas, payloads) is `memory`.
"""

from __future__ import annotations

import socket
import time
import urllib.parse
from collections import OrderedDict
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
import numpy.typing as npt

from bsr_io._core import Engine, Slot
from bsr_io.errors import (
    ChunkCorrupt,
    ChunkError,
    ChunkMissing,
    ChunkReadError,
    ChunkWriteError,
    DestinationUnusable,
    LayoutError,
    TierDown,
    proves_bad,
)
from bsr_io.model.keys import ChunkKey
from bsr_io.model.layout import KVLayout
from bsr_io.model.record import (
    HEADER_BYTES,
    OldRecordFormat,
    RecordFormatError,
    RecordHeader,
    decode_header,
    make_header,
)
from bsr_io.tiers.base import (
    DirectChunk,
    DirectUnavailable,
    Payload,
    PendingChunk,
    Tier,
    check_payload,
    check_slot_fits,
)
from bsr_io.tiers.mooncake.calls import (
    INVALID_PARAMS,
    NO_HANDLE,
    NOT_FOUND,
    RPC_FAIL,
    RPC_TIMEOUT,
    TRANSFER_FAIL,
    Call,
    CallTimeout,
    Workers,
    code_name,
)
from bsr_io.tiers.mooncake.config import MooncakeConfig
from bsr_io.tiers.mooncake.memory import RegisteredMemory, run_addresses


def _check_reachable(config: MooncakeConfig) -> None:
    """TierDown unless the master (and an HTTP metadata server) accept a connection:
    `setup` holds the GIL while it retries an absent master for a minute and more."""
    targets = [("master", config.master)]
    meta = urllib.parse.urlsplit(config.metadata_server)
    if meta.scheme in ("http", "https") and meta.hostname:
        targets.append(("metadata server", f"{meta.hostname}:{meta.port or 80}"))
    for what, hostport in targets:
        host, _, port = hostport.rpartition(":")
        try:
            socket.create_connection((host.strip("[]"), int(port)), config.timeout_s).close()
        except OSError as exc:
            raise TierDown(f"cannot reach the Mooncake {what} at {hostport}", cause=exc) from None


def open_client(config: MooncakeConfig) -> Any:
    """A set-up `MooncakeDistributedStore`; TierDown when the pool cannot be reached."""
    try:
        from mooncake.store import MooncakeDistributedStore
    except ImportError as exc:
        raise ImportError(
            "the Mooncake tier needs the mooncake package: pip install 'bsr-io[mooncake]' "
            "(mooncake-transfer-engine-non-cuda for TCP, mooncake-transfer-engine for RDMA)"
        ) from exc
    _check_reachable(config)
    config.apply_env()
    client = MooncakeDistributedStore()
    rc = client.setup(config.setup_dict())
    if rc != 0:
        raise TierDown(
            f"cannot join the Mooncake pool (master {config.master}, metadata "
            f"{config.metadata_server}): setup returned {rc}"
        )
    return client


class MooncakeTier(Tier):
    """Chunk records as objects in a Mooncake Store pool. Thread-safe.

    `keys()` and `stats()["records"]` cover what this process wrote or read lately (the
    client cannot list the pool; at most INDEX_MAX keys). `layout` (optional) lets reads
    of its chunks skip a size query on the first read and check the group table as well.
    """

    INDEX_MAX = 1 << 16
    WITHDRAWN_MAX = 1 << 12

    def __init__(
        self,
        config: MooncakeConfig,
        *,
        layout: KVLayout | None = None,
        name: str = "L3",
        client: Any = None,
    ) -> None:
        super().__init__(name)
        self.config = config
        self._counts.update(exist_calls=0, timeouts=0, marked_down=0, arenas_unregistered=0)
        self._meta = Workers(2, f"bsr-mc-meta-{name}")
        # Data calls busy-poll for their transfer's end (Mooncake 0.3.13's
        # TransferEngineOperationState::wait_for_completion spins in the calling thread):
        # at low priority the spinning yields the cores to the transfer engine's own
        # threads and to verification, and several calls can be in flight at once.
        self._data = Workers(config.io_threads, f"bsr-mc-data-{name}", config.io_priority)
        try:
            self.client = client if client is not None else self._open(config)
        except BaseException:
            self._meta.stop()
            self._data.stop()
            raise
        self._replicas = self._replicate_config()
        self._memory = RegisteredMemory(
            self.client, name, lambda: self._count(arenas_unregistered=1)
        )
        self._headers = self._memory.headers
        self._layouts: dict[str, KVLayout] = {}
        self._payload_len: dict[str, int] = {}  # layout fingerprint -> payload bytes
        if layout is not None:
            self._learn(layout)
        # Seen here (LRU, at most INDEX_MAX): payload bytes.
        self._index: OrderedDict[ChunkKey, int] = OrderedDict()
        # Objects shown bad whose forced remove failed (at most WITHDRAWN_MAX, oldest
        # forgotten): not advertised here, removed before this tier writes the name again.
        self._withdrawn: OrderedDict[str, None] = OrderedDict()
        self._snapshot: dict[str, tuple[float, int]] = {}
        self._down_until = 0.0  # time.monotonic() before which the pool is not asked
        self._down_why = ""
        self._closed = False

    def _open(self, config: MooncakeConfig) -> Any:
        call = self._meta.submit(open_client, config)
        try:
            return call.wait(max(config.timeout_s, 30.0))  # start-up includes a handshake
        except CallTimeout:
            call.abandon()
            raise TierDown(f"no answer from the Mooncake master {config.master}") from None

    def _replicate_config(self) -> Any:
        from mooncake.store import ReplicateConfig

        rc = ReplicateConfig()
        rc.replica_num = self.config.replica_num
        return rc

    # -- names and calls ----------------------------------------------------------------
    def object_name(self, key: ChunkKey) -> str:
        return f"{self.config.key_prefix}/{key.namespace()}/{key.file_stem()}"

    def _learn(self, layout: KVLayout) -> None:
        fp = layout.fingerprint()
        with self._lock:
            self._layouts[fp] = layout
            self._payload_len[fp] = layout.chunk_bytes

    # -- down for a while ---------------------------------------------------------------
    def _mark_down(self, why: str) -> None:
        """The pool did not answer (or an RPC failed): stop asking it for `down_s`.
        Nothing is withdrawn for it; discovery finds nothing here meanwhile."""
        if self.config.down_s <= 0:
            return
        with self._lock:
            self._down_until = time.monotonic() + self.config.down_s
            self._down_why = why
            self._snapshot.clear()
        self._count(marked_down=1)

    def _check_up(self, key: ChunkKey | None = None) -> None:
        if self._closed:
            raise TierDown("the Mooncake tier is closed", key=key, tier=self.name)
        with self._lock:
            left, why = self._down_until - time.monotonic(), self._down_why
        if left > 0:
            raise TierDown(
                f"marked down for {left:.1f} s more after: {why}", key=key, tier=self.name
            )

    @property
    def down(self) -> bool:
        """Whether the tier is marked down now (it asks the pool again afterwards)."""
        with self._lock:
            return time.monotonic() < self._down_until

    def _meta_call(self, what: str, fn: Callable[..., Any], *args: Any) -> Any:
        """A metadata call with the tier's deadline; TierDown when the pool does not answer."""
        self._check_up()
        call = self._meta.submit(fn, *args)
        try:
            return call.wait(self.config.timeout_s)
        except CallTimeout:
            call.abandon()
            self._count(timeouts=1)
            why = f"{what}: no answer from the pool within {self.config.timeout_s} s"
            self._mark_down(why)
            raise TierDown(why, tier=self.name) from None

    def _exists(self, names: list[str]) -> list[int]:
        self._count(exist_calls=1)
        out = self._meta_call("existence check", self.client.batch_is_exist, names)
        if len(out) != len(names):
            raise TierDown(
                f"existence check answered {len(out)} of {len(names)} keys", tier=self.name
            )
        with self._lock:
            return [0 if n in self._withdrawn else int(r) for n, r in zip(names, out, strict=True)]

    # -- discovery ----------------------------------------------------------------------
    def prepare_probe(self, keys: Sequence[ChunkKey]) -> None:
        """One existence check for a request's keys; discovery's per-chunk `contains`
        questions that follow are answered from it for `snapshot_s`."""
        if not keys or self.config.snapshot_s <= 0:
            return
        names = [self.object_name(k) for k in keys]
        try:
            found = self._exists(names)
        except TierDown:
            return  # contains() asks again and reports the tier down
        now = time.monotonic()
        with self._lock:
            self._snapshot = {n: (now, r) for n, r in zip(names, found, strict=True)}

    def contains(self, key: ChunkKey, group: str | None = None) -> bool:
        name = self.object_name(key)
        with self._lock:
            seen = self._snapshot.get(name)
            if name in self._withdrawn:
                return False
        if seen is not None and time.monotonic() - seen[0] <= self.config.snapshot_s:
            r = seen[1]
        else:
            (r,) = self._exists([name])
        if r < 0:
            raise TierDown("existence check failed", key=key, tier=self.name)
        return r == 1

    def probe(self, keys: Sequence[ChunkKey], group: str | None = None) -> int:
        if not keys:
            return 0
        found = self._exists([self.object_name(k) for k in keys])
        n = 0
        for r in found:
            if r < 0:
                raise TierDown("existence check failed", key=keys[n], tier=self.name)
            if r != 1:
                self._count(misses=1)
                break
            n += 1
        return n

    def register_engine(self, engine: Engine) -> None:
        """Register `engine`'s staging arena with the pool now (reads do it on first use).
        Puts from its slots then register nothing: a payload outside a registered arena
        is registered and unregistered around its put, and each registration is a round
        trip to the metadata server, which, slow under load, fails the put."""
        self._memory.register_arena(engine)

    # -- reads --------------------------------------------------------------------------
    def _expected_len(self, key: ChunkKey, name: str) -> int:
        with self._lock:
            n = self._payload_len.get(key.layout_fingerprint)
        if n is not None:
            return n
        size = int(self._meta_call("size query", self.client.get_size, name))
        if size < 0:
            raise self._read_failure(key, name, size)
        if size <= HEADER_BYTES:
            raise self._corrupt(key, name, f"object is {size} bytes, not a chunk record")
        return size - HEADER_BYTES

    def submit_read(self, key: ChunkKey, engine: Engine) -> PendingChunk:
        name = self.object_name(key)
        with self._lock:
            if name in self._withdrawn:
                raise ChunkMissing("invalidated here", key=key, tier=self.name)
        self._check_up(key)
        self._memory.register_arena(engine)
        n = self._expected_len(key, name)
        check_slot_fits(self.name, engine, key, n)
        slot = engine.lease()  # NoFreeSlot / EngineClosedError: the caller's state
        try:
            slot.set_length(n)
            hdr = self._headers.take()
        except BaseException:
            del slot
            raise
        mem = self._memory
        call = self._data.submit(
            mem.tracked(mem.arena_of(slot.address), self.client.batch_get_into_multi_buffers),
            [name],
            [[hdr.ctypes.data, slot.address]],
            [[HEADER_BYTES, n]],
            hold=(slot, hdr),
            after=self._after_read,
        )
        deadline = time.monotonic() + self.config.timeout_s
        del slot, hdr  # from here the call owns them until it returns

        def finish(timeout: float | None) -> Slot:
            try:
                out = call.wait_by(deadline, timeout, key)
            except CallTimeout:
                call.abandon()  # its slot stays leased until the call returns
                self._count(timeouts=1)
                self._mark_down(f"a read got no answer within {self.config.timeout_s} s")
                raise ChunkReadError(
                    f"no answer from the pool within {self.config.timeout_s} s (storage node "
                    "stalled?); the slot is held until the transfer gives up",
                    key=key,
                    tier=self.name,
                ) from None
            except Exception as exc:  # noqa: BLE001 - the binding raised
                self._headers.give(call.take()[1])
                raise ChunkReadError(
                    "pool read raised", key=key, tier=self.name, cause=exc
                ) from exc
            return self._verify(key, name, n, call, out)

        return PendingChunk(key, finish, call.done)

    def _after_read(self, hold: tuple[Any, ...]) -> None:
        """An abandoned read returned: its header buffer goes back; its slot goes back to
        the ring as `hold` is dropped."""
        if len(hold) == 2:
            self._headers.give(hold[1])

    def _verify(self, key: ChunkKey, name: str, n: int, call: Call, out: list[int]) -> Slot:
        slot: Slot
        slot, hdr = call.take()  # the call has returned: its memory is ours again
        try:
            header = self._checked_header(key, name, n, out, hdr)
            if slot.checksum(0, n) != header.payload_xxh3:
                raise self._corrupt(key, name, "payload checksum mismatch")
        except BaseException:
            self._headers.give(hdr)
            del slot  # back to the ring now: a kept exception must not hold it
            raise
        self._headers.give(hdr)
        self._read_done(key, n)
        return slot

    def _checked_header(
        self, key: ChunkKey, name: str, n: int, out: list[int], hdr: npt.NDArray[np.uint8]
    ) -> RecordHeader:
        """The record header a read brought, checked against the key, the layout and the
        object's size (the payload's hash is the caller's); the chunk's error otherwise."""
        rc = int(out[0]) if out else RPC_FAIL
        if rc != HEADER_BYTES + n:
            raise self._read_failure(key, name, rc, expected=HEADER_BYTES + n)
        try:
            header = decode_header(hdr.tobytes())
        except OldRecordFormat as exc:
            self._forget(key)
            raise ChunkMissing(
                "object of an older record format", key=key, tier=self.name, cause=exc
            ) from None
        except RecordFormatError as exc:
            raise self._corrupt(key, name, f"bad header: {exc}") from None
        with self._lock:
            layout = self._layouts.get(key.layout_fingerprint)
        problem = header.check(key, layout)
        if problem is None and header.payload_len != n:
            problem = f"payload is {header.payload_len} bytes, object holds {n}"
        if problem:
            raise self._corrupt(key, name, problem)
        return header

    def _read_done(self, key: ChunkKey, n: int) -> None:
        with self._lock:
            self._payload_len.setdefault(key.layout_fingerprint, n)
        self._touch(key, n)
        self._count(hits=1, reads=1, bytes_read=n)

    def submit_read_into(
        self,
        key: ChunkKey,
        engine: Engine | None,
        bufs: Sequence[Any],
        runs: Sequence[tuple[int, int, int, int]],
        *,
        inflight: int | None = None,
    ) -> DirectChunk:
        """Read the object straight into the destination: its header into a registered
        4 KiB buffer and its payload into `bufs` along `runs` (`host_runs`: buffer index,
        offset in it, payload offset, length), in one scatter call; no slot. The caller
        hashes the payload in place against `expected_xxh3`, known once `wait()`
        returned. DirectUnavailable on an RDMA pool (it reads only into registered
        memory) or with `direct_reads` off; a LayoutError when the runs do not cover the
        payload exactly once. `inflight` is for drives (`SSDTier`): one Mooncake call
        moves the whole object.

        Past `timeout_s` (or given up by the caller, `abandon`) a call still queued
        behind others never runs: the chunk fails (ChunkReadError) with its blocks
        untouched. A call already running may still write the blocks until Mooncake
        gives the peer up, so the wait returns at the deadline with DestinationUnusable:
        the caller must not reuse those blocks; the call keeps the memory alive until it
        returns."""
        if self.config.protocol != "tcp" or not self.config.direct_reads:
            raise DirectUnavailable(f"{self.name}: reads go through the registered slots")
        name = self.object_name(key)
        with self._lock:
            if name in self._withdrawn:
                raise ChunkMissing("invalidated here", key=key, tier=self.name)
        self._check_up(key)
        n = self._expected_len(key, name)
        ptrs, sizes = run_addresses(bufs, runs, n, f"{self.name}: chunk {key.short()}")
        hdr = self._headers.take()
        call = self._data.submit(
            self.client.batch_get_into_multi_buffers,
            [name],
            [[hdr.ctypes.data, *ptrs]],
            [[HEADER_BYTES, *sizes]],
            hold=(hdr, tuple(bufs)),  # the destination's memory lives while the pool writes it
            after=self._after_direct,
        )
        deadline = time.monotonic() + self.config.timeout_s
        del hdr

        def finish(timeout: float | None) -> None:
            try:
                out = call.wait_by(deadline, timeout, key)
            except CallTimeout:
                raise self._stalled_direct(key, call) from None
            except Exception as exc:  # noqa: BLE001 - the binding raised
                self._headers.give(call.take()[0])
                raise ChunkReadError(
                    "pool read raised", key=key, tier=self.name, cause=exc
                ) from exc
            hdr_back, _ = call.take()
            try:
                header = self._checked_header(key, name, n, out, hdr_back)
            finally:
                self._headers.give(hdr_back)
            direct.expected_xxh3 = header.payload_xxh3
            self._read_done(key, n)

        direct = DirectChunk(
            key,
            finish,
            call.done,
            expected_xxh3=-1,  # set from the header the read brings
            reject=lambda why: self._corrupt(key, name, why),
            abandon=call.abandon,
        )
        return direct

    def _after_direct(self, hold: tuple[Any, ...]) -> None:
        """An abandoned direct read returned (or never ran): its header buffer goes back;
        the destination's buffers are let go as `hold` is dropped."""
        self._headers.give(hold[0])

    def _stalled_direct(self, key: ChunkKey, call: Call) -> ChunkError | DestinationUnusable:
        """A direct read past `timeout_s`, given up: a call that never started fails the
        chunk (its blocks untouched); a running one may still write the destination, so
        its blocks are reported unusable (DestinationUnusable). Nothing is withdrawn."""
        self._count(timeouts=1)
        why = f"a read got no answer within {self.config.timeout_s} s"
        self._mark_down(why)
        if not call.abandon():
            return DestinationUnusable(
                f"{why} (storage node stalled?) while the transfer writes the destination's "
                "blocks: they may still be written",
                key=key,
                tier=self.name,
            )
        return ChunkReadError(
            f"{why} (storage node stalled?); the read never started",
            key=key,
            tier=self.name,
        )

    def _read_failure(
        self, key: ChunkKey, name: str, rc: int, expected: int | None = None
    ) -> ChunkError:
        if rc >= 0:  # a short transfer: the object is not the record it should be
            return self._corrupt(key, name, f"object is {rc} bytes, expected {expected}")
        self._count(misses=1)
        if rc == NOT_FOUND:
            self._forget(key)
            return ChunkMissing(
                "no object in the pool", key=key, tier=self.name, cause=code_name(rc)
            )
        if rc in (INVALID_PARAMS, TRANSFER_FAIL) and expected is not None:
            # Both also mean "the object's size is not header + chunk": ask which it was.
            try:
                size = int(self._meta_call("size query", self.client.get_size, name))
            except TierDown:
                size = -1
            if size >= 0 and size != expected:
                return self._corrupt(
                    key, name, f"object is {size} bytes, a record of this chunk is {expected}"
                )
        if rc in (RPC_FAIL, RPC_TIMEOUT, TRANSFER_FAIL):
            # Says nothing about the object: this read falls back, the object stays.
            self._mark_down(f"pool read failed: {code_name(rc)}")
        if rc in (RPC_FAIL, RPC_TIMEOUT):
            return TierDown("pool RPC failed", key=key, tier=self.name, cause=code_name(rc))
        return ChunkReadError("pool read failed", key=key, tier=self.name, cause=code_name(rc))

    def _corrupt(self, key: ChunkKey, name: str, reason: str) -> ChunkCorrupt:
        """The object was shown bad (key, header, size, checksum): remove it."""
        self._withdraw(key, name, reason)
        return ChunkCorrupt(
            f"{reason}; object removed from the pool",
            key=key,
            tier=self.name,
            cause=name,
            record=name,
        )

    # -- writes -------------------------------------------------------------------------
    def write(self, key: ChunkKey, payload: Payload, layout: KVLayout) -> bool:
        if key.layout_fingerprint != layout.fingerprint():
            raise LayoutError(
                f"chunk {key.short()} was keyed for another layout than {layout.name}"
            )
        check_payload(payload, layout)
        self._learn(layout)
        name = self.object_name(key)
        with self._lock:
            withdrawn = name in self._withdrawn
        if withdrawn:
            # A bad copy must be gone before a put, which would keep it silently.
            try:
                rc = self._remove_name(name)
            except TierDown as exc:
                raise ChunkWriteError(
                    "pool unreachable; nothing stored", key=key, tier=self.name, cause=exc
                ) from None
            if rc not in (0, NOT_FOUND):
                raise ChunkWriteError(
                    "cannot replace an invalidated object",
                    key=key,
                    tier=self.name,
                    cause=code_name(rc),
                )
            with self._lock:
                self._withdrawn.pop(name, None)
        try:
            (present,) = self._exists([name])
        except TierDown as exc:
            raise ChunkWriteError(
                "pool unreachable; nothing stored", key=key, tier=self.name, cause=exc
            ) from None
        if present == 1:
            self._touch(key, layout.chunk_bytes)
            return False
        n = layout.chunk_bytes
        addr, keep, checksum, registered = self._memory.payload(payload, layout)
        try:
            hdr = self._headers.take()
        except BaseException:
            self._memory.let_go_payload((keep, None, addr if registered else None))
            raise
        hdr[:] = np.frombuffer(make_header(key, layout, checksum).encode(), dtype=np.uint8)
        mem = self._memory
        call = self._data.submit(
            mem.tracked(mem.arena_of(addr), self.client.batch_put_from_multi_buffers),
            [name],
            [[hdr.ctypes.data, addr]],
            [[HEADER_BYTES, n]],
            self._replicas,
            hold=(keep, hdr, addr if registered else None),
            after=mem.let_go_payload,
        )
        del keep, hdr
        try:
            out = call.wait(self.config.timeout_s)
        except CallTimeout:
            # The put may still read the payload: it keeps its view of the slot (so the
            # slot cannot go back to the ring) until the put returns.
            call.abandon()
            self._count(timeouts=1)
            why = f"a put got no answer within {self.config.timeout_s} s"
            self._mark_down(why)
            raise ChunkWriteError(why, key=key, tier=self.name) from None
        except Exception as exc:  # noqa: BLE001 - the binding raised
            raise ChunkWriteError("pool put raised", key=key, tier=self.name, cause=exc) from exc
        finally:
            if call.done() and not call.abandoned:
                mem.let_go_payload(call.take())
        rc = int(out[0]) if out else RPC_FAIL
        if rc != 0:
            why = "pool full or no storage node" if rc == NO_HANDLE else "pool put failed"
            raise ChunkWriteError(
                f"{why}; nothing stored", key=key, tier=self.name, cause=code_name(rc)
            )
        self._touch(key, n)
        self._count(writes=1, bytes_written=n)
        return True

    def _touch(self, key: ChunkKey, n: int) -> None:
        with self._lock:
            self._index.pop(key, None)
            self._index[key] = n
            while len(self._index) > self.INDEX_MAX:
                self._index.popitem(last=False)

    def _forget(self, key: ChunkKey) -> None:
        with self._lock:
            self._index.pop(key, None)

    def _remove_name(self, name: str) -> int:
        return int(self._meta_call("remove", self.client.remove, name, True))

    def remove(self, key: ChunkKey) -> bool:
        name = self.object_name(key)
        self._forget(key)
        rc = self._remove_name(name)
        if rc == 0:
            return True
        if rc == NOT_FOUND:
            return False
        raise TierDown("pool remove failed", key=key, tier=self.name, cause=code_name(rc))

    def _withdraw(self, key: ChunkKey, name: str, reason: str) -> None:
        with self._lock:
            first = name not in self._withdrawn
            self._withdrawn[name] = None
            self._snapshot.pop(name, None)
        self._forget(key)
        try:
            rc = self._remove_name(name)  # forced: a reader's lease must not keep a bad copy
        except TierDown:
            rc = RPC_FAIL
        if first and rc != NOT_FOUND:
            # Counted once per bad object: the window's invalidate after the read's own
            # withdrawal finds it gone already.
            self._count(quarantined=1)
        with self._lock:
            if rc in (0, NOT_FOUND):
                self._withdrawn.pop(name, None)  # gone from the pool: nothing to remember
            else:  # kept from advertising it here until a write replaces it
                while len(self._withdrawn) > self.WITHDRAWN_MAX:
                    self._withdrawn.popitem(last=False)

    def invalidate(self, key: ChunkKey, reason: str, *, record: object | None = None) -> None:
        """Remove `key`'s object from the pool, unless the failure proves nothing about it
        (`Unproven`: a timeout, a failed RPC, a silent node), which removes nothing: one
        slow node must not wipe a fleet's shared cache. Pool objects are write-once under
        their name, so a proof's `record` (the name) adds nothing to the key."""
        if not proves_bad(record):
            return
        self._withdraw(key, self.object_name(key), reason)

    def keys(self) -> list[ChunkKey]:
        with self._lock:
            return list(self._index)

    def stats(self) -> dict[str, Any]:
        with self._lock:
            out = self._stats(len(self._index), sum(self._index.values()), None)
            out["withdrawn"] = len(self._withdrawn)
            out["arenas"] = self._memory.arenas
            allocated, free = self._headers.counts()
            out["header_buffers_out"] = allocated - free
        out["master"] = self.config.master
        return out

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        # The client is left to its destructor: closing it while a transfer to a
        # stalled node is in flight crashed the process (SIGSEGV) in Mooncake 0.3.13.
        # Arenas no transfer targets are unregistered now (their engines let go).
        self._memory.sweep_arenas(everything=True)
        self._meta.stop()
        self._data.stop()
