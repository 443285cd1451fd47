"""The bytes a bench restores: a synthetic state written through the L2 tier, and a
reference file for fio where it cannot read the records themselves."""

from __future__ import annotations

import time
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from bsr_io._core import Engine, Pending
from bsr_io.cli.progress import bar
from bsr_io.cli.synthetic import fill_chunk, fill_random
from bsr_io.engine import as_numpy
from bsr_io.model.keys import ChunkKey
from bsr_io.model.layout import KVLayout
from bsr_io.tiers.base import Tier


def write_state(
    l2: Tier, engine: Engine, lay: KVLayout, keys: Sequence[ChunkKey], seed: int, quiet: bool
) -> float:
    """Every chunk through the L2 tier (O_DIRECT, durable); a few writers at a time."""
    n = lay.chunk_bytes

    def one(i: int) -> None:
        slot = engine.lease()
        fill_chunk(as_numpy(slot, count=n), seed, i)
        slot.set_length(n)
        l2.write(keys[i], slot, lay)

    t0 = time.perf_counter()
    workers = min(4, engine.window)
    with bar(len(keys) * n, "write state to L2", quiet=quiet) as b:
        with ThreadPoolExecutor(max_workers=workers, thread_name_prefix="bsr-fill") as pool:
            for _ in pool.map(one, range(len(keys))):
                b.update(n)
    return time.perf_counter() - t0


def write_fio_file(path: Path, size: int, engine: Engine, quiet: bool) -> None:
    """`size` random bytes with O_DIRECT through the engine, for fio to read back."""
    f = engine.open(path, create=True)
    pending: list[Pending] = []
    step = engine.slot_bytes
    with bar(size, "write fio reference file", quiet=quiet) as b:
        for i, off in enumerate(range(0, size, step)):
            if len(pending) >= engine.window // 2:
                pending.pop(0).wait()
            n = min(step, size - off)
            slot = engine.lease()
            fill_random(as_numpy(slot, count=n), 0xF10, i)
            slot.set_length(n)
            pending.append(engine.submit_write(slot, f, off, n))
            del slot
            b.update(n)
        for p in pending:
            p.wait()
    f.sync()
    f.close()
