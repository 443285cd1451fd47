"""The fixed cost of a restore: time and CPU against bytes, fitted as a + b * bytes.

Run from the repository root: `python benches/restore_fixed_cost.py --dir /dev/shm`
(a RAM-backed store that accepts O_DIRECT: the drive is out of the picture, so what is
left is the path's own cost). One process writes the largest prefix once, then, for each
size (1..N chunks, cycled), probes and restores it into one lasting host cache, `--reps`
times per size after a warm-up. Per size it prints the median wall time, the median
process CPU (user + system, every thread: robust to other load on the machine) and the
median of each phase (probe; install, with its waits for reads and its hashing or
copying on the caller's thread; commit); then the least-squares intercept `a`
(the fixed cost) and slope `b` of both against bytes. `--profile FILE` writes a cProfile
of the smallest size's restores. `--cold --dir DISK_DIR` drops the kernel's caches
(page cache, directory entries and inodes; needs root) before each restore, as `bsr-lab
bench ttft` does, and reports what the probe had to read from the drive for metadata.
"""

from __future__ import annotations

import argparse
import cProfile
import statistics
import tempfile
import time
from pathlib import Path

from bsr_io import Engine
from bsr_io.cli.fio import drop_caches
from bsr_io.cli.synthetic import synthetic_tokens
from bsr_io.load.kvcache import PagedKVCache
from bsr_io.model.keys import chunk_keys
from bsr_io.model.layout import PRESETS, preset
from bsr_io.model.sizes import MiB
from bsr_io.restore import Restorer
from bsr_io.store import Store
from bsr_io.tiers import SSDTier
from bsr_lab.bench_state import write_state

MODEL = "bsr-io-bench-fixed-cost"


def read_bytes() -> int:
    """Bytes this process has had read from a drive so far (/proc/self/io)."""
    for line in Path("/proc/self/io").read_text().splitlines():
        if line.startswith("read_bytes:"):
            return int(line.split()[1])
    return 0


def fit(xs: list[float], ys: list[float]) -> tuple[float, float]:
    """(intercept, slope) of the least-squares line through the points."""
    mx, my = statistics.fmean(xs), statistics.fmean(ys)
    sxx = sum((x - mx) ** 2 for x in xs)
    b = sum((x - mx) * (y - my) for x, y in zip(xs, ys, strict=True)) / sxx if sxx else 0.0
    return my - b * mx, b


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--layout", default="deepseek-v4-flash", choices=sorted(PRESETS))
    ap.add_argument("--chunks", default="1,2,4,8", help="sizes in chunks, comma-separated")
    ap.add_argument("--reps", type=int, default=30, help="restores per size (median kept)")
    ap.add_argument("--window", type=int, default=32)
    ap.add_argument("--queue-depth", type=int, default=None, help="engine's (default its own)")
    ap.add_argument("--request-mib", type=int, default=None, help="engine's request size")
    ap.add_argument("--dir", type=Path, default=Path("/dev/shm"), help="where the store goes")
    ap.add_argument("--profile", type=Path, default=None, help="cProfile of the smallest size")
    ap.add_argument(
        "--cold", action="store_true", help="drop the page cache before each restore (a disk)"
    )
    args = ap.parse_args()
    lay = preset(args.layout)
    sizes = sorted({int(c) for c in args.chunks.split(",")})
    if not sizes or sizes[0] < 1:
        raise SystemExit(f"--chunks must be positive chunk counts, got {args.chunks!r}")
    tokens = synthetic_tokens(5, sizes[-1] * lay.chunk_tokens)
    keys = chunk_keys(tokens, lay, MODEL, 0, 1)
    with tempfile.TemporaryDirectory(dir=args.dir, prefix="bsr-fixed-") as root:
        engine = Engine(
            args.window,
            lay.chunk_bytes,
            queue_depth=args.queue_depth,
            request_bytes=None if args.request_mib is None else args.request_mib << 20,
        )
        l2 = SSDTier(Path(root) / "l2", None, engine, layout=lay)
        write_state(l2, engine, lay, keys, 5, True)
        r = Restorer(Store([l2]), lay, window=args.window, engine=engine, model=MODEL)
        dest = PagedKVCache.allocate(lay, len(tokens))
        for t in dest.tensors:
            t.zero_()
        rows = []
        for n in sizes:
            ids = tokens[: n * lay.chunk_tokens]
            for _ in range(3):  # warm-up: the cache's registration, first calls
                assert r.restore(r.probe(ids), dest).complete
            prof = cProfile.Profile() if args.profile and n == sizes[0] else None
            wall, cpu, probe, inst, commit, waited, hashed = [], [], [], [], [], [], []
            direct, meta = [], []
            for _ in range(args.reps):
                if args.cold:
                    drop_caches()
                b0, c0, t0 = read_bytes(), time.process_time(), time.perf_counter()
                if prof:
                    prof.enable()
                plan = r.probe(ids)
                t1 = time.perf_counter()
                meta.append(read_bytes() - b0)
                res = r.restore(plan, dest)
                if prof:
                    prof.disable()
                wall.append(time.perf_counter() - t0)
                cpu.append(time.process_time() - c0)
                assert res.complete, res.reason
                probe.append(t1 - t0)
                inst.append(res.timings["install_s"])
                commit.append(res.timings["commit_s"])
                waited.append(res.timings["read_wait_s"])
                hashed.append(res.timings["install_copy_s"])
                direct.append(res.timings["direct_chunks"])
            if prof:
                prof.dump_stats(args.profile)
            phases = (wall, cpu, probe, inst, commit, waited, hashed)
            med = [statistics.median(v) * 1e3 for v in phases]
            rows.append((n * lay.chunk_bytes, med))
            print(
                f"{n:4d} chunks {n * lay.chunk_bytes / MiB:9.1f} MiB: wall {med[0]:7.3f} ms, "
                f"CPU {med[1]:7.3f} ms (probe {med[2]:.3f}, install {med[3]:.3f} of which "
                f"waiting for reads {med[5]:.3f} and hashing/copying {med[6]:.3f}, "
                f"commit {med[4]:.3f}; direct {statistics.median(direct):.0f}; "
                f"probe read {statistics.median(meta) / 1024:.0f} KiB from the drive)"
            )
        engine.close()
    xs = [float(b) for b, _ in rows]
    for j, what in ((0, "wall"), (1, "CPU")):
        a, b = fit(xs, [m[j] for _, m in rows])
        print(f"{what}: fixed cost a = {a:.3f} ms, b = {b * (1 << 30) / 1e3:.4f} s/GiB")


if __name__ == "__main__":
    main()
