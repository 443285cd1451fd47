"""Zero-copy numpy and torch views of engine slots, and CUDA host registration. (Caller
memory registered with an engine's ring has its owner in load/memory.py.)

Every view made here holds a reference to the `Slot` (numpy through the buffer
export, whose `obj` is the Slot; torch through the object it was built from), so a
slot is never refilled while a view of it is alive.
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING, Any

import numpy as np
import numpy.typing as npt

from bsr_io._core import Engine, NoFreeSlot, Slot
from bsr_io.errors import BsrValueError

if TYPE_CHECKING:
    import torch

__all__ = [
    "as_numpy",
    "as_tensor",
    "give_back",
    "lease",
    "register_cuda",
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
    payload tensor): then the view's end returns it, the fallback. A write from it still
    in flight (a publication given up at its deadline, the kernel still writing) keeps
    it until that write ends, then the engine returns it: the caller's own error stands
    and the bytes are never reused while the kernel may read them."""
    try:
        slot.release(after_writes=True)
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
