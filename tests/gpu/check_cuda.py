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
  shows the race (information: a race need not show);
- a hybrid model's pools (a KV pool and sidecar pools of DeepSeek-V4's shape, each its
  own records, as SGLang's backend keeps them) saved from and restored into GPU memory
  land byte-exact, committed together (SGLang's one-commit cut, `commit_cut`); a
  damaged sidecar record ends every pool's prefix at its page, the trailing windows
  with it. Its CPU run (`device="cpu"`) is tests/package/test_gpu_script.py's.
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
from bsr_io.integrations.sglang.hybrid import commit_cut  # pure: imports no SGLang
from bsr_io.load.discovery import sources_of
from bsr_io.load.kvcache import PagedKVCache
from bsr_io.load.records import LoadOptions, load_records, windowed_install
from bsr_io.model.keys import chunk_keys
from bsr_io.model.layout import AllocatorGroup, KVLayout, preset
from bsr_io.model.record import HEADER_BYTES
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


# A hybrid model's pools, DeepSeek-V4's shapes (tests/integrations/sglang/hybrid_pools.py
# builds them with SGLang's classes): 64-token pages, 2 layers, rows of 448 FP8 nope
# bytes and 64 bf16 rope values (576 B); the C4 and C128 compressed KV hold page/4 and
# max(1, page/128) rows a page, the C4 indexer page/4 rows of 128 FP8 bytes and a 4-byte
# scale, SWA a row per token, the C4 compress state an 8-row ring of 512 fp32. Each pool
# is its own layout and records (one group of the page's bytes: uint8 for the FP8
# sidecars); the trailing pools (SWA: the last 2 pages, the state: the last 1) carry
# only the window that ends the prefix. (name, dtype, per-token shape, trailing window)
PAGE, LAYERS, ROW = 64, 2, 448 + 64 * 2
HYBRID = [
    ("kv", torch.bfloat16, (LAYERS, 448 + 64), 0),
    ("deepseek_v4_c4", torch.uint8, (PAGE // 4 * ROW * LAYERS // PAGE,), 0),
    ("deepseek_v4_c4_indexer", torch.uint8, (PAGE // 4 * (128 + 4) * LAYERS // PAGE,), 0),
    ("deepseek_v4_c128", torch.uint8, (max(1, PAGE // 128) * ROW * LAYERS // PAGE,), 0),
    ("swa", torch.uint8, (ROW * LAYERS,), 2),
    ("deepseek_v4_c4_state", torch.float32, (8 * 512 * LAYERS // PAGE,), 1),
]
DAMAGED = ("deepseek_v4_c4_indexer", 5)  # the sidecar record whose payload is damaged


def _random(t: torch.Tensor) -> None:
    if t.dtype == torch.uint8:
        t.copy_(torch.randint(0, 256, t.shape, dtype=torch.uint8, device=t.device))
    else:
        t.copy_(torch.randint(-100, 100, t.shape, device=t.device).to(t.dtype))


def _hybrid_restore(
    pools: dict[str, tuple[SSDTier, Engine, list, PagedKVCache, int]], device: str
) -> tuple[dict[str, list[bool]], dict[str, PagedKVCache]]:
    """Each pool read on its own (its leading pages verified in place, as SGLang's
    backend reads one), then cut together: (each pool's verdict per page, the caches)."""
    names: dict[str, list[str]] = {}
    done: dict[str, int] = {}
    dests: dict[str, PagedKVCache] = {}
    for name, (tier, engine, keys, src, first) in pools.items():
        names[name] = [f"page{first + i}" for i in range(len(keys))]
        dest = dests[name] = PagedKVCache.allocate(
            src.layout, len(keys) * PAGE, device=device, spare_blocks=1
        )
        sources = sources_of([tier], keys)
        report, error = windowed_install(
            engine,
            [tier],
            keys[: len(sources)],
            sources,
            dest,
            LoadOptions(deadline=time.monotonic() + 60),
            engine.slot_bytes,
            engine.window,
        )
        ok = report.installed if report is not None else 0
        if report is not None and (report.failed_chunks or report.unusable):
            ok = min(ok, *report.failed_chunks, *report.unusable)
        done[name] = 0 if error and ok >= len(sources) else ok
        assert engine.live_bytes() == 0, f"{name}: a slot not back after the read"
    return commit_cut(names, done), dests


def check_hybrid_pools_commit_together(root: Path, device: str = "cuda") -> None:
    pools = {}
    tokens = list(range(CHUNKS * PAGE))
    for name, dtype, shape, window in HYBRID:
        layout = KVLayout(f"dsv4-{name}", (AllocatorGroup(name, dtype, shape, PAGE),), PAGE)
        engine = Engine(4, layout.chunk_bytes)
        tier = SSDTier(root / name, None, engine, layout=layout)
        first = CHUNKS - window if window else 0
        keys = chunk_keys(tokens, layout, "gpu-hybrid", 0, 1)[first:]
        src = PagedKVCache.allocate(layout, len(keys) * PAGE, device=device, zero=False)
        for t in src.tensors:
            _random(t)
        written = save_records(
            engine, tier, keys, [layout] * len(keys), src, deadline=time.monotonic() + 60
        )
        assert written == len(keys), (name, written)
        pools[name] = (tier, engine, keys, src, first)

    def exact(verdict: dict[str, list[bool]], dests: dict[str, PagedKVCache]) -> None:
        for name, (_, _, _, src, _) in pools.items():
            for i, good in enumerate(verdict[name]):
                if good:
                    got, want = dests[name].chunk_bytes(i), src.chunk_bytes(i)
                    assert got == want, f"{name} page {i} differs"

    verdict, dests = _hybrid_restore(pools, device)
    assert all(all(v) for v in verdict.values()), verdict
    exact(verdict, dests)
    # Damage one sidecar record's payload: its pool ends at that page, and so does
    # every other pool (never KV without its indexer); the windows that end the whole
    # prefix are past the cut, so none of their pages commits.
    name, page = DAMAGED
    tier, _, keys, _, first = pools[name]
    with open(tier.path_of(keys[page - first]), "r+b") as f:
        f.seek(HEADER_BYTES + 7)
        byte = f.read(1)
        f.seek(HEADER_BYTES + 7)
        f.write(bytes([byte[0] ^ 0xFF]))
    verdict, dests = _hybrid_restore(pools, device)
    for pool, (_, _, keys, _, first) in pools.items():
        want = [first + i < page for i in range(len(keys))]
        assert verdict[pool] == want, (pool, verdict[pool])
    exact(verdict, dests)


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
