"""`bsr-lab bench ttft --sweep MIN:MAX`: restore time against state size, in one run.

One state of the largest size is written once; each size is a prefix of it (log-spaced,
doubling from MIN to MAX). Every round restores each size (cold cache, fresh random order
of sizes and of paths) next to fio on huge-page buffers reading the same record payloads
(`fio_hugemem`, in the directory's order) and reading as many bytes of one file written
beside them (`fio_file`, sequential: the drive's limit), both at the queue depth fio reads
that file fastest at (scanned at start: `fio_depth`); the goals are against the faster
of the two in each round (`drive`). Beside them, the engine alone reads the same payloads
into the same destination (`engine_raw`): what the restore adds to reading them. With
`--compare-inflight N`, also next to the same restore through an engine whose bytes in
flight per drive are bounded by N instead (0: by its queue depth alone, as before the
bound). With `--compare-no-tail`, also next to the same restore without the cap on its
last read's bytes in flight (`tail_inflight=None`, window.py). Per size: the medians,
their ratio, the ratio within each round, and where the restore's time went (discovery,
agreement, setup and registration, the first read, the stream, the last chunk's hash
and install, the commit: the restore's own stamps, `RestoreResult.marks`, and the
engine's request trace), and its CPU per GiB beside xxh3's over the same bytes (the hash
floor).
Over all sizes: the fixed cost, the intercept of time against bytes, with a 95% bootstrap
interval, for the restore and for fio.
"""

from __future__ import annotations

import argparse
import os
import random
import statistics
import time
from collections import deque
from pathlib import Path
from typing import Any

from bsr_io._core import Engine
from bsr_io.cli.fio import HugeMem, best_depth, drop_caches, fio_read, fio_read_payloads
from bsr_io.cli.host import process_cpu_s
from bsr_io.errors import BsrValueError
from bsr_io.load.kvcache import PagedKVCache
from bsr_io.model.layout import KVLayout
from bsr_io.model.record import HEADER_BYTES
from bsr_io.model.sizes import GiB, MiB, parse_size
from bsr_io.restore import Restorer
from bsr_lab.bench.ttft_fit import fit_with_interval, median_phases, phases, trace_span
from bsr_lab.bench_state import write_state
from bsr_lab.machine_load import snapshot, summary
from bsr_lab.ttft_paths import MODEL, TtftPaths, hash_cpu_s

FIXED_GOAL_S = 0.002  # the goal for the fixed cost
CPU_BEYOND_HASH_GOAL = 0.01  # s/GiB of restore CPU beyond hashing the same bytes
RATIO_GOALS = ((64 * MiB, 1.10), (256 * MiB, 1.03))  # (from this size up, at most)


def sweep_chunks(spec: str, chunk_bytes: int) -> list[int]:
    """Chunk counts of the sizes MIN, 2*MIN, ... up to MAX ("16MiB:8GiB"), each rounded
    to whole chunks (at least one), without repeats."""
    lo_s, sep, hi_s = spec.partition(":")
    if not sep:
        raise BsrValueError(f"--sweep {spec!r}: give MIN:MAX, e.g. 16MiB:8GiB")
    lo, hi = parse_size(lo_s), parse_size(hi_s)
    if not 0 < lo <= hi:
        raise BsrValueError(f"--sweep {spec!r}: need 0 < MIN <= MAX")
    out: list[int] = []
    size = lo
    while size <= hi:
        n = max(1, round(size / chunk_bytes))
        if n not in out:
            out.append(n)
        size *= 2
    return out


def goal_for(state_bytes: int) -> float | None:
    """The issue's ratio goal at this size (None below the smallest size it names);
    sizes within 5% below a goal's size (whole chunks) count as that size."""
    goal = None
    for at, ratio in RATIO_GOALS:
        if state_bytes >= 0.95 * at:
            goal = ratio
    return goal


class Sweep:
    """The sweep's state: one written prefix, the restorers, the destination."""

    def __init__(self, args: argparse.Namespace, root: Path, lay: KVLayout, huge: HugeMem):
        self.args, self.lay, self.huge = args, lay, huge
        self.sizes = sweep_chunks(args.sweep, lay.chunk_bytes)
        args.tokens = self.sizes[-1] * lay.chunk_tokens
        self.paths = TtftPaths(args, root, lay)  # the engine, store, keys of the largest
        self.restorers = {"fast": self.paths.fast}
        if args.compare_inflight is not None:
            other = Engine(
                args.window,
                lay.chunk_bytes,
                backend=args.backend,
                inflight_bytes=args.compare_inflight,
            )
            self.restorers["fast_compare"] = Restorer(
                self.paths.store, lay, window=args.window, engine=other, model=MODEL
            )
        if args.compare_no_tail:
            self.restorers["fast_no_tail"] = Restorer(
                self.paths.store,
                lay,
                window=args.window,
                engine=self.paths.engine,
                model=MODEL,
                tail_inflight=None,
            )
        self.dest: PagedKVCache | None = None

    def prepare(self) -> float:
        p = self.paths
        write_s = write_state(p.l2, p.engine, self.lay, p.keys, p.seed, self.args.quiet)
        self.reference = p.root / "drive-reference"
        ref_bytes = self.sizes[-1] * self.lay.chunk_bytes
        write_reference(self.reference, ref_bytes)
        # fio at its best on this drive: the depth it reads fastest at (fio.best_depth).
        iomem = self.huge.iomem("drive") if self.huge.mount else None
        scan_bytes = -(-min(ref_bytes, GiB) // MiB) * MiB
        self.fio_depth, self.fio_depth_scan = best_depth(self.reference, scan_bytes, iomem=iomem)
        self.dest = p.dest = PagedKVCache.allocate(self.lay, p.tokens)
        for t in self.dest.tensors:
            t.zero_()  # resident, as a serving engine's KV pool is
        for r in self.restorers.values():
            # Warm-up: the pool's registration with each ring happens once per process.
            self.restore(r, self.sizes[0])
        return write_s

    def restore(self, r: Restorer, chunks: int) -> dict[str, Any]:
        assert self.dest is not None
        ids = self.paths.token_ids[: chunks * self.lay.chunk_tokens]
        engine = r.engine
        t_trace = time.perf_counter()
        engine.trace_start()
        c0 = process_cpu_s()
        t0 = time.perf_counter()
        plan = r.probe(ids)
        res = r.restore(plan, self.dest)
        t_end = time.perf_counter()
        cpu = process_cpu_s() - c0
        span = trace_span(engine.trace_take(), t_trace)
        if not res.complete or plan.hit_chunks != chunks:
            raise RuntimeError(f"restore of {chunks} chunks: {res.reason or plan.reason}")
        state = chunks * self.lay.chunk_bytes
        return {
            "seconds": t_end - t0,
            # This process's CPU (every thread, the ring's included): from a drive, which
            # moves bytes by DMA, the restore's own cost; beside it, xxh3 over the same
            # bytes where they landed, the least a restore that verifies them pays.
            "cpu_s_per_gib": cpu * GiB / state,
            "hash_floor_cpu_s_per_gib": hash_cpu_s(self.dest, chunks) * GiB / state,
            "phases_ms": phases(t0, plan.timings, res.marks, span, t_end),
            "max_depth": span["max_depth"] if span else None,
            "direct_chunks": int(res.timings.get("direct_chunks", 0)),
        }

    def fio(self, chunks: int) -> dict[str, Any]:
        res = fio_read_payloads(
            self.paths.l2.path_of(self.paths.keys[0]).parent,
            payload_offset=HEADER_BYTES,
            payload_bytes=self.lay.chunk_bytes,
            files=chunks,
            iodepth=self.fio_depth,
            hugemem=self.huge,
        )
        return {"seconds": res.seconds or res.wall_s, "fio_runtime_s": res.seconds}

    def fio_file(self, chunks: int) -> dict[str, Any]:
        """fio reading the state's bytes from one file, in whole 1 MiB blocks; the time is
        scaled to the state's bytes."""
        want = chunks * self.lay.chunk_bytes
        size = -(-want // MiB) * MiB
        iomem = self.huge.iomem("drive") if self.huge.mount else None
        res = fio_read(self.reference, size=size, iodepth=self.fio_depth, iomem=iomem)
        seconds = (res.seconds or res.wall_s) * want / res.bytes_read
        return {"seconds": seconds, "fio_runtime_s": res.seconds, "bytes_read": res.bytes_read}

    def engine_raw(self, chunks: int) -> dict[str, Any]:
        """The engine alone reading the same records' payloads (each file opened, read
        from its header's end, closed) straight into the same blocks of the same
        destination as the restore (its runs, its registered memory), W chunks in
        flight: no discovery, header read, hash, verify or commit. fio reads into a few
        MiB of buffers; on this virtual machine the drive is slower the more distinct
        memory it writes (rust/core/DESIGN.md, Backends), so this is the limit for bytes
        that must land in memory as large as the state."""
        assert self.dest is not None
        engine, l2, keys = self.paths.engine, self.paths.l2, self.paths.keys
        live: deque[tuple[Any, Any]] = deque()

        def reap() -> None:
            f, read = live.popleft()
            read.wait()
            f.close()

        t0 = time.perf_counter()
        for i in range(chunks):
            where = self.dest.host_runs(i)
            assert where is not None, "the sweep's destination is host memory"
            f = engine.open(l2.path_of(keys[i]))
            live.append((f, engine.submit_read_into(f, HEADER_BYTES, *where)))
            if len(live) >= self.args.window:
                reap()
        while live:
            reap()
        return {"seconds": time.perf_counter() - t0}

    def measure(self, method: str, chunks: int) -> dict[str, Any]:
        if method == "engine_raw":
            return self.engine_raw(chunks)
        if method == "fio_hugemem":
            return self.fio(chunks)
        if method == "fio_file":
            return self.fio_file(chunks)
        return self.restore(self.restorers[method], chunks)


def write_reference(path: Path, size: int) -> None:
    """A file of `size` bytes (whole MiB) written in order and made durable, for fio."""
    block = os.urandom(16 * MiB)
    left = -(-size // MiB) * MiB
    with path.open("wb") as f:
        while left:
            n = min(left, len(block))
            f.write(block[:n])
            left -= n
        f.flush()
        os.fsync(f.fileno())


def measure_sweep(
    args: argparse.Namespace, root: Path, lay: KVLayout, huge: HugeMem
) -> dict[str, Any]:
    sw = Sweep(args, root, lay, huge)
    write_s = sw.prepare()
    methods = [*sw.restorers, "engine_raw", "fio_hugemem", "fio_file"]
    seed = args.seed if args.seed is not None else random.SystemRandom().randrange(1 << 32)
    rng = random.Random(seed)
    runs: dict[int, dict[str, list[dict[str, Any]]]] = {
        n: {m: [] for m in methods} for n in sw.sizes
    }
    cold = True
    loads = [snapshot()]
    for r in range(args.rounds):
        order = list(sw.sizes)
        rng.shuffle(order)
        for n in order:
            paths = list(methods)
            rng.shuffle(paths)
            for m in paths:
                cold &= drop_caches()
                runs[n][m].append(sw.measure(m, n))
        loads.append(snapshot())
        if not args.quiet:
            print(f"round {r + 1}/{args.rounds} done (load {loads[-1]['loadavg'][0]})")
    doc = report(sw, runs, methods, seed)
    sw.paths.engine.close()
    if "fast_compare" in sw.restorers:
        sw.restorers["fast_compare"].engine.close()
    doc.update(
        {
            "write_s": write_s,
            "cold_cache": cold,
            "load": summary(loads),
            "load_snapshots": loads,
            "machine_note": "shared machine: other sessions' work ran beside this one "
            "(see load); read the ratios and the within-round ratios, not the times",
        }
    )
    return doc


def report(
    sw: Sweep, runs: dict[int, dict[str, list[dict[str, Any]]]], methods: list[str], seed: int
) -> dict[str, Any]:
    lay, args = sw.lay, sw.args
    rows = []
    xs: dict[str, list[float]] = {m: [] for m in methods}
    ys: dict[str, list[float]] = {m: [] for m in methods}
    for n in sw.sizes:
        size = n * lay.chunk_bytes
        med = {m: statistics.median(x["seconds"] for x in runs[n][m]) for m in methods}
        for m in methods:
            xs[m] += [float(size)] * len(runs[n][m])
            ys[m] += [x["seconds"] for x in runs[n][m]]
        fio = runs[n]["fio_hugemem"]
        # The drive's limit in each round: the faster of fio's two readings of it.
        drive = [
            min(a["seconds"], b["seconds"]) for a, b in zip(fio, runs[n]["fio_file"], strict=True)
        ]
        row: dict[str, Any] = {
            "chunks": n,
            "state_bytes": size,
            **{f"{m}_s": med[m] for m in methods},
            "fast_over_fio_hugemem": med["fast"] / med["fio_hugemem"],
            "fast_over_fio_hugemem_paired": statistics.median(
                f["seconds"] / g["seconds"] for f, g in zip(runs[n]["fast"], fio, strict=True)
            ),
            "drive_s": statistics.median(drive),
            "fast_over_drive": med["fast"] / statistics.median(drive),
            "fast_over_drive_paired": statistics.median(
                f["seconds"] / d for f, d in zip(runs[n]["fast"], drive, strict=True)
            ),
            "target_fast_over_drive": goal_for(size),
            "fast_cpu_s_per_gib": statistics.median(x["cpu_s_per_gib"] for x in runs[n]["fast"]),
            "hash_floor_cpu_s_per_gib": statistics.median(
                x["hash_floor_cpu_s_per_gib"] for x in runs[n]["fast"]
            ),
            "fast_cpu_beyond_hash_s_per_gib": statistics.median(
                x["cpu_s_per_gib"] - x["hash_floor_cpu_s_per_gib"] for x in runs[n]["fast"]
            ),
            "target_cpu_beyond_hash_s_per_gib": CPU_BEYOND_HASH_GOAL,
            "fast_phases_ms": median_phases([x["phases_ms"] for x in runs[n]["fast"]]),
            "fast_max_depth": max(x["max_depth"] or 0 for x in runs[n]["fast"]),
            "per_round": runs[n],
        }
        # The restore against the engine's own read of the same bytes into the same
        # memory: what the restore adds to reading (discovery, headers, hash, commit).
        row["fast_over_engine_raw_paired"] = statistics.median(
            f["seconds"] / g["seconds"]
            for f, g in zip(runs[n]["fast"], runs[n]["engine_raw"], strict=True)
        )
        row["engine_raw_over_drive_paired"] = statistics.median(
            e["seconds"] / d for e, d in zip(runs[n]["engine_raw"], drive, strict=True)
        )
        for other in ("fast_compare", "fast_no_tail"):
            if other not in methods:
                continue
            row[f"{other}_over_fio_hugemem_paired"] = statistics.median(
                f["seconds"] / g["seconds"] for f, g in zip(runs[n][other], fio, strict=True)
            )
            row[f"fast_over_{other}_paired"] = statistics.median(
                f["seconds"] / g["seconds"]
                for f, g in zip(runs[n]["fast"], runs[n][other], strict=True)
            )
            row[f"{other}_phases_ms"] = median_phases([x["phases_ms"] for x in runs[n][other]])
        goal = row["target_fast_over_drive"]
        row["within_target"] = None if goal is None else row["fast_over_drive"] <= goal
        row["cpu_within_target"] = row["fast_cpu_beyond_hash_s_per_gib"] <= CPU_BEYOND_HASH_GOAL
        rows.append(row)
    fits = {m: fit_with_interval(xs[m], ys[m], seed) for m in methods if len(set(xs[m])) > 1}
    for f in fits.values():
        f["slope_s_per_gib"] = f.pop("slope_s_per_byte") * GiB
    fixed = fits.get("fast", {}).get("intercept_s")
    return {
        "bench": "ttft-sweep",
        "layout": lay.name,
        "chunk_bytes": lay.chunk_bytes,
        "window": args.window,
        "rounds": args.rounds,
        "sweep": args.sweep,
        "backend": sw.paths.engine.backend,
        "engine": dict(sw.paths.engine.features),
        "compare_inflight_bytes": args.compare_inflight,
        "compare_no_tail": bool(args.compare_no_tail),
        "tail_inflight_bytes": sw.paths.fast.tail_inflight,
        "fio_depth": sw.fio_depth,
        "fio_depth_scan_s": {str(d): s for d, s in sw.fio_depth_scan.items()},
        "sizes": rows,
        # Intercepts of time against bytes (weighted 1/bytes^2): the fixed cost.
        "fit": fits,
        "fixed_cost_s": fixed,
        "target_fixed_cost_s": FIXED_GOAL_S,
        "fixed_cost_within_target": None if fixed is None else fixed <= FIXED_GOAL_S,
        "seed": seed,
    }


def split_trace(doc: dict[str, Any]) -> dict[str, Any]:
    """Take every round's record (and the load snapshots) out of `doc`, which keeps the
    summaries: the rounds go beside it, compressed (docs/results keeps summaries)."""
    trace: dict[str, Any] = {"load_snapshots": doc.pop("load_snapshots", None), "sizes": {}}
    for row in doc["sizes"]:
        trace["sizes"][str(row["chunks"])] = row.pop("per_round")
    scale = doc.get("store_scale")
    if scale is not None:
        trace["store_scale"] = {c: row.pop("per_round") for c, row in scale["cases"].items()}
    return trace


def print_sweep(doc: dict[str, Any]) -> None:
    cmp_ = doc["compare_inflight_bytes"] is not None
    tail = doc.get("compare_no_tail", False)
    print(
        f"\nbench ttft --sweep {doc['sweep']}: {doc['layout']}, W={doc['window']}, "
        f"engine {doc['backend']} (inflight_bytes {doc['engine'].get('inflight_bytes')}), "
        f"fio at depth {doc['fio_depth']}, "
        f"median of {doc['rounds']}, cold cache {'yes' if doc['cold_cache'] else 'NO'}"
    )
    hdr = (
        f"{'state':>10} {'restore ms':>10} {'drive ms':>8} {'ratio':>6} {'paired':>6} {'/raw':>6}"
        + (f" {'compare':>8}" if cmp_ else "")
        + (f" {'/notail':>7}" if tail else "")
        + f" {'cpu+':>6}  phases ms (disc agree setup first stream last commit)"
    )
    print(hdr)
    for r in doc["sizes"]:
        p = r["fast_phases_ms"]
        ph = " ".join(
            f"{p.get(k, 0.0):.1f}"
            for k in ("discovery", "agreement", "setup", "first_read", "stream", "last_chunk")
        )
        print(
            f"{r['state_bytes'] / MiB:>7.0f}MiB {r['fast_s'] * 1e3:>10.1f} "
            f"{r['drive_s'] * 1e3:>8.1f} {r['fast_over_drive']:>6.3f} "
            f"{r['fast_over_drive_paired']:>6.3f} {r['fast_over_engine_raw_paired']:>6.3f}"
            + (f" {r['fast_compare_over_fio_hugemem_paired']:>8.3f}" if cmp_ else "")
            + (f" {r['fast_over_fast_no_tail_paired']:>7.3f}" if tail else "")
            + f" {r['fast_cpu_beyond_hash_s_per_gib']:>6.3f}"
            + f"  {ph} {p.get('commit', 0.0):.2f}"
        )
    for m, f in doc["fit"].items():
        lo, hi = f["intercept_95_s"]
        print(
            f"fixed cost {m}: {f['intercept_s'] * 1e3:.2f} ms (95% {lo * 1e3:.2f} to "
            f"{hi * 1e3:.2f}), {f['slope_s_per_gib']:.3f} s/GiB"
        )
