"""GPU checks of the CUDA path, runnable with nothing but torch and a bsr-io wheel
(a device machine has no pytest and no network): `python tests/gpu/check_cuda.py`.
Exit status 0 when every check passed; each check prints one line.

What they check, each against what would go wrong:
- the staging arena is page-locked (registered with CUDA) when a restore targets a GPU;
- a restore into a GPU paged cache lands byte-exact (fused verification on the slot);
- on a failing restore, every asynchronous copy out of a slot has completed before
  that slot goes back to the ring (a late copy would land in blocks vLLM reuses);
- a save from a GPU cache writes what the GPU holds.
"""

from __future__ import annotations

import sys
import tempfile
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
from bsr_io.save.records import save_records
from bsr_io.tiers.ssd import SSDTier

LAYOUT = preset("tiny")
CHUNKS = 16


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
