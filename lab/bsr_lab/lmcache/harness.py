"""Drive LMCache 0.5.6's real engine on a CPU-only machine, for tests and benchmarks.

Builds `LMCacheEngine` through `LMCacheEngineBuilder` from an LMCache config dict
(the same keys a YAML config file holds), with `CPUPagedConnector` standing in for
the GPU; makes a paged KV state; stores it through LMCache in windows (LMCache's own
store allocates every chunk of a call in L1 at once and stores only what fits); and
runs the stock retrieve in a child process so a busy-waiting one can be stopped.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import asdict, dataclass

import torch

from bsr_lab.lmcache.connector import CPUPagedConnector


@dataclass(frozen=True)
class Shape:
    """A small model's per-rank KV shape, in LMCache's terms."""

    num_layers: int = 2
    num_kv_heads: int = 2
    head_size: int = 64
    chunk_tokens: int = 256
    block_size: int = 16
    dtype: str = "bfloat16"

    @property
    def torch_dtype(self) -> torch.dtype:
        return getattr(torch, self.dtype)

    @property
    def token_bytes(self) -> int:
        return 2 * self.num_layers * self.num_kv_heads * self.head_size * self.torch_dtype.itemsize

    @property
    def chunk_bytes(self) -> int:
        return self.chunk_tokens * self.token_bytes


def gib(n_bytes: int) -> float:
    """LMCache sizes are float GiB (`int(size * 1024**3)` bytes)."""
    return n_bytes / 1024**3


def make_config(shape: Shape, l1_bytes: int, settings: dict | None = None):
    from lmcache.v1.config import LMCacheEngineConfig

    cfg = {
        "chunk_size": shape.chunk_tokens,
        "local_cpu": True,
        "max_local_cpu_size": gib(l1_bytes),
    }
    cfg.update(settings or {})
    return LMCacheEngineConfig.from_dict(cfg)


def make_metadata(shape: Shape, worker_id: int = 0, world_size: int = 1, model: str = "bsr-test"):
    from lmcache.v1.metadata import LMCacheMetadata

    return LMCacheMetadata(
        model_name=model,
        world_size=world_size,
        local_world_size=world_size,
        worker_id=worker_id,
        local_worker_id=worker_id,
        kv_dtype=shape.torch_dtype,
        kv_shape=(shape.num_layers, 2, shape.chunk_tokens, shape.num_kv_heads, shape.head_size),
        chunk_size=shape.chunk_tokens,
    )


def build_engine(instance_id: str, shape: Shape, config, metadata=None):
    """An `LMCacheEngine` with its storage manager (built the way vLLM's adapter does)."""
    from lmcache.v1.cache_engine import LMCacheEngineBuilder

    connector = CPUPagedConnector(shape.num_layers, shape.num_kv_heads, shape.head_size)
    engine = LMCacheEngineBuilder.get_or_create(
        instance_id,
        config,
        metadata or make_metadata(shape),
        connector,
        lambda *a, **k: None,  # broadcast_fn: only used by MLA first-rank mode
        lambda *a, **k: None,
    )
    engine.post_init()
    return engine


def destroy_engine(instance_id: str) -> None:
    from lmcache.v1.cache_engine import LMCacheEngineBuilder

    LMCacheEngineBuilder.destroy(instance_id)


@dataclass
class State:
    tokens: torch.Tensor
    kvcaches: list[torch.Tensor]
    slot_mapping: torch.Tensor

    def kwargs(self) -> dict:
        return {"kvcaches": self.kvcaches, "slot_mapping": self.slot_mapping}


def make_state(shape: Shape, n_chunks: int, seed: int = 0, fill: bool = True) -> State:
    """`n_chunks` full chunks of random tokens and KV, paged in blocks in a shuffled order."""
    g = torch.Generator().manual_seed(seed)
    n = n_chunks * shape.chunk_tokens
    tokens = torch.randint(0, 1 << 20, (n,), generator=g)
    num_blocks = n // shape.block_size
    blocks = torch.randperm(num_blocks, generator=g)  # non-contiguous pages, like vLLM's
    offsets = torch.arange(n) % shape.block_size
    slots = blocks[torch.arange(n) // shape.block_size] * shape.block_size + offsets
    caches = CPUPagedConnector.make_kvcaches(
        shape.num_layers,
        num_blocks,
        shape.block_size,
        shape.num_kv_heads,
        shape.head_size,
        shape.torch_dtype,
    )
    if fill:
        for c in caches:
            c.copy_(torch.randn(c.shape, generator=g).to(c.dtype))
    return State(tokens, caches, slots)


def empty_like(state: State) -> State:
    return State(state.tokens, [torch.zeros_like(c) for c in state.kvcaches], state.slot_mapping)


def restored_equal(src: State, dst: State, tokens: int) -> bool:
    """True when the first `tokens` tokens' KV in `dst` equals `src`, byte for byte."""
    slots = src.slot_mapping[:tokens]
    for a, b in zip(src.kvcaches, dst.kvcaches, strict=True):
        fa = a.view(2, -1, a.shape[-2] * a.shape[-1])[:, slots]
        fb = b.view(2, -1, b.shape[-2] * b.shape[-1])[:, slots]
        if not torch.equal(fa.view(torch.uint8), fb.view(torch.uint8)):
            return False
    return True


def _keys(engine, tokens, start_chunk: int, end_chunk: int):
    ct = engine.config.chunk_size
    out = []
    for start, _end, key in engine.token_database.process_tokens(tokens=tokens[: end_chunk * ct]):
        if start >= start_chunk * ct:
            out.append(key)
    return out


def wait_stored(engine, keys, timeout_s: float = 60.0) -> None:
    """Wait until no backend still has a pending write for `keys` (their L1 copies are
    then evictable again)."""
    backends = [
        b
        for name, b in engine.storage_manager.storage_backends.items()
        if name != "LocalCPUBackend"
    ]
    deadline = time.monotonic() + timeout_s
    while any(b.exists_in_put_tasks(k) for b in backends for k in keys):
        if time.monotonic() > deadline:
            raise TimeoutError("LMCache backends did not finish writing in time")
        time.sleep(0.01)


def store_windowed(engine, state: State, window: int) -> int:
    """Store `state` through LMCache's `store`, `window` chunks per call; returns chunks
    stored. Waits for each call's writes so the next one can evict what they staged."""
    ct = engine.config.chunk_size
    n_chunks = len(state.tokens) // ct
    for c0 in range(0, n_chunks, window):
        c1 = min(n_chunks, c0 + window)
        tokens = state.tokens[: c1 * ct]
        mask = torch.zeros(len(tokens), dtype=torch.bool)
        mask[c0 * ct :] = True
        engine.store(tokens, mask=mask, **state.kwargs())
        wait_stored(engine, _keys(engine, state.tokens, c0, c1))
    return n_chunks


def drop_l1(engine) -> None:
    """Empty L1's hot cache so a retrieve must come from the lower tiers."""
    cpu = engine.storage_manager.storage_backends.get("LocalCPUBackend")
    if cpu is not None:
        cpu.clear()


def l1_allocated_bytes(engine) -> int:
    cpu = engine.storage_manager.storage_backends["LocalCPUBackend"]
    alloc = cpu.memory_allocator
    alloc = getattr(alloc, "pin_allocator", alloc)
    return int(alloc.total_allocated_size)


class PeakSampler:
    """Samples L1's allocated bytes on a thread (LMCache keeps no peak of its own).
    `on_peak(bytes)` is called whenever the peak grows."""

    def __init__(self, engine, period_s: float = 0.002, on_peak=None) -> None:
        self.engine, self.period_s, self.on_peak, self.peak = engine, period_s, on_peak, 0
        self._stop = threading.Event()
        self._t = threading.Thread(target=self._run, daemon=True)

    def _sample(self) -> None:
        now = l1_allocated_bytes(self.engine)
        if now > self.peak:
            self.peak = now
            if self.on_peak is not None:
                self.on_peak(now)

    def _run(self) -> None:
        while not self._stop.is_set():
            self._sample()
            time.sleep(self.period_s)

    def __enter__(self) -> PeakSampler:
        self._sample()
        self._t.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._t.join()
        self._sample()


# ---- stock retrieve in a child process ---------------------------------------------


def stock_case(shape: Shape, n_chunks: int, l1_bytes: int, disk_dir: str, seed: int = 0) -> dict:
    """Store a state with LMCache's LocalDiskBackend, empty L1, run the stock retrieve.

    Returns result ok|short, retrieved tokens, L1 peak and data equality. Run it through
    `run_stock_case` when the retrieve may busy-wait forever.
    """
    settings = {
        "local_disk": f"file://{disk_dir}",
        "max_local_disk_size": gib(4 * n_chunks * shape.chunk_bytes),
    }
    iid = f"stock-{os.getpid()}-{n_chunks}-{l1_bytes}"
    engine = build_engine(iid, shape, make_config(shape, l1_bytes, settings))
    try:
        src = make_state(shape, n_chunks, seed)
        store_windowed(engine, src, max(1, l1_bytes // shape.chunk_bytes // 2))
        drop_l1(engine)
        dst = empty_like(src)
        _emit("stored")  # the parent starts its clock here
        t0 = time.perf_counter()
        with PeakSampler(engine, on_peak=lambda b: _emit(f"peak {b}")) as peak:
            mask = engine.retrieve(src.tokens, **dst.kwargs())
        seconds = time.perf_counter() - t0
        got = int(mask.sum().item())
        full = got == len(src.tokens)
        return {
            "result": "ok" if full else "short",
            "retrieved_tokens": got,
            "l1_peak_bytes": peak.peak,
            "seconds": seconds,
            "data_ok": restored_equal(src, dst, got) if got else None,
        }
    finally:
        destroy_engine(iid)


def _emit(line: str) -> None:
    if os.environ.get("BSR_LMCACHE_CHILD"):
        sys.stdout.write(f"{_TAG}{line}\n")
        sys.stdout.flush()


_TAG = "BSR-STOCK "


def run_stock_case(
    shape: Shape, n_chunks: int, l1_bytes: int, disk_dir: str, timeout_s: float, seed: int = 0
) -> dict:
    """`stock_case` in a child process; `result: hang` when the retrieve has not returned
    `timeout_s` after the store finished (the child is then killed; its L1 peak is the
    last one it reported)."""
    args = json.dumps(
        {
            "shape": asdict(shape),
            "n_chunks": n_chunks,
            "l1_bytes": l1_bytes,
            "disk_dir": disk_dir,
            "seed": seed,
        }
    )
    env = dict(
        os.environ, PYTHONHASHSEED=os.environ.get("PYTHONHASHSEED", "0"), BSR_LMCACHE_CHILD="1"
    )
    errlog = tempfile.TemporaryFile(mode="w+")
    proc = subprocess.Popen(
        [sys.executable, "-m", "bsr_lab.lmcache.harness", args],
        stdout=subprocess.PIPE,
        stderr=errlog,
        text=True,
        env=env,
    )
    lines: list[str] = []
    stored = threading.Event()

    def read() -> None:
        for raw in proc.stdout:
            if raw.startswith(_TAG):
                lines.append(raw[len(_TAG) :].strip())
                if lines[-1] == "stored":
                    stored.set()
        stored.set()  # EOF

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    stored.wait(timeout=600)  # setup (store) is not part of the timeout
    killed = False
    try:
        proc.wait(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()
        killed = True
    reader.join(timeout=10)
    peaks = [int(x.split()[1]) for x in lines if x.startswith("peak ")]
    results = [json.loads(x[len("result ") :]) for x in lines if x.startswith("result ")]
    if results:
        return results[-1]
    if not killed:
        errlog.seek(0)
        tail = errlog.read()[-2000:]
        raise RuntimeError(f"stock case exited {proc.returncode} without a result:\n{tail}")
    return {
        "result": "hang",
        "retrieved_tokens": 0,
        "l1_peak_bytes": max(peaks, default=0),
        "seconds": timeout_s,
        "data_ok": None,
    }


def _main(argv: list[str]) -> int:
    import logging

    logging.disable(logging.WARNING)
    a = json.loads(argv[0])
    res = stock_case(Shape(**a["shape"]), a["n_chunks"], a["l1_bytes"], a["disk_dir"], a["seed"])
    _emit("result " + json.dumps(res))
    return 0


if __name__ == "__main__":
    sys.exit(_main(sys.argv[1:]))


class Engines:
    """Builds engines with unique instance ids and destroys them all at `close()`."""

    def __init__(self, shape: Shape | None = None) -> None:
        self.shape = shape or Shape()
        self._ids: list[str] = []

    def __call__(self, l1_chunks: int, disk=None, settings: dict | None = None, metadata=None):
        cfg = dict(settings or {})
        if disk is not None:
            cfg.setdefault("local_disk", f"file://{disk}")
            cfg.setdefault("max_local_disk_size", 1.0)
        iid = f"bsr-{os.getpid()}-{len(self._ids)}-{time.monotonic_ns()}"
        engine = build_engine(
            iid,
            self.shape,
            make_config(self.shape, l1_chunks * self.shape.chunk_bytes, cfg),
            metadata,
        )
        self._ids.append(iid)
        return engine

    def close(self) -> None:
        while self._ids:
            destroy_engine(self._ids.pop())
