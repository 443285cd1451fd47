"""`bench ttft --sweep ... --store-records N`: does a load depend on the store's size?

Two stores hold the same prefix of the sweep's state (its sizes up to 16 chunks, each
restored), one padded to
1,000 records and one to N, all of the same model and rank: tiny-layout records (real
ones: header, payload, checksum), which a tiny-layout restore of a prefix of them also
reads, from a namespace directory of N entries. Each round restores each size from each
store, cold cache, in a fresh random order; per size the medians, the large store over
the small within each round, and the tiers' start (a listing of names: no header is
read at open since issue 52 item 3, so it grows only with the directory's size).
"""

from __future__ import annotations

import argparse
import os
import random
import statistics
import time
from pathlib import Path
from typing import Any

import numpy as np

from bsr_io._core import Engine, xxh3_64
from bsr_io.cli.fio import drop_caches
from bsr_io.cli.synthetic import fill_chunk, synthetic_tokens
from bsr_io.load.kvcache import PagedKVCache
from bsr_io.model.keys import ChunkKey, chunk_keys
from bsr_io.model.layout import KVLayout, preset
from bsr_io.model.record import make_header
from bsr_io.restore import Restorer
from bsr_io.store import Store
from bsr_io.tiers import SSDTier
from bsr_io.tiers.files.records import record_path
from bsr_lab.bench.ttft_fit import phases
from bsr_lab.bench_state import write_state
from bsr_lab.machine_load import snapshot, summary
from bsr_lab.ttft_paths import MODEL

SMALL_STORE = 1000
STATE_MAX = 16  # the sweep's sizes up to this many chunks are restored from each store
TINY_CHUNKS = 64  # a tiny-layout prefix, read from the namespace of N records
FILLER_SEED = 11


def write_fillers(chunks_dir: Path, count: int, seed: int = FILLER_SEED) -> list[ChunkKey]:
    """`count` tiny-layout records of the bench's model, rank 0, written as plain files
    (buffered: the bench's own writer, many times faster than one published record at a
    time); their keys chain like a prompt's, so a prefix of them restores."""
    lay = preset("tiny")
    keys = chunk_keys(synthetic_tokens(seed, count * lay.chunk_tokens), lay, MODEL, 0, 1)
    payload = bytearray(lay.chunk_bytes)
    view = memoryview(payload)
    arr = np.frombuffer(payload, np.uint8)
    made: set[Path] = set()
    for i, key in enumerate(keys):
        path = record_path(chunks_dir, key)
        if path.parent not in made:
            path.parent.mkdir(parents=True, exist_ok=True)
            made.add(path.parent)
        fill_chunk(arr, seed, i)
        header = make_header(key, lay, xxh3_64(view)).encode()
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        try:
            os.write(fd, header + payload)
        finally:
            os.close(fd)
    os.sync()
    return keys


class ScaleStore:
    """One store: the state's prefix and `records` records in all."""

    def __init__(self, root: Path, lay: KVLayout, window: int, records: int, state: int) -> None:
        self.root, self.records = root, records
        self.tiny = preset("tiny")
        self.fill_keys = write_fillers(root / "chunks", records - state)
        self.engine = Engine(window, lay.chunk_bytes)
        self.tiny_engine = Engine(8, self.tiny.chunk_bytes)
        self.lay = lay

    def open(self) -> float:
        """Open the tiers (each lists the names) and make the restorers: seconds."""
        t0 = time.perf_counter()
        big = SSDTier(self.root, None, self.engine, layout=self.lay, durable=False)
        tiny = SSDTier(self.root, None, self.tiny_engine, layout=self.tiny, durable=False)
        took = time.perf_counter() - t0
        self.big = Restorer(Store([big]), self.lay, engine=self.engine, model=MODEL)
        self.small = Restorer(Store([tiny]), self.tiny, engine=self.tiny_engine, model=MODEL)
        return took


def measure_scale(
    args: argparse.Namespace, root: Path, lay: KVLayout, sizes: list[int]
) -> dict[str, Any]:
    n_large = args.store_records
    if n_large <= SMALL_STORE:
        raise ValueError(f"--store-records must be above {SMALL_STORE}, got {n_large}")
    seed = 5
    state_chunks = [n for n in sizes if n <= STATE_MAX] or sizes[:1]
    tokens = synthetic_tokens(seed, max(state_chunks) * lay.chunk_tokens)
    keys = chunk_keys(tokens, lay, MODEL, 0, 1)
    stores: dict[str, ScaleStore] = {}
    t0 = time.perf_counter()
    for name, count in (("small", SMALL_STORE), ("large", n_large)):
        s = ScaleStore(root / f"scale-{name}", lay, args.window, count, len(keys))
        tier = SSDTier(s.root, None, s.engine, layout=lay, durable=False)
        write_state(tier, s.engine, lay, keys, seed, True)
        stores[name] = s
    write_s = time.perf_counter() - t0
    open_s = {name: s.open() for name, s in stores.items()}
    dest = PagedKVCache.allocate(lay, len(tokens))
    tiny = preset("tiny")
    tiny_dest = PagedKVCache.allocate(tiny, TINY_CHUNKS * tiny.chunk_tokens)
    for d in (dest, tiny_dest):
        for t in d.tensors:
            t.zero_()
    tiny_ids = synthetic_tokens(FILLER_SEED, TINY_CHUNKS * tiny.chunk_tokens)
    cases = [(f"state_{n}", n) for n in state_chunks] + [(f"tiny_{TINY_CHUNKS}", TINY_CHUNKS)]

    def one(s: ScaleStore, case: str, n: int) -> dict[str, Any]:
        r, d, ids = (
            (s.small, tiny_dest, tiny_ids)
            if case.startswith("tiny")
            else (s.big, dest, tokens[: n * lay.chunk_tokens])
        )
        t0 = time.perf_counter()
        plan = r.probe(ids)
        res = r.restore(plan, d)
        t_end = time.perf_counter()
        if not res.complete or plan.hit_chunks != n:
            raise RuntimeError(f"scale {case}: {res.reason or plan.reason}")
        return {
            "seconds": t_end - t0,
            "phases_ms": phases(t0, plan.timings, res.marks, None, t_end),
        }

    for s in stores.values():  # warm-up: the destinations' registration with each ring
        for case, n in cases:
            one(s, case, n)
    rng = random.Random(args.seed)
    runs: dict[str, dict[str, list[dict[str, Any]]]] = {
        c: {k: [] for k in stores} for c, _ in cases
    }
    loads = [snapshot()]
    for _ in range(args.rounds):
        order = [(c, n, k) for c, n in cases for k in stores]
        rng.shuffle(order)
        for case, n, k in order:
            drop_caches()
            runs[case][k].append(one(stores[k], case, n))
        loads.append(snapshot())
    rows = {}
    for case, _ in cases:
        small, large = runs[case]["small"], runs[case]["large"]
        ratios = sorted(b["seconds"] / a["seconds"] for a, b in zip(small, large, strict=True))
        rows[case] = {
            "small_s": statistics.median(x["seconds"] for x in small),
            "large_s": statistics.median(x["seconds"] for x in large),
            "large_over_small_paired": statistics.median(ratios),
            "large_over_small_paired_range": [ratios[0], ratios[-1]],
            "small_discovery_ms": statistics.median(x["phases_ms"]["discovery"] for x in small),
            "large_discovery_ms": statistics.median(x["phases_ms"]["discovery"] for x in large),
            "per_round": runs[case],
        }
    for s in stores.values():
        s.engine.close()
        s.tiny_engine.close()
    return {
        "records": {"small": SMALL_STORE, "large": n_large},
        "filler_layout": "tiny",
        "write_s": write_s,
        # Opening a tier lists names (no header read): grows only with the listing.
        "tier_open_s": open_s,
        "cases": rows,
        "load": summary(loads),
    }


def print_scale(doc: dict[str, Any]) -> None:
    r = doc["records"]
    print(
        f"\nstore of {r['large']:,} records vs {r['small']:,} (cold cache, within-round "
        f"ratio): tiers opened in {doc['tier_open_s']['large']:.1f} s vs "
        f"{doc['tier_open_s']['small']:.2f} s"
    )
    for case, row in doc["cases"].items():
        lo, hi = row["large_over_small_paired_range"]
        print(
            f"  {case:>10}: {row['large_s'] * 1e3:7.1f} ms vs {row['small_s'] * 1e3:7.1f} ms, "
            f"ratio {row['large_over_small_paired']:.3f} ({lo:.3f}-{hi:.3f}); discovery "
            f"{row['large_discovery_ms']:.1f} vs {row['small_discovery_ms']:.1f} ms"
        )
