"""Zero-copy numpy and torch views of engine slots, CUDA host registration, and the
registration of caller memory with an engine's ring, once per memory.

Every view made here holds a reference to the `Slot` (numpy through the buffer
export, whose `obj` is the Slot; torch through the object it was built from), so a
slot is never refilled while a view of it is alive.
"""

from __future__ import annotations

import time
import weakref
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import numpy as np
import numpy.typing as npt

from bsr_io._core import (
    Engine,
    EngineBrokenError,
    EngineClosedError,
    MemoryRegistration,
    NoFreeSlot,
    Slot,
)
from bsr_io.errors import BsrValueError

if TYPE_CHECKING:
    import torch

__all__ = [
    "RegisteredMemory",
    "as_numpy",
    "as_tensor",
    "give_back",
    "lease",
    "register_cuda",
    "REGISTER_TIMEOUT_S",
    "register_memory",
    "registered",
    "registrations",
    "unregister_cuda",
]


def _count(nbytes: int, itemsize: int, what: str) -> int:
    if nbytes % itemsize:
        raise BsrValueError(
            f"{what}: {nbytes} bytes is not a whole number of {itemsize}-byte items"
        )
    return nbytes // itemsize


def as_numpy(slot: Slot, dtype: Any = np.uint8, count: int | None = None) -> npt.NDArray[Any]:
    """A writable 1-D array over the slot's valid bytes (or its first `count` items)."""
    dt = np.dtype(dtype)
    available = _count(len(slot), dt.itemsize, "as_numpy") if count is None else count
    if available < 0 or available * dt.itemsize > len(slot):
        raise BsrValueError(f"count {count} of {dt} does not fit the slot's {len(slot)} bytes")
    return np.frombuffer(memoryview(slot), dtype=dt, count=available)


def as_tensor(
    slot: Slot, dtype: torch.dtype | None = None, length: int | None = None
) -> torch.Tensor:
    """A 1-D CPU tensor over the slot's first `length` bytes (default `len(slot)`).

    `torch.frombuffer` keeps a reference to the object it is given (here the Slot)
    for as long as the tensor's storage lives, so the slot stays leased.
    """
    import torch

    dt = torch.uint8 if dtype is None else dtype
    nbytes = len(slot) if length is None else length
    if nbytes < 0 or nbytes > len(slot):
        raise BsrValueError(f"length {length} is outside the slot's {len(slot)} valid bytes")
    itemsize = torch.empty((), dtype=dt).element_size()
    count = _count(nbytes, itemsize, "as_tensor")
    if count == 0:
        return torch.empty(0, dtype=dt)
    # Through a memoryview: torch keeps the object it is given, and a memoryview holds
    # a buffer export, which the Slot counts, so release() refuses while the tensor lives.
    return torch.frombuffer(memoryview(slot), dtype=dt, count=count)


def wait_for_slot(engine: Engine, deadline: float) -> None:
    """Return once `engine` has a free slot; EngineBusy at `deadline` (time.monotonic).

    A full ring is back-pressure (a shared engine, a slot a caller still holds): the
    caller waits for a slot or gives up cleanly, never counts it as a failed chunk."""
    from bsr_io.errors import EngineBusy

    pause = 0.0002
    while engine.free_slots() == 0:
        if engine.closed or engine.broken is not None:
            return  # the next call raises EngineClosedError / EngineBrokenError
        if time.monotonic() >= deadline:
            raise EngineBusy(
                f"none of the engine's {engine.window} staging slots came free in time: "
                "all are leased or in flight (a shared engine, or a Slot still held; "
                "release slots with slot.release() or a with-block)"
            )
        time.sleep(pause)
        pause = min(pause * 2, 0.005)


def lease(engine: Engine, deadline: float) -> Slot:
    """`engine.lease()`, waiting for a free slot until `deadline` (EngineBusy after)."""
    while True:
        try:
            return engine.lease()
        except NoFreeSlot:
            wait_for_slot(engine, deadline)


def give_back(slot: Slot) -> None:
    """Release `slot` now unless a view of it still lives (a destination that kept the
    payload tensor); then the view's end returns it, the fallback."""
    try:
        slot.release()
    except BufferError:
        pass


# Engines registered with CUDA, keyed by arena address, so unregister is idempotent.
_cuda_registered: dict[int, int] = {}


def register_cuda(engine: Engine) -> bool:
    """Pin the engine's arena for asynchronous host-to-device copies.

    Returns False (and does nothing) when CUDA is not available.
    """
    import torch

    if not torch.cuda.is_available():
        return False
    addr, nbytes = engine.arena_address, engine.arena_bytes
    if addr in _cuda_registered:
        return True
    err = torch.cuda.cudart().cudaHostRegister(addr, nbytes, 1)  # type: ignore[no-untyped-call]  # 1: cudaHostRegisterPortable
    code = int(getattr(err, "value", err))
    if code != 0:
        raise RuntimeError(f"cudaHostRegister of {nbytes} bytes at {addr:#x} failed: error {code}")
    _cuda_registered[addr] = nbytes
    return True


def unregister_cuda(engine: Engine) -> None:
    """Undo `register_cuda` (a no-op when the arena was not registered)."""
    addr = engine.arena_address
    if _cuda_registered.pop(addr, None) is None:
        return
    import torch

    err = torch.cuda.cudart().cudaHostUnregister(addr)  # type: ignore[no-untyped-call]
    code = int(getattr(err, "value", err))
    if code != 0:
        raise RuntimeError(f"cudaHostUnregister at {addr:#x} failed: error {code}")


# -- caller memory registered with an engine's ring ------------------------------------

Spans = tuple[tuple[int, int], ...]


class RegisteredMemory:
    """Host buffers registered with one engine's ring (`register_memory`), shared by every
    holder over the same memory. `registration` is None where the kernel refused it
    (RLIMIT_MEMLOCK, a full table): reads into the buffers then go unregistered."""

    __slots__ = ("__weakref__", "registration", "spans")

    def __init__(self, spans: Spans, registration: MemoryRegistration | None) -> None:
        self.spans = spans
        self.registration = registration

    @property
    def entries(self) -> int:
        return 0 if self.registration is None else self.registration.entries


# Per engine: each registered memory by its buffers' (address, length), alive while a
# holder keeps it; the holders (destinations, kept weakly) and what each holds; and how
# many registrations the engine was asked for. Keyed by memory, not by the object that
# asks, so per-request destinations over one serving pool share one registration.
_by_memory: weakref.WeakKeyDictionary[Engine, dict[Spans, weakref.ref[RegisteredMemory]]] = (
    weakref.WeakKeyDictionary()
)
_holders: weakref.WeakKeyDictionary[Engine, weakref.WeakKeyDictionary[Any, RegisteredMemory]] = (
    weakref.WeakKeyDictionary()
)
_made: weakref.WeakKeyDictionary[Engine, int] = weakref.WeakKeyDictionary()


def _spans(bufs: Sequence[Any]) -> Spans:
    out = []
    for b in bufs:
        a = np.asarray(memoryview(b))
        out.append((int(a.__array_interface__["data"][0]), int(a.nbytes)))
    return tuple(out)


# How long a registration waits for the engine's I/O thread, outside a run's deadline:
# a waiting thread is woken for it, but one held in a system call takes it only after.
REGISTER_TIMEOUT_S = 30.0


def register_memory(
    engine: Engine, bufs: Sequence[Any], holder: Any = None, timeout: float = REGISTER_TIMEOUT_S
) -> RegisteredMemory:
    """`bufs` (writable host buffers) registered with `engine`'s ring, once per engine and
    memory: a later call over the same buffers (same addresses and lengths) gets the same
    registration, whoever asks. It lasts while someone holds it: the returned object (the
    memory's owner, a serving engine's KV pool, may keep it for the memory's life) or
    `holder` (kept weakly: a destination, for as long as it lives). The kernel pins the
    pages once; the registration holds the buffers (exported) until it ends.

    TimeoutError when the I/O thread has not taken it within `timeout` seconds (a hung
    request holds the thread): the buffers are then never registered, nothing is kept,
    and a later call tries again."""
    spans = _spans(bufs)
    held = _holders.get(engine)
    if held is None:
        held = _holders[engine] = weakref.WeakKeyDictionary()
    if holder is not None:
        mine = held.get(holder)
        if mine is not None and mine.spans == spans:
            return mine
    known = _by_memory.get(engine)
    if known is None:
        known = _by_memory[engine] = {}
    ref = known.get(spans)
    got = None if ref is None else ref()
    if got is None:
        _made[engine] = _made.get(engine, 0) + 1
        try:
            reg: MemoryRegistration | None = engine.register_memory(list(bufs), max(0.0, timeout))
        except (NoFreeSlot, EngineClosedError, EngineBrokenError):
            raise
        except TimeoutError as exc:
            raise TimeoutError(
                f"registering memory waited {timeout:.3g} s for the engine's I/O thread "
                "(a request it holds has not returned); nothing registered"
            ) from exc
        except (OSError, ValueError):
            reg = None
        got = RegisteredMemory(spans, reg)

        def gone(r: weakref.ref[RegisteredMemory], table: dict[Spans, Any] = known) -> None:
            if table.get(spans) is r:
                del table[spans]

        known[spans] = weakref.ref(got, gone)
    if holder is not None:
        held[holder] = got
    return got


def registered(engine: Engine, bufs: Sequence[Any]) -> RegisteredMemory | None:
    """The live registration of exactly `bufs` with `engine`'s ring, if any."""
    ref = _by_memory.get(engine, {}).get(_spans(bufs))
    return None if ref is None else ref()


def registrations(engine: Engine) -> int:
    """How many registrations of memory `engine`'s ring was asked for so far."""
    return _made.get(engine, 0)
