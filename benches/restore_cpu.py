"""Where a direct-read restore's CPU goes, per thread, for two settings side by side.

Run from the repository root as root (to drop caches):
`python benches/restore_cpu.py --compare request` (1 MiB against 4 MiB requests) or
`--compare registration` (the cache registered with the ring against the same cache
read unregistered). One process writes 32,768 tokens of deepseek-v4-flash to an L2
under `--dir`, then restores them into a host cache, the two settings alternating
round by round (cache dropped before each). Per round: CPU s/GiB of the I/O thread
(`bsr-io-uring`) and of the caller, from /proc/self/task/*/schedstat, and of the
caller's in-place hash (`install_copy_s`, wall). Medians are printed.
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
from pathlib import Path

from bsr_io import Engine
from bsr_io.cli.fio import drop_caches
from bsr_io.cli.synthetic import synthetic_tokens
from bsr_io.load.kvcache import PagedKVCache
from bsr_io.model.keys import chunk_keys
from bsr_io.model.layout import preset
from bsr_io.model.sizes import GiB
from bsr_io.restore import Restorer
from bsr_io.store import Store
from bsr_io.tiers import SSDTier
from bsr_lab.bench_state import write_state

MODEL = "bsr-io-bench-restore-cpu"


def thread_ns() -> dict[tuple[str, str], int]:
    out = {}
    for t in os.listdir("/proc/self/task"):
        name = Path(f"/proc/self/task/{t}/comm").read_text().strip()
        out[(t, name)] = int(Path(f"/proc/self/task/{t}/schedstat").read_text().split()[0])
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--compare", choices=("request", "registration"), required=True)
    ap.add_argument("--tokens", type=int, default=32768)
    ap.add_argument("--rounds", type=int, default=6)
    ap.add_argument("--dir", type=Path, default=None, help="where the L2 goes (a disk)")
    args = ap.parse_args()
    lay = preset("deepseek-v4-flash")
    tokens = synthetic_tokens(5, args.tokens)
    keys = chunk_keys(tokens, lay, MODEL, 0, 1)
    state = len(keys) * lay.chunk_bytes
    with tempfile.TemporaryDirectory(dir=args.dir) as root:
        if args.compare == "request":
            engines = {
                "1MiB": Engine(32, lay.chunk_bytes, request_bytes=1 << 20),
                "4MiB": Engine(32, lay.chunk_bytes, request_bytes=4 << 20),
            }
        else:
            engine = Engine(32, lay.chunk_bytes)
            engines = {"registered": engine, "plain": engine}
        first = next(iter(engines.values()))
        write_state(SSDTier(Path(root) / "l2", None, first, layout=lay), first, lay, keys, 5, True)
        runs = {}
        for name, eng in engines.items():
            store = Store([SSDTier(Path(root) / "l2", None, eng, layout=lay)])
            dest = PagedKVCache.allocate(lay, args.tokens)
            dest.lasting = name != "plain"
            r = Restorer(store, lay, window=32, engine=eng, model=MODEL)
            r.restore(r.probe(tokens), dest)  # warm-up: registers a lasting cache
            runs[name] = (r, dest)
        rows: dict[str, list[tuple[float, float, float]]] = {n: [] for n in runs}
        for i in range(args.rounds):
            for name in list(runs) if i % 2 == 0 else list(runs)[::-1]:
                r, dest = runs[name]
                drop_caches()
                a = thread_ns()
                res = r.restore(r.probe(tokens), dest)
                z = thread_ns()
                assert res.complete, res.reason
                per_gib = GiB / state / 1e9
                io = sum(z[k] - a.get(k, 0) for k in z if k[1] == "bsr-io-uring") * per_gib
                caller = sum(z[k] - a.get(k, 0) for k in z if k[1] != "bsr-io-uring") * per_gib
                rows[name].append((io, caller, res.timings["install_copy_s"] * GiB / state))
    for name, v in rows.items():
        io, caller, hashed = (statistics.median(x[j] for x in v) for j in range(3))
        print(
            f"{name:10s} CPU s/GiB: I/O thread {io:.4f}, caller {caller:.4f} "
            f"(of which the in-place hash {hashed:.4f}), median of {len(v)} rounds"
        )


if __name__ == "__main__":
    main()
