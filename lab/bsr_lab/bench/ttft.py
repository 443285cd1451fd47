"""`bsr-lab bench ttft`: time from the restore request to a committed prefix, cold cache.

One run writes a long prefix of a KV layout through the L2 tier once, then, with
the page cache dropped before each measurement:

- naive: the whole-plan baseline (bsr_io/cli/whole_plan.py) as LMCache 0.5.6's local disk
  backend runs it: an L1 buffer for every hit chunk from a resident pool, one buffered
  Python `readinto` per chunk file on 4 reader threads (its `disk_io_threads`), then
  the install of every staged chunk;
- naive_engine: the control: the same whole-plan staging into the same pool, but read
  through BSR's engine at the same queue depth. naive over naive_engine is what the
  I/O path buys; naive_engine over fast is what bounded staging (reads overlapped
  with installs, W slots) buys;
- fast: BSR through the engine (O_DIRECT, W staging slots, reads overlapped with the
  install, checksums verified), into the same destination;
- fio, fio_hugemem: fio (io_uring, O_DIRECT) reading the same record files' payload
  ranges, on its default 4 KiB-page buffers and on huge-page buffers (the drive's
  real limit, see fio.py); times as fio measures them.

Staging memory is reported twice: as counted (the engine's RWS, the pool's bytes) and as
measured, the process's peak-RSS growth while each path's staging is set up (the
engine's arena; the whole-plan pool) plus its largest growth during one restore.

The speedup is naive over fast; fast over fio_hugemem says how close the fast path is
to the drive.
"""

from __future__ import annotations

import argparse
import random
import statistics
import sys
from pathlib import Path
from typing import Any

from bsr_io.cli.fio import (
    HugeMem,
    drop_caches,
    fio_available,
    huge_page_buffers,
)
from bsr_io.cli.host import check_memory, huge_page_bytes
from bsr_io.cli.progress import bar
from bsr_io.cli.report import write_json, write_trace
from bsr_io.cli.scratch import check_room, scratch_base, scratch_dir
from bsr_io.load.kvcache import PagedKVCache
from bsr_io.model.layout import PRESETS, KVLayout, preset
from bsr_io.model.record import HEADER_BYTES
from bsr_io.model.sizes import GiB, fmt_size
from bsr_lab.bench_state import write_fio_file, write_state
from bsr_lab.machine_load import snapshot, summary
from bsr_lab.targets import not_applicable, verdict
from bsr_lab.ttft_paths import FIO_DEPTH, TtftPaths, records_readable_by_fio

METHODS = ("naive", "naive_engine", "fio", "fast", "fio_hugemem")
DONE_RATIO = 1.15  # the target: fast_s within this factor of fio_s
HUGE_RATIO = 1.10  # fast_s within this factor of fio_hugemem_s
CPU_GOAL = 0.15  # restore CPU s/GiB (direct reads leave only the hash)


def register(bench_subparsers: Any) -> None:
    p = bench_subparsers.add_parser(
        "ttft",
        help="restore latency: naive whole-plan vs BSR vs fio, cold cache",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--tokens", type=int, default=131072, help="prefix length (default 131072)")
    p.add_argument("--layout", default="deepseek-v4-flash", choices=sorted(PRESETS))
    p.add_argument("--window", type=int, default=32, help="W: BSR staging slots")
    p.add_argument("--dir", type=Path, default=None, help="where to put the store (on disk)")
    p.add_argument("--rounds", type=int, default=3, help="rounds of all three (median kept)")
    p.add_argument("--json", type=Path, default=None, help="write the results here")
    p.add_argument("--plot", type=Path, default=None, help="bar chart of the three times (PNG)")
    p.add_argument(
        "--naive-threads",
        type=int,
        default=4,
        help="reader threads of the naive path (LMCache's disk_io_threads, default 4)",
    )
    p.add_argument(
        "--skip-naive",
        action="store_true",
        help="measure only the fast path and fio (for a state whose whole-plan "
        "staging does not fit in memory, e.g. --tokens 524288)",
    )
    p.add_argument("--backend", default=None, help="engine backend (default: auto)")
    p.add_argument("--keep", action="store_true", help="keep the store afterwards")
    p.add_argument("--quiet", action="store_true", help="no progress bars")
    p.add_argument("--seed", type=int, default=None, help="seed of the per-round order")
    p.add_argument(
        "--sweep",
        default=None,
        metavar="MIN:MAX",
        help="sweep state sizes from MIN to MAX, doubling (e.g. 16MiB:8GiB), each next to "
        "fio on huge pages, and fit the fixed cost (ttft_sweep.py); --tokens is ignored",
    )
    p.add_argument(
        "--compare-inflight",
        type=int,
        default=None,
        metavar="BYTES",
        help="with --sweep: also restore through an engine with this bound on bytes in "
        "flight per drive (0: the queue depth alone, as before the bound), interleaved",
    )
    p.add_argument(
        "--compare-no-tail",
        action="store_true",
        help="with --sweep: also restore without the cap on the last read's bytes in "
        "flight (tail_inflight=None), interleaved",
    )
    p.add_argument(
        "--store-records",
        type=int,
        default=None,
        metavar="N",
        help="with --sweep: also restore prefixes from a store padded to N records of the "
        "same model and rank (tiny ones) against one of 1000, interleaved (ttft_scale.py)",
    )
    p.set_defaults(func=run)


# -- the state -------------------------------------------------------------------------
def _disk_needed(lay: KVLayout, chunks: int) -> tuple[int, str]:
    """Bytes of the records (and of fio's reference file where fio cannot read them)."""
    state = chunks * lay.chunk_bytes
    ref = 0 if records_readable_by_fio(lay) else state
    disk = chunks * (lay.chunk_bytes + HEADER_BYTES) + ref + (256 << 20)
    what = f"{chunks * lay.chunk_tokens} tokens of {lay.name} as records" + (
        f" plus fio's reference file ({fmt_size(ref)})" if ref else ""
    )
    return disk, what


def _check_memory(lay: KVLayout, chunks: int, window: int, naive: bool) -> None:
    # The destination and BSR's slots, plus the naive path's L1 pool of the whole state.
    state = chunks * lay.chunk_bytes
    check_memory(
        (2 if naive else 1) * state + window * lay.chunk_bytes,
        f"{chunks * lay.chunk_tokens} tokens of {lay.name} ("
        + (
            f"the naive path stages the whole state, {fmt_size(state)}, in L1 next to the "
            "destination)"
            if naive
            else f"the destination KV cache alone is {fmt_size(state)})"
        ),
        "fewer --tokens, or --skip-naive to measure only BSR and fio"
        if naive
        else "fewer --tokens",
    )


def run(args: argparse.Namespace) -> int:
    lay = preset(args.layout)
    if args.tokens < lay.chunk_tokens:
        raise ValueError(
            f"--tokens {args.tokens} is less than one chunk ({lay.chunk_tokens} tokens)"
        )
    if args.window < 1:
        raise ValueError(f"--window must be at least 1, got {args.window}")
    if args.rounds < 1:
        raise ValueError(f"--rounds must be at least 1, got {args.rounds}")
    if args.naive_threads < 1:
        raise ValueError(f"--naive-threads must be at least 1, got {args.naive_threads}")
    have_fio = fio_available()
    if not have_fio:
        raise ValueError(
            "fio is not installed (Debian/Ubuntu: apt-get install fio); it is the "
            "reference this benchmark reports against"
        )
    if args.sweep is not None:
        from bsr_lab.bench.ttft_sweep import sweep_chunks

        args.skip_naive = True
        args.tokens = sweep_chunks(args.sweep, lay.chunk_bytes)[-1] * lay.chunk_tokens
    elif (
        args.compare_inflight is not None or args.store_records is not None or args.compare_no_tail
    ):
        raise ValueError(
            "--compare-inflight, --compare-no-tail and --store-records go with --sweep"
        )
    chunks = args.tokens // lay.chunk_tokens
    disk, what = _disk_needed(lay, chunks)
    hint = "use --dir on a larger disk or fewer --tokens"
    check_room(scratch_base(args.dir), disk, what, hint)  # disk first, then memory
    _check_memory(lay, chunks, args.window, naive=not args.skip_naive)
    with (
        scratch_dir(
            args.dir,
            "bsr-io-ttft-",
            need_bytes=disk,
            what=what,
            hint="use --dir on a larger disk or fewer --tokens",
            keep=args.keep,
        ) as root,
        huge_page_buffers(FIO_DEPTH << 20) as huge,
    ):
        if args.sweep is not None:
            return _run_sweep(args, root, lay, huge)
        doc = measure(args, root, lay, huge)
    print_table(doc)
    write_json(args.json, doc)
    if args.plot:
        from bsr_lab.plots import plot_ttft

        plot_ttft(doc, args.plot)
        print(f"wrote {args.plot}")
    return 0


def _run_sweep(args: argparse.Namespace, root: Path, lay: KVLayout, huge: HugeMem) -> int:
    from bsr_lab.bench.ttft_sweep import measure_sweep, print_sweep, split_trace

    if huge.mount is None:
        raise ValueError(f"the sweep compares against fio on huge pages: {huge.note}")
    doc = measure_sweep(args, root, lay, huge)
    if args.store_records is not None:
        from bsr_lab.bench.ttft_scale import measure_scale, print_scale

        sizes = [r["chunks"] for r in doc["sizes"]]
        doc["store_scale"] = measure_scale(args, root, lay, sizes)
    print_sweep(doc)
    if "store_scale" in doc:
        print_scale(doc["store_scale"])
    if args.json is not None:
        doc["rounds_file"] = write_trace(args.json, split_trace(doc))
    write_json(args.json, doc)
    return 0


def _one(b: TtftPaths, method: str) -> dict[str, Any]:
    if method.startswith("naive"):
        return b.naive(method)
    if method == "fast":
        return b.fast_path()
    return b.fio(method)


def measure(
    args: argparse.Namespace, root: Path, lay: KVLayout, huge: HugeMem | None = None
) -> dict[str, Any]:
    b = TtftPaths(args, root, lay)
    b.huge = huge or HugeMem(None, "not requested")
    q = args.quiet
    write_s = write_state(b.l2, b.engine, lay, b.keys, b.seed, q)
    if not records_readable_by_fio(lay):
        b.fio_file = root / "fio-reference.bin"
        write_fio_file(b.fio_file, b.state, b.engine, q)
    b.dest = PagedKVCache.allocate(lay, b.tokens)
    for t in b.dest.tensors:
        t.zero_()  # fault the destination in once: a serving engine's KV pool is resident
    # Direct reads land in the cache: on 4 KiB pages their requests would be split.
    dest_huge = [
        huge_page_bytes(t.data_ptr(), t.numel() * t.element_size()) for t in b.dest.tensors
    ]
    skip = {"naive", "naive_engine"} if args.skip_naive else set()
    if b.huge.mount is None:
        skip.add("fio_hugemem")
        print(f"note: fio on huge pages not run: {b.huge.note}", file=sys.stderr)
    methods = tuple(m for m in METHODS if m not in skip)
    if not args.skip_naive:
        b.prepare_whole_plan()
    rounds: dict[str, list[dict[str, Any]]] = {m: [] for m in methods}
    cold = True
    ok = True
    seed = args.seed if args.seed is not None else random.SystemRandom().randrange(1 << 32)
    rng = random.Random(seed)
    orders: list[list[str]] = []
    loads = [snapshot()]
    for r in range(args.rounds):
        # A fresh random order each round: no path always follows another (the drive's
        # speed drifts over tens of seconds on shared or virtual disks).
        order = list(methods)
        rng.shuffle(order)
        orders.append(order)
        for method in order:
            for t in b.dest.tensors:
                t.zero_()  # so the check below sees this run's bytes, not an earlier run's
            cold &= drop_caches()
            with bar(None, f"round {r + 1}/{args.rounds}: {method}", quiet=q, unit="it"):
                rounds[method].append(_one(b, method))
            if not method.startswith("fio"):
                ok &= b.check()
        loads.append(snapshot())
    med = {m: statistics.median(x["seconds"] for x in v) for m, v in rounds.items()}
    # Where the fast path's time went, in its median round (parts of one run add up).
    mid = min(rounds["fast"], key=lambda x: abs(x["seconds"] - med["fast"]))
    profile = {k: mid[k] for k in ("read_wait_s", "install_copy_s", "commit_s")}
    profile["other_s"] = mid["seconds"] - sum(profile.values())
    naive = "naive" in med
    nmid = min(rounds["naive"], key=lambda x: abs(x["seconds"] - med["naive"])) if naive else {}
    huge_s = med.get("fio_hugemem")
    na = not_applicable(lay, b.chunks, args.window)
    doc = {
        "layout": lay.name,
        "tokens": b.tokens,
        "chunks": b.chunks,
        "chunk_bytes": lay.chunk_bytes,
        "state_bytes": b.state,
        "window": args.window,
        "backend": b.engine.backend,
        "cold_cache": cold,
        "rounds": args.rounds,
        "naive_s": med.get("naive"),
        "naive_measured": naive,
        # The control: whole-plan staging read through BSR's engine (same queue depth).
        "naive_engine_s": med.get("naive_engine"),
        "fast_s": med["fast"],
        # The restore's CPU per GiB read from the drive (median round) and how many chunks
        # were read straight into the cache (the rest through the slots).
        "fast_cpu_s_per_gib": statistics.median(x["cpu_s_per_gib"] for x in rounds["fast"]),
        "target_fast_cpu_s_per_gib": CPU_GOAL,
        # Same rounds: hashing the restored bytes in memory, no read (every byte must pass
        # through a core to be verified), and what the restore costs beyond that.
        "hash_floor_cpu_s_per_gib": statistics.median(
            x["hash_floor_cpu_s_per_gib"] for x in rounds["fast"]
        ),
        "fast_cpu_beyond_hash_s_per_gib": statistics.median(
            x["cpu_s_per_gib"] - x["hash_floor_cpu_s_per_gib"] for x in rounds["fast"]
        ),
        "fast_direct_chunks": [x["direct_chunks"] for x in rounds["fast"]],
        "fio_s": med["fio"],
        "fio_hugemem_s": huge_s,
        "fio_hugemem_note": b.huge.note,
        "fio_source": "record payloads"
        if b.fio_file is None
        else "reference file (payloads not 4 KiB multiples)",
        "speedup": med["naive"] / med["fast"] if naive else None,
        # What the I/O path buys (same whole-plan staging), and what bounded staging buys
        # (same engine reads): their product is the speedup.
        "speedup_io_path": med["naive"] / med["naive_engine"] if naive else None,
        "speedup_bounded_staging": med["naive_engine"] / med["fast"] if naive else None,
        # fast's time over fio's on huge pages (the drive's limit); 1.0 = at the limit.
        "fast_over_fio_hugemem": med["fast"] / huge_s if huge_s else None,
        "target_fast_over_fio_hugemem": HUGE_RATIO,
        # Why the targets do not apply to this input (None: they do; then the booleans).
        "target_not_applicable": na,
        "fast_over_fio_hugemem_within_target": med["fast"] <= HUGE_RATIO * huge_s
        if huge_s and na is None
        else None,
        "fast_vs_fio": med["fast"] / med["fio"],
        "fast_within_target": med["fast"] <= DONE_RATIO * med["fio"] if na is None else None,
        "fast_cpu_within_target": None,  # set below from the median CPU
        # The same ratio taken within each round (fast and fio adjacent), then the median.
        "fast_vs_fio_paired": statistics.median(
            f["seconds"] / g["seconds"] for f, g in zip(rounds["fast"], rounds["fio"], strict=True)
        ),
        "target_fast_vs_fio": DONE_RATIO,
        "fast_over_fio_hugemem_paired": statistics.median(
            f["seconds"] / g["seconds"]
            for f, g in zip(rounds["fast"], rounds["fio_hugemem"], strict=True)
        )
        if huge_s
        else None,
        "gib_s": {m: b.state / med[m] / GiB if m in med else None for m in METHODS},
        # Unmeasured, the naive path's staging is still the whole state: it needs that L1.
        "rws_naive_bytes": max(x["rws_bytes"] for x in rounds["naive"]) if naive else b.state,
        "rws_fast_bytes": max(x["rws_bytes"] for x in rounds["fast"]),
        # Measured: peak-RSS growth as the staging came to be (arena; pool) plus the
        # largest growth during one of the path's restores.
        "staging_vmhwm_naive_bytes": b.pool_vmhwm_bytes
        + max(x["vmhwm_growth_bytes"] for x in rounds["naive"])
        if naive
        else None,
        "staging_vmhwm_fast_bytes": b.arena_vmhwm_bytes
        + max(x["vmhwm_growth_bytes"] for x in rounds["fast"]),
        "data_ok": ok,
        "write_s": write_s,
        "naive_threads": args.naive_threads,
        "fast_profile_s": profile,
        "naive_profile_s": {k: nmid[k] for k in ("stage_s", "install_s")} if naive else None,
        "per_round": rounds,
        "dest_huge_page_bytes": None if None in dest_huge else sum(x or 0 for x in dest_huge),
        "dest_bytes": sum(t.numel() * t.element_size() for t in b.dest.tensors),
        "seed": seed,
        "orders": orders,
        "load": summary(loads),
        "load_snapshots": loads,
        "metrics": b.metrics.snapshot(),
    }
    if na is None:
        doc["fast_cpu_within_target"] = doc["fast_cpu_s_per_gib"] <= CPU_GOAL
    b.engine.close()
    return doc


def print_table(doc: dict[str, Any]) -> None:
    print(
        f"\nbench ttft: {doc['tokens']:,} tokens of {doc['layout']} = "
        f"{fmt_size(doc['state_bytes'])} ({doc['chunks']} chunks), W={doc['window']}, "
        f"engine {doc['backend']}, cold cache "
        f"{'yes' if doc['cold_cache'] else 'NO (not root)'}, median of {doc['rounds']}"
    )
    hdr = f"{'path':<13} {'seconds':>8} {'GiB/s':>7} {'staging peak':>13}"
    print(hdr)
    print("-" * len(hdr))
    peaks = {
        "naive": doc["rws_naive_bytes"],
        "naive_engine": doc["rws_naive_bytes"],
        "fast": doc["rws_fast_bytes"],
    }
    for m in METHODS:
        peak = fmt_size(peaks[m]) if m in peaks else "-"
        if doc[m + "_s"] is None:
            print(f"{m:<13} {'skipped':>8} {'-':>7} {('needs ' + peak) if m in peaks else '':>13}")
            continue
        print(f"{m:<13} {doc[m + '_s']:>8.2f} {doc['gib_s'][m]:>7.2f} {peak:>13}")
    if doc["fio_hugemem_s"] is None:
        print(f"fio on huge pages not run: {doc['fio_hugemem_note']}")
    naive_hwm = doc["staging_vmhwm_naive_bytes"]
    print(
        "staging measured (peak-RSS growth): fast "
        + fmt_size(doc["staging_vmhwm_fast_bytes"])
        + ("" if naive_hwm is None else f", naive {fmt_size(naive_hwm)}")
    )
    p = doc["fast_profile_s"]
    na = doc.get("target_not_applicable")
    met = verdict(doc["fast_within_target"], na)
    speedup = "not measured" if doc["speedup"] is None else f"{doc['speedup']:.2f}x"
    print(
        f"speedup naive/fast {speedup}; fast/fio {doc['fast_vs_fio']:.3f} "
        f"(target <= {doc['target_fast_vs_fio']}: {met}); within each round: median "
        f"{doc['fast_vs_fio_paired']:.3f}"
    )
    if doc["speedup"] is not None:
        print(
            f"  of which the I/O path (naive/naive_engine) {doc['speedup_io_path']:.2f}x, "
            f"bounded staging (naive_engine/fast) {doc['speedup_bounded_staging']:.2f}x"
        )
    if doc["fast_over_fio_hugemem"] is not None:
        print(
            f"fast/fio_hugemem {doc['fast_over_fio_hugemem']:.3f} (1.0 = the drive's limit); "
            f"within each round: median {doc['fast_over_fio_hugemem_paired']:.3f}"
        )
    naive = doc["naive_profile_s"]
    print(
        f"fast path: {p['read_wait_s']:.2f} s waiting for reads, {p['install_copy_s']:.2f} s "
        f"installing, {p['commit_s']:.3f} s committing, {p['other_s']:.2f} s submitting and "
        "probing"
        + (
            f"; naive: {naive['stage_s']:.2f} s staging, {naive['install_s']:.2f} s installing"
            if naive
            else ""
        )
    )
    direct = doc["fast_direct_chunks"]
    cpu_met = verdict(doc["fast_cpu_within_target"], na, again=True)
    print(
        f"fast path CPU {doc['fast_cpu_s_per_gib']:.3f} s/GiB (target <= "
        f"{doc['target_fast_cpu_s_per_gib']}: {cpu_met}; "
        "hashing the same bytes in memory "
        f"{doc['hash_floor_cpu_s_per_gib']:.3f}); chunks read in place per round {direct}"
    )
    print(f"bytes checked (first and last chunk): {'ok' if doc['data_ok'] else 'MISMATCH'}")
    if not doc["cold_cache"]:
        print(
            "note: the page cache could not be dropped (needs root); buffered reads may be warm",
            file=sys.stderr,
        )
