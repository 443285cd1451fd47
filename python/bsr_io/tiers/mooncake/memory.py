"""The memory a Mooncake client transfers to and from, registered with the pool.

- record headers: registered 4 KiB buffers, allocated in blocks and reused;
- engine arenas (the W staging slots): registered once per engine, unregistered once the
  engine is closed and no transfer of the tier still targets them;
- a payload outside a registered arena: registered around its put, then unregistered;
- a host destination's blocks (direct reads, TCP only): addresses checked, not registered.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
import numpy.typing as npt

from bsr_io._core import Engine, Slot, xxh3_64
from bsr_io.errors import ChunkWriteError, LayoutError, TierDown
from bsr_io.model.layout import KVLayout
from bsr_io.model.record import HEADER_BYTES
from bsr_io.tiers.base import Payload, payload_view
from bsr_io.tiers.mooncake.calls import Transfer, code_name


class HeaderBuffers:
    """Registered 4 KiB buffers for record headers, allocated in blocks and reused."""

    BLOCK = 32

    def __init__(self, register: Callable[[int, int], int]) -> None:
        self._register = register
        self._blocks: list[npt.NDArray[np.uint8]] = []
        self._free: list[npt.NDArray[np.uint8]] = []
        self._lock = threading.Lock()

    def take(self) -> npt.NDArray[np.uint8]:
        with self._lock:
            if not self._free:
                block = np.zeros(self.BLOCK * HEADER_BYTES, dtype=np.uint8)
                rc = self._register(block.ctypes.data, block.nbytes)
                if rc != 0:
                    raise TierDown(f"cannot register header buffers with the pool: {code_name(rc)}")
                self._blocks.append(block)
                self._free += [
                    block[i * HEADER_BYTES : (i + 1) * HEADER_BYTES] for i in range(self.BLOCK)
                ]
            return self._free.pop()

    def give(self, buf: npt.NDArray[np.uint8]) -> None:
        with self._lock:
            self._free.append(buf)

    def blocks(self) -> list[npt.NDArray[np.uint8]]:
        return list(self._blocks)

    def counts(self) -> tuple[int, int]:
        """(buffers allocated, buffers free): equal when none is out."""
        with self._lock:
            return len(self._blocks) * self.BLOCK, len(self._free)


def run_addresses(
    bufs: Sequence[Any], runs: Sequence[tuple[int, int, int, int]], n: int, what: str
) -> tuple[list[int], list[int]]:
    """Addresses and lengths of `runs` in `bufs` (writable host byte arrays), which must
    lie inside their buffers and cover an n-byte payload in order, once; else LayoutError."""
    ptrs, sizes, at = [], [], 0
    for bi, off, pos, length in runs:
        buf = bufs[bi]
        if not isinstance(buf, np.ndarray) or not buf.flags.writeable or not buf.flags.c_contiguous:
            raise LayoutError(f"{what}: destination buffer {bi} is not writable host memory")
        if pos != at or length <= 0 or off < 0 or off + length > buf.nbytes:
            raise LayoutError(
                f"{what}: run ({bi}, {off}, {pos}, {length}) does not continue the payload "
                f"at {at} inside its {buf.nbytes}-byte buffer"
            )
        ptrs.append(buf.ctypes.data + off)
        sizes.append(length)
        at += length
    if at != n:
        raise LayoutError(f"{what} holds {n} payload bytes, the destination's runs {at}")
    return ptrs, sizes


def release_views(owner: object) -> None:
    """Release the buffer views in `owner` (a slot's view held for a put)."""
    if isinstance(owner, tuple):
        for part in owner:
            if isinstance(part, memoryview):
                part.release()


class RegisteredMemory:
    """What one tier's client has registered: header buffers, engine arenas (with the
    transfers in flight into each) and payloads registered for a put. Thread-safe.

    `unregistered()` is called once per arena unregistered (the tier counts them)."""

    def __init__(self, client: Any, tier: str, unregistered: Callable[[], None]) -> None:
        self.client, self.tier = client, tier
        self.headers = HeaderBuffers(client.register_buffer)
        self._unregistered = unregistered
        self._lock = threading.Lock()
        # Registered engine arenas: address -> (bytes, engine); an arena is unregistered
        # once its engine is closed and no transfer of this tier targets it.
        self._arenas: dict[int, tuple[int, Engine]] = {}
        self._inflight: dict[int, int] = {}  # arena address -> transfers not yet returned

    @property
    def arenas(self) -> int:
        """How many engine arenas are registered now."""
        with self._lock:
            return len(self._arenas)

    # -- engine arenas ------------------------------------------------------------------
    def register_arena(self, engine: Engine) -> None:
        """Register `engine`'s staging arena (once); TierDown when the pool refuses."""
        self.sweep_arenas()
        addr, nbytes = engine.arena_address, engine.arena_bytes
        with self._lock:
            known = self._arenas.get(addr)
            if known is not None and known[1] is engine:
                return
            rc = self.client.register_buffer(addr, nbytes)
            if rc != 0:
                raise TierDown(
                    f"cannot register the engine's staging arena with the pool: {code_name(rc)}",
                    tier=self.tier,
                )
            self._arenas[addr] = (nbytes, engine)

    def sweep_arenas(self, everything: bool = False) -> None:
        """Unregister the arenas of closed engines (every one when `everything`) that no
        transfer of this tier still targets, and let go of those engines."""
        with self._lock:
            gone = [
                a
                for a, (_, eng) in self._arenas.items()
                if (everything or eng.closed) and not self._inflight.get(a)
            ]
            for a in gone:
                del self._arenas[a]
        for a in gone:
            try:
                self.client.unregister_buffer(a)
            except Exception:  # noqa: BLE001, S110 - the client may be gone at exit
                pass
            self._unregistered()

    def arena_of(self, addr: int) -> int | None:
        with self._lock:
            return next((a for a, (n, _) in self._arenas.items() if a <= addr < a + n), None)

    def _transfer_started(self, arena: int | None) -> None:
        if arena is not None:
            with self._lock:
                self._inflight[arena] = self._inflight.get(arena, 0) + 1

    def _transfer_returned(self, arena: int | None) -> None:
        if arena is not None:
            with self._lock:
                left = self._inflight.get(arena, 0) - 1
                if left > 0:
                    self._inflight[arena] = left
                else:
                    self._inflight.pop(arena, None)

    def tracked(self, arena: int | None, fn: Callable[..., Any]) -> Transfer:
        """`fn`, counted as a transfer into `arena` from now until it returns (or is
        skipped, abandoned before it started)."""
        self._transfer_started(arena)
        return Transfer(fn, lambda: self._transfer_returned(arena))

    # -- payloads of puts ---------------------------------------------------------------
    def payload(self, payload: Payload, layout: KVLayout) -> tuple[int, Any, int, bool]:
        """(address, owner to keep alive, xxh3, registered here) of the payload bytes.

        A slot is held through a buffer view, which the engine honours: the caller's
        `release()` is refused (and `give_back` leaves the slot to the view's end) while
        a put that may still read it runs. Memory outside a registered engine arena is
        registered for the put (RDMA needs it; TCP does not care) and unregistered after."""
        n = layout.chunk_bytes
        owner: object
        if isinstance(payload, Slot):
            addr, checksum = payload.address, payload.checksum(0, n)
            owner = (payload, memoryview(payload))
        else:
            arr = np.frombuffer(payload_view(payload, layout), dtype=np.uint8)
            addr, owner, checksum = arr.ctypes.data, arr, xxh3_64(arr.data)
        with self._lock:
            inside = any(a <= addr and addr + n <= a + b for a, (b, _) in self._arenas.items())
        if inside:
            return addr, owner, checksum, False
        rc = self.client.register_buffer(addr, n)
        if rc != 0:
            release_views(owner)
            raise ChunkWriteError(
                f"cannot register the payload with the pool: {code_name(rc)}", tier=self.tier
            )
        return addr, owner, checksum, True

    def let_go_payload(self, hold: tuple[Any, ...]) -> None:
        """A put returned (or never ran): its header buffer, its payload registration and
        its view of a slot go back."""
        if not hold:
            return
        keep, hdr, registered_at = hold
        if hdr is not None:
            self.headers.give(hdr)
        if registered_at is not None:
            try:
                self.client.unregister_buffer(registered_at)
            except Exception:  # noqa: BLE001, S110 - the client may be gone at exit
                pass
        release_views(keep)
