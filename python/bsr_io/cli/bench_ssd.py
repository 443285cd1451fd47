"""`bsr-io bench ssd`: the engine reading a file through W slots against fio on the same
file and a plain buffered Python read, interleaved, cold cache, median of rounds.

fio runs twice per round: on its default 4 KiB-page buffers (`fio`), and on huge-page
buffers (`fio_hugemem`, hugetlbfs), whose 1 MiB requests the disk queue does not
split: that one is the drive's limit, and `ratio_vs_fio_hugemem` the honest ratio."""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import sys
import time
from collections import deque
from pathlib import Path
from typing import Any

from bsr_io._core import Engine, File
from bsr_io.cli.fio import HugeMem, drop_caches, fio_available, fio_read, huge_page_buffers
from bsr_io.cli.report import write_json
from bsr_io.engine import as_numpy
from bsr_io.sizes import GiB, fmt_size, parse_size
from bsr_io.testing.scratch import make_scratch
from bsr_io.testing.synthetic import fill_random

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
        "--request", type=parse_size, default=parse_size("1MiB"), help="engine request size"
    )
    p.add_argument("--backend", default=None, help="engine backend (default: auto)")
    p.add_argument("--keep", action="store_true", help="keep the test file afterwards")
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


def engine_read(eng: Engine, f: File, size: int) -> tuple[float, int]:
    """Read the whole file through the window, every slot's read in flight; each slot is
    released as soon as it has been consumed. Returns (seconds, peak live bytes)."""
    slot, window = eng.slot_bytes, eng.window
    eng.reset_peak()
    inflight: deque[Any] = deque()
    off = 0
    t0 = time.perf_counter()
    while off < size or inflight:
        while off < size and len(inflight) < window:
            n = min(slot, size - off)
            inflight.append(eng.submit_read(f, off, n))
            off += n
        s = inflight.popleft().wait()
        # Consume: the slot's bytes are there to be installed; a read of one byte keeps
        # the loop honest without adding a copy.
        _ = memoryview(s)[len(s) - 1]
        del s
    elapsed = time.perf_counter() - t0
    return elapsed, eng.peak_bytes()


def buffered_read(path: Path, slot: int) -> float:
    buf = bytearray(slot)
    t0 = time.perf_counter()
    with open(path, "rb", buffering=0) as fh:
        while fh.readinto(buf):
            pass
    return time.perf_counter() - t0


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
    if args.rounds < 1:
        raise ValueError(f"--rounds must be at least 1, got {args.rounds}")
    directory = make_scratch(args.dir, "bsr-io-bench-ssd-", need_bytes=args.size,
                             what="the test file")  # fmt: skip
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
        for r in range(args.rounds):
            # Interleave the methods, rotating the order so none always goes first.
            order = list(rounds)[r % len(rounds) :] + list(rounds)[: r % len(rounds)]
            for method in order:
                cold &= drop_caches()
                if method == "fio":
                    gib_s = fio_read(path, size=args.size).gib_s
                elif method == "fio_hugemem":
                    gib_s = fio_read(path, size=args.size, iomem=huge.iomem("ssd")).gib_s
                elif method == "bsr_io":
                    seconds, p = engine_read(eng, f, args.size)
                    peak = max(peak, p)
                    gib_s = args.size / seconds / GiB
                else:
                    gib_s = args.size / buffered_read(path, args.slot) / GiB
                rounds[method].append(gib_s)
        features = dict(eng.features)
        backend = eng.backend
        slot_bytes = eng.slot_bytes
    if not cold:
        print("note: could not drop the page cache (needs root); buffered reads may be warm")
    results = {m: {"gib_s": statistics.median(v), "rounds_gib_s": v} for m, v in rounds.items()}
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
