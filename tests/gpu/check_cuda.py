"""GPU checks of the CUDA path, runnable with nothing but torch and a bsr-io wheel
(a device machine has no pytest and no network): `python tests/gpu/check_cuda.py`.
Exit status 0 when every check passed; each check prints one line.

What they check, each against what would go wrong:
- the staging arena is page-locked (registered with CUDA) when a restore targets a GPU;
- a restore into a GPU paged cache lands byte-exact (fused verification on the slot);
- on a failing restore, every asynchronous copy out of a slot has completed before
  that slot goes back to the ring (a late copy would land in blocks vLLM reuses);
- a save from a GPU cache writes what the GPU holds;
- a step cut taken while the step's forward (on a non-default stream) still writes its
  blocks copies them after it, through the worker's own fence and copy
  (bsr_io.save.fence); its control, the same copy unfenced, says whether this GPU
  shows the race (information: a race need not show).
"""

from __future__ import annotations

import sys
import tempfile
import threading
import time
import traceback
from pathlib import Path

import torch

from bsr_io import Engine
from bsr_io.engine import _cuda_registered
from bsr_io.faults import Fault, FaultPlan
from bsr_io.load.kvcache import PagedKVCache
from bsr_io.load.records import LoadOptions, load_records
from bsr_io.model.keys import chunk_keys
from bsr_io.model.layout import preset
from bsr_io.save.fence import NO_FENCE, StepFence, extract_after, step_fence
from bsr_io.save.records import save_records
from bsr_io.tiers.ssd import SSDTier

LAYOUT = preset("tiny")
CHUNKS = 16
FORWARD_CYCLES = 500_000_000  # the slow kernel ahead of a step's writes (~0.3 s)


def _state(root: Path, engine: Engine):
    tier = SSDTier(root, None, engine, layout=LAYOUT)
    tokens = list(range(CHUNKS * LAYOUT.chunk_tokens))
    keys = chunk_keys(tokens, LAYOUT, "gpu-check", 0, 1)
    src = PagedKVCache.allocate(LAYOUT, len(tokens), device="cuda", zero=False)
    for t in src.tensors:
        t.copy_(torch.randint(-100, 100, t.shape, device="cuda").to(t.dtype))
    written = save_records(
        engine, tier, keys, [LAYOUT] * CHUNKS, src, deadline=time.monotonic() + 60
    )
    assert written == CHUNKS, written
    return tier, keys, src


def check_restore_is_exact_and_arena_registered(root: Path) -> None:
    engine = Engine(4, LAYOUT.chunk_bytes)
    tier, keys, src = _state(root, engine)
    dst = PagedKVCache.allocate(LAYOUT, CHUNKS * LAYOUT.chunk_tokens, device="cuda", spare_blocks=3)
    res = load_records(
        engine,
        [tier],
        keys,
        dst,
        LoadOptions(deadline=time.monotonic() + 60, chunk_bytes=LAYOUT.chunk_bytes),
    )
    assert res.complete, res.reason
    assert engine.arena_address in _cuda_registered, "arena not registered with CUDA"
    for i in range(CHUNKS):
        assert dst.chunk_bytes(i) == src.chunk_bytes(i), f"chunk {i} differs"


class _Watched(PagedKVCache):
    """Records, for each install, its CUDA event, and for each slot given back to the
    ring (the engine's live bytes falling) whether every earlier event had completed."""

    events: list[torch.cuda.Event]

    def install(self, chunk_index, payload):
        torch.cuda._sleep(20_000_000)  # keep the copy in flight for a while (~10 ms)
        fence = super().install(chunk_index, payload)
        self.events.append(fence)
        return fence


def check_failed_restore_waits_for_copies(root: Path) -> None:
    engine = Engine(4, LAYOUT.chunk_bytes)
    tier, keys, _ = _state(root, engine)
    failing = FaultPlan([Fault("error", chunks=[9])]).wrap(tier, keys=keys)
    dst = _Watched.allocate(LAYOUT, CHUNKS * LAYOUT.chunk_tokens, device="cuda")
    dst.events = []
    res = load_records(
        engine,
        [failing],
        keys,
        dst,
        LoadOptions(deadline=time.monotonic() + 60, chunk_bytes=LAYOUT.chunk_bytes),
    )
    assert not res.complete and res.failed_chunks == [9], res
    # When load_records returns every slot is back; every copy out of them must be done.
    assert engine.live_bytes() == 0
    pending = [i for i, e in enumerate(dst.events) if not e.query()]
    assert not pending, f"copies {pending} still in flight after their slots returned"


def check_save_from_gpu(root: Path) -> None:
    engine = Engine(2, LAYOUT.chunk_bytes)
    tier, keys, src = _state(root, engine)
    slot = tier.read_into(keys[5], engine)
    try:
        got = bytes(memoryview(slot)[: LAYOUT.chunk_bytes])
    finally:
        slot.release()
    assert got == src.chunk_bytes(5)


def _cut_during_forward(root: Path, fenced: bool) -> tuple[bytes, bytes, bytes]:
    """A step's forward on a non-default stream (a slow kernel, then its writes to the
    blocks of chunk 3); the cut taken at once, as `wait_for_save` takes it: the fence
    recorded on the forward's thread with its stream current, the copy and the write on
    a writer thread. (the record as read back, the blocks after synchronization, the
    blocks before the step)."""
    root.mkdir(exist_ok=True)
    engine = Engine(2, LAYOUT.chunk_bytes)
    tier = SSDTier(root, None, engine, layout=LAYOUT)
    key = chunk_keys(list(range(4 * LAYOUT.chunk_tokens)), LAYOUT, "gpu-cut", 0, 1)[3]
    blocks = PagedKVCache.allocate(LAYOUT, 4 * LAYOUT.chunk_tokens, device="cuda")
    for t in blocks.tensors:
        t.fill_(1)
    step = [torch.full_like(t, 2) for t in blocks.tensors]  # what the forward writes
    torch.cuda.synchronize()
    before = blocks.chunk_bytes(3)
    forward = torch.cuda.Stream()
    with torch.cuda.stream(forward):
        torch.cuda._sleep(FORWARD_CYCLES)
        for t, new in zip(blocks.tensors, step, strict=True):
            t.copy_(new)
        fence: StepFence = step_fence(torch.device("cuda")) if fenced else NO_FENCE
    assert not forward.query(), "the forward ended before the cut: nothing was checked"
    errors: list[BaseException] = []

    def writer() -> None:
        try:
            with engine.lease() as slot:
                extract_after(fence, blocks, 3, slot, LAYOUT.chunk_bytes)
                tier.write(key, slot, LAYOUT)
        except BaseException as exc:  # noqa: BLE001 - raised again on the main thread
            errors.append(exc)

    th = threading.Thread(target=writer)
    th.start()
    th.join()
    if errors:
        raise errors[0]
    torch.cuda.synchronize()
    slot = tier.read_into(key, engine)  # verified against the record's checksum
    try:
        record = bytes(memoryview(slot)[: LAYOUT.chunk_bytes])
    finally:
        slot.release()
    return record, blocks.chunk_bytes(3), before


def check_step_cut_waits_for_the_forward(root: Path) -> None:
    record, after, before = _cut_during_forward(root, fenced=True)
    assert after != before, "the forward wrote nothing"
    assert record == after, "the cut's record is not the blocks the forward wrote"
    # The control: the same cut with no fence (the copy on the writer's current stream).
    record, after, before = _cut_during_forward(root / "control", fenced=False)
    raced = "shows the race" if record != after else "did not show the race"
    print(f"INFO control: an unfenced cut on this GPU {raced}")


def main() -> int:
    if not torch.cuda.is_available():
        print("no CUDA device: nothing checked")
        return 2
    failed = 0
    for name, fn in list(globals().items()):
        if not name.startswith("check_"):
            continue
        with tempfile.TemporaryDirectory(dir="/var/tmp") as d:
            t0 = time.monotonic()
            try:
                fn(Path(d))
                print(f"PASS {name} ({time.monotonic() - t0:.1f} s)")
            except Exception:
                failed += 1
                print(f"FAIL {name}\n{traceback.format_exc()}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
