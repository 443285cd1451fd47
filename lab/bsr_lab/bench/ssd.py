"""`bsr-lab bench ssd`: the engine reading a file through W slots against fio on the same
file and a plain buffered Python read, interleaved, cold cache, median of rounds.
The paths run in a fresh random order each round (`--seed`), so none always follows
another, and the machine's load is recorded before and after every round.

fio runs twice per round: on its default 4 KiB-page buffers (`fio`), and on huge-page
buffers (`fio_hugemem`, hugetlbfs), whose 1 MiB requests the disk queue does not
split: that one is the drive's limit, and `ratio_vs_fio_hugemem` the honest ratio.

`--trace` also records every request of the engine's runs (its I/O thread stamps them)
and every I/O of fio's, and reports for each the mean depth in flight, the latency
percentiles, and, for the engine, the share of the run its queue was short with nothing
queued (the consumer late) or with requests queued (the I/O thread late)."""

from __future__ import annotations

import argparse
import os
import random
import shutil
import statistics
import sys
import time
from collections import deque
from pathlib import Path
from typing import Any

from bsr_io._core import Engine
from bsr_io.cli.bench_store import engine_read
from bsr_io.cli.fio import HugeMem, drop_caches, fio_available, fio_read, huge_page_buffers
from bsr_io.cli.host import huge_page_bytes
from bsr_io.cli.report import write_json
from bsr_io.cli.scratch import make_scratch
from bsr_io.cli.synthetic import fill_random
from bsr_io.engine import as_numpy
from bsr_io.model.sizes import GiB, fmt_size, parse_size
from bsr_lab.machine_load import snapshot, summary
from bsr_lab.trace import engine_summary, fio_summary

FIO_BLOCK, FIO_DEPTH = 1 << 20, 32  # fio_read's request size and queue depth
METHODS = ("fio", "fio_hugemem", "bsr_io", "buffered")


def register(bench_subparsers: Any) -> None:
    p = bench_subparsers.add_parser(
        "ssd",
        help="engine read speed through W slots vs fio vs buffered read",
        description=__doc__,
    )
    p.add_argument("--size", type=parse_size, default=parse_size("2GiB"), help="test file size")
    p.add_argument("--window", type=int, default=4, help="W: staging slots")
    p.add_argument("--slot", type=parse_size, default=parse_size("16MiB"), help="slot size")
    p.add_argument("--dir", type=Path, default=None, help="where to put the test file")
    p.add_argument("--json", type=Path, default=None, help="write the results here")
    p.add_argument("--rounds", type=int, default=3, help="rounds (median is reported)")
    p.add_argument("--queue-depth", type=int, default=32, help="engine queue depth")
    p.add_argument(
        "--request",
        type=parse_size,
        default=parse_size("1MiB"),
        help="engine request size (default fio's block size, so both queue the same bytes; "
        "the engine's own default is 4MiB)",
    )
    p.add_argument("--backend", default=None, help="engine backend (default: auto)")
    p.add_argument("--keep", action="store_true", help="keep the test file afterwards")
    p.add_argument("--seed", type=int, default=None, help="seed of the per-round order")
    p.add_argument(
        "--trace", action="store_true", help="trace request depth and latency (engine, fio)"
    )
    p.set_defaults(func=run)


def write_test_file(path: Path, size: int, window: int, slot: int) -> None:
    """Write `size` pseudo-random bytes with O_DIRECT through the engine."""
    with Engine(window, slot) as eng:
        f = eng.open(path, create=True)
        pending: deque[Any] = deque()
        for off in range(0, size, slot):
            if len(pending) == window:
                pending.popleft().wait()
            s = eng.lease()
            fill_random(as_numpy(s), 0x5EED, off)
            pending.append(eng.submit_write(s, f, off, min(slot, size - off)))
            del s
        while pending:
            pending.popleft().wait()
        f.sync()
        f.close()


def buffered_read(path: Path, slot: int) -> float:
    buf = bytearray(slot)
    t0 = time.perf_counter()
    with open(path, "rb", buffering=0) as fh:
        while fh.readinto(buf):
            pass
    return time.perf_counter() - t0


def arena_huge_bytes(eng: Engine) -> int | None:
    """Bytes of the engine's arena backed by transparent huge pages (see huge_page_bytes)."""
    return huge_page_bytes(eng.arena_address, eng.arena_bytes)


def queue_max_segments(path: Path) -> int | None:
    """The disk queue's segments per request for the device holding `path`: a 1 MiB read
    into 4 KiB pages needs 256, so below that the request is split."""
    dev = os.stat(path).st_dev
    sys_dev = Path(f"/sys/dev/block/{os.major(dev)}:{os.minor(dev)}").resolve()
    for q in (sys_dev / "queue", sys_dev.parent / "queue"):  # a partition: its disk's
        try:
            return int((q / "max_segments").read_text())
        except (OSError, ValueError):
            continue
    return None


def run(args: argparse.Namespace) -> int:
    if args.window < 1:
        raise ValueError(f"--window must be at least 1, got {args.window}")
    if args.slot <= 0 or args.size <= 0:
        raise ValueError("--slot and --size must be positive")
    if args.size < FIO_BLOCK or args.size % 4096:
        # O_DIRECT reads whole 4 KiB blocks, and fio (the reference) reads 1 MiB requests.
        raise ValueError(
            f"--size {args.size} must be at least {fmt_size(FIO_BLOCK)} (fio's request) and "
            "a whole number of 4 KiB blocks (O_DIRECT's unit)"
        )
    if args.rounds < 1:
        raise ValueError(f"--rounds must be at least 1, got {args.rounds}")
    directory = make_scratch(
        args.dir, "bsr-io-bench-ssd-", need_bytes=args.size, what="the test file"
    )
    path = directory / f"bsr-io-bench-ssd-{args.size}.bin"
    have_fio = fio_available()
    if not have_fio:
        print("note: fio not found (apt-get install fio); no reference run", file=sys.stderr)
    try:
        print(f"writing {fmt_size(args.size)} test file {path} with O_DIRECT ...", flush=True)
        write_test_file(path, args.size, args.window, args.slot)
        with huge_page_buffers(FIO_BLOCK * FIO_DEPTH) as huge:
            report = measure(args, path, have_fio, huge)
    finally:
        if not args.keep:
            shutil.rmtree(directory, ignore_errors=True)
    print_table(report)
    write_json(args.json, report)
    return 0


def measure(
    args: argparse.Namespace, path: Path, have_fio: bool, huge: HugeMem | None = None
) -> dict[str, Any]:
    huge = huge or HugeMem(None, "not requested")
    skip = set() if have_fio else {"fio", "fio_hugemem"}
    if huge.mount is None:
        skip.add("fio_hugemem")
        if have_fio:
            print(f"note: fio on huge pages not run: {huge.note}", file=sys.stderr)
    rounds: dict[str, list[float]] = {m: [] for m in METHODS if m not in skip}
    traces: dict[str, list[dict[str, Any]]] = {m: [] for m in ("bsr_io", "fio_hugemem")}
    seed = args.seed if args.seed is not None else random.SystemRandom().randrange(1 << 32)
    rng = random.Random(seed)
    orders: list[list[str]] = []
    loads = [snapshot()]
    lat_log = fio_summary if args.trace else None
    cold = True
    peak = 0
    with Engine(
        args.window,
        args.slot,
        queue_depth=args.queue_depth,
        request_bytes=args.request,
        backend=args.backend,
    ) as eng:
        f = eng.open(path)
        if not f.direct:
            print(f"note: {path} is not on an O_DIRECT filesystem; engine reads are buffered")
        huge_bytes = arena_huge_bytes(eng)
        for _ in range(args.rounds):
            # Interleave the methods in a fresh random order: none always goes first or
            # always follows another (a drive that bursts, then throttles, would favour
            # whichever path a fixed order puts after a quiet one).
            order = list(rounds)
            rng.shuffle(order)
            orders.append(order)
            for method in order:
                cold &= drop_caches()
                if method == "fio":
                    gib_s = fio_read(path, size=args.size).gib_s
                elif method == "fio_hugemem":
                    res = fio_read(path, size=args.size, iomem=huge.iomem("ssd"), lat_log=lat_log)
                    gib_s = res.gib_s
                    if res.trace is not None:
                        traces[method].append(res.trace)
                elif method == "bsr_io":
                    if args.trace:
                        eng.trace_start()
                    seconds, p = engine_read(eng, f, args.size)
                    if args.trace:
                        traces[method].append(engine_summary(eng.trace_take(), args.queue_depth))
                    peak = max(peak, p)
                    gib_s = args.size / seconds / GiB
                else:
                    gib_s = args.size / buffered_read(path, args.slot) / GiB
                rounds[method].append(gib_s)
            loads.append(snapshot())
        features = dict(eng.features)
        backend = eng.backend
        slot_bytes = eng.slot_bytes
    if not cold:
        print("note: could not drop the page cache (needs root); buffered reads may be warm")
    results: dict[str, dict[str, Any]] = {
        m: {"gib_s": statistics.median(v), "rounds_gib_s": v} for m, v in rounds.items()
    }
    fio = results.get("fio", {}).get("gib_s")
    fio_huge = results.get("fio_hugemem", {}).get("gib_s")
    if "fio_hugemem" not in results:
        results["fio_hugemem"] = {"gib_s": None, "note": huge.note}

    def per_round(ref: str) -> list[float] | None:
        # Same-round ratios (runs seconds apart) show how much of the spread is the
        # drive (shared, virtual) rather than the engine.
        if ref not in rounds:
            return None
        return [b / f for b, f in zip(rounds["bsr_io"], rounds[ref], strict=True)]

    return {
        "backend": backend,
        "cold_cache": cold,
        "seed": seed,
        "orders": orders,
        "load": summary(loads),
        "load_snapshots": loads,
        "trace": traces if args.trace else None,
        "trace_medians": _trace_medians(traces) if args.trace else None,
        "arena_huge_page_bytes": huge_bytes,
        "size_bytes": args.size,
        "window": args.window,
        "slot_bytes": slot_bytes,
        "queue_depth": args.queue_depth,
        "request_bytes": args.request,
        "rounds": args.rounds,
        "results": {**{"fio": {"gib_s": None}}, **results},
        "ratio_vs_fio": results["bsr_io"]["gib_s"] / fio if fio else None,
        "ratio_vs_fio_rounds": per_round("fio"),
        # Against fio on huge-page buffers: the drive's real limit.
        "ratio_vs_fio_hugemem": results["bsr_io"]["gib_s"] / fio_huge if fio_huge else None,
        "ratio_vs_fio_hugemem_rounds": per_round("fio_hugemem"),
        "fio_hugemem_note": huge.note,
        "rws_peak_bytes": peak,
        "rws_bound_bytes": args.window * slot_bytes,
        "features": features,
        "queue_max_segments": queue_max_segments(path),
        "file": path.name,
    }


def _trace_medians(traces: dict[str, list[dict[str, Any]]]) -> dict[str, Any]:
    """Per path, the median over rounds of its mean depth and latency percentiles (and,
    for the engine, of the share of time its queue was full)."""
    out: dict[str, Any] = {}
    for method, runs in traces.items():
        runs = [t for t in runs if t.get("requests")]
        if not runs:
            continue
        row = {
            "mean_depth": statistics.median(t["mean_depth"] for t in runs),
            "latency_p50_ms": statistics.median(t["latency_ms"]["p50"] for t in runs),
            "latency_p99_ms": statistics.median(t["latency_ms"]["p99"] for t in runs),
        }
        if "time_full" in runs[0]:
            row["time_full"] = statistics.median(t["time_full"] for t in runs)
        out[method] = row
    return out


def print_table(rep: dict[str, Any]) -> None:
    print(
        f"\nbench ssd: {fmt_size(rep['size_bytes'])} file, W={rep['window']} x "
        f"{fmt_size(rep['slot_bytes'])} slots, backend {rep['backend']}, "
        f"cold cache {'yes' if rep['cold_cache'] else 'NO'}, median of {rep['rounds']}"
    )
    print(f"{'method':<12} {'GiB/s':>7}   rounds")
    for m in METHODS:
        r = rep["results"].get(m, {})
        if r.get("gib_s") is None:
            print(f"{m:<12} {'n/a':>7}   {r.get('note', '')}")
            continue
        rounds = " ".join(f"{x:.2f}" for x in r["rounds_gib_s"])
        print(f"{m:<12} {r['gib_s']:>7.3f}   {rounds}")
    for ref in ("fio", "fio_hugemem"):
        ratio = rep["ratio_vs_" + ref]
        if ratio is None:
            print(f"ratio bsr_io/{ref}: n/a")
            continue
        per_round = " ".join(f"{x:.2f}" for x in rep[f"ratio_vs_{ref}_rounds"])
        print(f"ratio bsr_io/{ref}: {ratio:.3f}   (per round: {per_round})")
    print(
        f"RWS peak: {fmt_size(rep['rws_peak_bytes'])} "
        f"(bound W x slot = {fmt_size(rep['rws_bound_bytes'])})"
    )
    load = rep["load"]
    print(
        f"load: 1-minute average {load['loadavg_1m_min']:.2f}-{load['loadavg_1m_max']:.2f}, "
        f"other processes up to {load['others_cores_max']:.2f} cores"
    )
    for method, runs in (rep["trace"] or {}).items():
        for t in runs:
            if not t.get("requests"):
                continue
            lat = t["latency_ms"]
            extra = ""
            if "time_full" in t:
                extra = (
                    f", full {t['time_full']:.0%}, short+idle "
                    f"{t['time_short_nothing_queued']:.0%}, short+queued "
                    f"{t['time_short_requests_queued']:.0%}"
                )
            print(
                f"trace {method:<12} depth {t['mean_depth']:5.1f}, latency p50 "
                f"{lat['p50']:.1f} ms p99 {lat['p99']:.1f} ms, {t['gib_s_in_span']:.2f} GiB/s"
                + extra
            )
