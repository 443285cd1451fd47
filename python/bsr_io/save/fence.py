"""Step fences: a record cut from a step's blocks is copied after the step wrote them.

On a GPU, the hook that ends a step (vLLM's `wait_for_save`) runs once the forward's
kernels are enqueued, not once they are done. A copy issued on another stream (a
writer thread's) is not ordered after them: it can read blocks still being written,
and the record's checksum, taken over the copied bytes, would vouch for the wrong KV.
So the hook records a CUDA event on its thread's current stream (where the forward was
enqueued), and the thread that copies makes its own stream wait on that event, copies
on it, and synchronizes it before the bytes are hashed and written.

On the CPU the forward has ended when its hook runs: the fence is nothing, and costs
nothing (no event, no stream).
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from contextlib import AbstractContextManager, contextmanager, nullcontext

import torch

from bsr_io._core import Slot
from bsr_io.load.kvcache import Destination
from bsr_io.save.records import extract_record


class StepFence:
    """A step whose writes to its blocks are done (a CPU forward): nothing to order."""

    def ordered(self) -> AbstractContextManager[None]:
        """Around a copy out of the step's blocks, on the copying thread."""
        return nullcontext()


NO_FENCE = StepFence()


class CudaStepFence(StepFence):
    """An event on the stream the step's kernels were enqueued on (the current stream
    of the thread that creates it)."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.event = torch.cuda.Event()  # type: ignore[no-untyped-call, unused-ignore]
        self.event.record(torch.cuda.current_stream(device))

    @contextmanager
    def ordered(self) -> Iterator[None]:
        stream = _own_stream(self.device)
        stream.wait_event(self.event)
        try:
            with torch.cuda.stream(stream):
                yield
        finally:
            # Done before the caller hashes the bytes (or gives the slot back).
            stream.synchronize()  # type: ignore[no-untyped-call, unused-ignore]


_threads = threading.local()


def _own_stream(device: torch.device) -> torch.cuda.Stream:
    """This thread's copy stream on `device`, made once: no copy waits on another
    thread's."""
    streams: dict[int | None, torch.cuda.Stream] = _threads.__dict__.setdefault("streams", {})
    stream = streams.get(device.index)
    if stream is None:
        stream = streams[device.index] = torch.cuda.Stream(device)  # type: ignore[no-untyped-call, unused-ignore]
    return stream


def step_fence(device: torch.device) -> StepFence:
    """The fence of the step just enqueued on this thread's current stream (taken in
    the hook that ends it), for blocks on `device`."""
    return CudaStepFence(device) if device.type == "cuda" else NO_FENCE


def extract_after(fence: StepFence, dest: Destination, index: int, slot: Slot, nbytes: int) -> None:
    """`extract_record` ordered after the step behind `fence`: a cut's copy."""
    with fence.ordered():
        extract_record(dest, index, slot, nbytes)
