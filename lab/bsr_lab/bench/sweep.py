"""`bsr-lab bench sweep`: staging memory against state size, BSR vs whole-plan.

For each state size: the state is on L2 (written once, the largest first: smaller
states are prefixes of it), the page cache is dropped, and each rank restores in
a fresh process so its VmHWM belongs to that restore alone. BSR restores on both of
its paths, side by side: through the W slots (what a GPU destination takes; its RWS
is exactly W slots), and straight into a host cache's blocks (no slot used, so the
ring never becomes resident), where a host cache of the whole state fits
`--dest-cap` (larger states cycle through the cache's blocks, which direct reads
refuse). The whole-plan
baseline is run at the same L1 budget (it fails and says what it needed) and, up
to `--whole-plan-max`, with L1 large enough (its measured peak). In the same run
the engine reads a plain file of the same size class through the same window, the
`bench ssd` reference that BSR's throughput is reported against, and fio reads it on
4 KiB-page and on huge-page buffers. Then fio reads the largest state's record
payloads themselves (every rank's at once, as the ranks restore), on both kinds of
buffers: the drive's time for the very bytes the largest restore read.
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys
import time
from pathlib import Path
from typing import Any

from bsr_io._core import Engine
from bsr_io.cli.bench_store import engine_read
from bsr_io.cli.fio import (
    HugeMem,
    drop_caches,
    fio_available,
    fio_read,
    fio_read_payloads,
    huge_page_buffers,
)
from bsr_io.cli.progress import bar
from bsr_io.cli.ranks import launch
from bsr_io.cli.report import write_json
from bsr_io.cli.scratch import make_scratch
from bsr_io.model.layout import PRESETS, KVLayout, preset
from bsr_io.model.record import HEADER_BYTES
from bsr_io.model.sizes import GiB, fmt_size, parse_size
from bsr_lab.bench.ssd import write_test_file

RESTORE = "bsr_lab.scenarios:restore_on_rank"  # one rank's restore, run by launch
REF_MAX = 2 * GiB  # the default reference read's cap


def register(bench_subparsers: Any) -> None:
    p = bench_subparsers.add_parser(
        "sweep", help="RWS and VmHWM against state size: BSR vs whole-plan"
    )
    p.add_argument("--layout", default="deepseek-v4-flash", choices=sorted(PRESETS))
    p.add_argument(
        "--tokens",
        default="8192,32768,131072",
        help="comma-separated prefix lengths (whole chunks are stored)",
    )
    p.add_argument("--window", type=int, default=32)
    p.add_argument("--ranks", type=int, default=1, help="ranks (processes) per restore")
    p.add_argument(
        "--dir",
        type=Path,
        default=None,
        help="base of the store directory (default: a temp dir on disk)",
    )
    p.add_argument("--json", type=Path, default=None)
    p.add_argument("--plot", type=Path, default=None, help="write the staging plot (PNG)")
    p.add_argument(
        "--l1",
        type=parse_size,
        default=None,
        help="whole-plan L1 budget (default: the BSR window's bytes)",
    )
    p.add_argument(
        "--whole-plan-max",
        type=parse_size,
        default=parse_size("2GiB"),
        help="run whole-plan with ample L1 up to this state size",
    )
    p.add_argument(
        "--dest-cap",
        type=parse_size,
        default=parse_size("1GiB"),
        help="host KV cache size; larger states cycle through its blocks",
    )
    p.add_argument(
        "--ref-size",
        type=parse_size,
        default=None,
        help="size of the engine/fio reference read (0: none; default: the largest state "
        "over all ranks, at most 2GiB)",
    )
    p.add_argument("--seed", type=int, default=11)
    p.add_argument("--keep", action="store_true", help="keep the store afterwards")
    p.add_argument("--quiet", action="store_true")
    p.set_defaults(func=run)


def _parse_tokens(text: str) -> list[int]:
    try:
        vals = sorted({int(t) for t in text.split(",") if t.strip()})
    except ValueError:
        raise ValueError(f"--tokens must be comma-separated integers, got {text!r}") from None
    if not vals or vals[0] <= 0:
        raise ValueError("--tokens needs at least one positive prefix length")
    return vals


def _say(args: argparse.Namespace, msg: str) -> None:
    if not args.quiet:
        print(msg, flush=True)


def _check(results: list[dict[str, Any]], what: str) -> list[dict[str, Any]]:
    bad = [r for r in results if "outcome" not in r]
    if bad:
        raise RuntimeError(f"{what}: rank failed: {bad[0]}")
    return results


def run(args: argparse.Namespace) -> int:
    tokens = _parse_tokens(args.tokens)
    if args.window < 1 or args.ranks < 1:
        raise ValueError("--window and --ranks must be at least 1")
    lay = preset(args.layout)
    if tokens[0] < lay.chunk_tokens:
        raise ValueError(
            f"--tokens {tokens[0]} is less than one chunk ({lay.chunk_tokens} tokens of "
            f"{lay.name}): every prefix length must be at least that"
        )
    chunk = lay.chunk_bytes
    l1 = args.l1 if args.l1 is not None else args.window * chunk
    top = lay.state_bytes(tokens[-1])
    if args.ref_size is None:
        # The reference reads what the sweep reads at most (every rank's largest state),
        # so a small layout or state is not measured against gigabytes of 4 KiB reads.
        args.ref_size = min(top * args.ranks, REF_MAX)
    need = top * args.ranks + args.ref_size + GiB
    root = make_scratch(
        args.dir,
        "bsr-sweep-",
        need_bytes=need,
        what="the sweep",
        hint="pass smaller --tokens or another --dir",
    )
    cold = drop_caches()
    if not cold:
        print("note: cannot drop the page cache (not root): reads may be warm", file=sys.stderr)
    common = {"root": str(root / "store"), "layout": args.layout, "seed": args.seed}
    # Other work on the machine skews the rates (not RWS or VmHWM): say how loaded it was.
    load = {"cpus": os.cpu_count(), "loadavg_at_start": list(os.getloadavg())}
    try:
        _say(args, f"writing {fmt_size(top)} per rank x {args.ranks} rank(s) to {root} ...")
        t0 = time.perf_counter()
        filled = launch(
            args.ranks,
            "bsr_lab.scenarios:fill_on_rank",
            {**common, "tokens": tokens[-1]},
            timeout_s=7200,
        )
        if any("chunks" not in r for r in filled):
            raise RuntimeError(f"fill failed: {filled}")
        _say(args, f"  written in {time.perf_counter() - t0:.1f} s")
        rows: list[dict[str, Any]] = []
        with bar(len(tokens), "sweep", quiet=args.quiet, unit="state") as progress:
            for n in tokens:
                rows.append(_row(args, lay, n, l1, common))
                progress.update(1)
        with huge_page_buffers(args.ranks * (FIO_DEPTH << 20)) as huge:
            ref = _reference(args, root, chunk, huge) if args.ref_size else {}
            records = _records_fio(args, root, lay, tokens[-1], huge)
    finally:
        if not args.keep:
            shutil.rmtree(root, ignore_errors=True)
    for r in rows:
        r["vs_ssd"] = r["aggregate_gib_s"] / ref["engine_gib_s"] if ref else None
    top_row = rows[-1]
    for k in ("fio_s", "fio_hugemem_s"):
        # The largest restore's time over fio's for the same bytes (1.0 = at fio's pace).
        top_row["restore_over_" + k.removesuffix("_s")] = (
            top_row["restore_s"] / records[k] if records.get(k) else None
        )
    doc = {
        "layout": args.layout,
        "window": args.window,
        "ranks": args.ranks,
        "chunk_bytes": chunk,
        "l1_budget_bytes": l1,
        "cold_cache": cold,
        "machine_load": {**load, "loadavg_at_end": list(os.getloadavg())},
        "reference": ref,
        "records_fio": records,
        "rows": rows,
    }
    _print(doc)
    write_json(args.json, doc)
    if args.plot:
        from bsr_lab.plots import plot_sweep

        plot_sweep(doc, args.plot)
        print(f"wrote {args.plot}")
    direct_ok = all(r["direct"].get("outcome", "complete") == "complete" for r in rows)
    return 0 if direct_ok and all(r["outcome"] == "complete" for r in rows) else 1


def _row(
    args: argparse.Namespace, lay: KVLayout, n: int, l1: int, common: dict[str, Any]
) -> dict[str, Any]:
    state = lay.state_bytes(n)
    dest_cap = args.dest_cap // lay.token_bytes
    kw = {
        **common,
        "tokens": n,
        "window": args.window,
        "fill": False,
        "dest_cap_tokens": dest_cap,
        "check_data": state <= 256 << 20,
    }
    _say(args, f"restoring {n} tokens ({fmt_size(state)} per rank) with BSR, W={args.window}")
    drop_caches()
    # The slot path: what a GPU destination takes, and the paper's bound (RWS = W slots).
    bsr = _check(launch(args.ranks, RESTORE, {**kw, "direct_reads": False}, timeout_s=3600), "bsr")
    direct = _direct(args, kw, state, dest_cap >= n)
    small = _check(
        launch(args.ranks, RESTORE, {**kw, "mode": "whole_plan", "l1_bytes": l1}),
        "whole-plan at the L1 budget",
    )
    ample = None
    if state <= args.whole_plan_max:
        _say(args, "  whole-plan with ample L1")
        drop_caches()
        ample = _check(
            launch(
                args.ranks,
                RESTORE,
                {**kw, "mode": "whole_plan", "dest_cap_tokens": None},
                timeout_s=3600,
            ),
            "whole-plan",
        )
    restore_s = max(r["restore_s"] for r in bsr)
    outcomes = {r["outcome"] for r in bsr}
    return {
        "tokens": n,
        "state_bytes": state,
        "chunk_bytes": lay.chunk_bytes,
        "chunks": n // lay.chunk_tokens,
        "rws_peak_bytes": max(r["rws_peak_bytes"] for r in bsr),
        "rws_peak_bytes_per_rank": [r["rws_peak_bytes"] for r in bsr],
        "vmhwm_growth_bytes": max(r["vmhwm_growth_bytes"] for r in bsr),
        "restore_s": restore_s,
        "gib_s": state / restore_s / GiB if restore_s else 0.0,
        # Ranks here share one drive, so the drive's rate is the sum over ranks.
        "aggregate_gib_s": args.ranks * state / restore_s / GiB if restore_s else 0.0,
        "outcome": outcomes.pop() if len(outcomes) == 1 else "asymmetric",
        "data_ok": all(r["data_ok"] for r in bsr) if bsr[0]["data_ok"] is not None else None,
        "backend": bsr[0]["backend"],
        "whole_plan_l1_budget_bytes": l1,
        "whole_plan_at_budget": small[0]["outcome"],
        "whole_plan_at_budget_reason": small[0]["reason"],
        "whole_plan_l1_required_bytes": small[0]["l1_required_bytes"],
        "whole_plan_l1_peak_bytes": (
            max(r["rws_peak_bytes"] for r in ample) if ample else small[0]["l1_required_bytes"]
        ),
        "whole_plan_measured": ample is not None,
        "whole_plan_vmhwm_growth_bytes": (
            max(r["vmhwm_growth_bytes"] for r in ample) if ample else None
        ),
        "path": "slots",
        "direct": direct,
    }


def _direct(args: argparse.Namespace, kw: dict[str, Any], state: int, fits: bool) -> dict[str, Any]:
    """BSR's direct path at this size: every chunk read straight into a host cache of
    the whole state (no slot), or why it was not run."""
    if not fits:
        return {
            "note": f"not run: a host cache of the whole state ({fmt_size(state)} per rank) "
            f"exceeds --dest-cap ({fmt_size(args.dest_cap)}); cycling blocks refuse direct reads"
        }
    _say(args, "  BSR straight into the host cache (direct reads)")
    drop_caches()
    runs = _check(
        launch(args.ranks, RESTORE, {**kw, "direct_reads": True}, timeout_s=3600), "direct"
    )
    restore_s = max(r["restore_s"] for r in runs)
    outcomes = {r["outcome"] for r in runs}
    return {
        "rws_peak_bytes": max(r["rws_peak_bytes"] for r in runs),
        "vmhwm_growth_bytes": max(r["vmhwm_growth_bytes"] for r in runs),
        "direct_chunks": min(int(r["timings"].get("direct_chunks", 0)) for r in runs),
        "restore_s": restore_s,
        "gib_s": state / restore_s / GiB if restore_s else 0.0,
        "aggregate_gib_s": args.ranks * state / restore_s / GiB if restore_s else 0.0,
        "outcome": outcomes.pop() if len(outcomes) == 1 else "asymmetric",
        "data_ok": all(r["data_ok"] for r in runs) if runs[0]["data_ok"] is not None else None,
    }


FIO_DEPTH = 32


def _records_fio(
    args: argparse.Namespace, root: Path, lay: KVLayout, tokens: int, huge: HugeMem
) -> dict[str, Any]:
    """fio reading every rank's record payloads of the largest state, cold, all ranks'
    at once: on 4 KiB pages and on huge pages."""
    dirs = sorted(p for p in (root / "store" / "l2" / "chunks").iterdir() if p.is_dir())
    chunks = tokens // lay.chunk_tokens
    out: dict[str, Any] = {
        "bytes": chunks * lay.chunk_bytes * len(dirs),
        "files": chunks,
        "ranks": len(dirs),
        "fio_hugemem_note": huge.note,
    }
    if not fio_available() or lay.chunk_bytes % 4096:
        out["note"] = (
            "fio not installed"
            if lay.chunk_bytes % 4096 == 0
            else ("payloads are not 4 KiB multiples: fio cannot read exactly them")
        )
        return out
    for name, hm in (("fio", None), ("fio_hugemem", huge)):
        if hm is not None and hm.mount is None:
            out[name + "_s"] = None
            continue
        _say(args, f"fio ({name}) reading the records of {tokens} tokens x {len(dirs)} rank(s)")
        drop_caches()
        res = fio_read_payloads(
            dirs,
            payload_offset=HEADER_BYTES,
            payload_bytes=lay.chunk_bytes,
            files=chunks,
            iodepth=FIO_DEPTH,
            hugemem=hm,
            timeout_s=7200,
        )
        out[name + "_s"] = res.seconds
        out[name + "_gib_s"] = res.gib_s
    return out


def _reference(args: argparse.Namespace, root: Path, chunk: int, huge: HugeMem) -> dict[str, Any]:
    """The `bench ssd` engine read (same W, chunk-sized slots) and fio, same run."""
    path = root / "bsr-io-sweep-ref.bin"
    slot = -(-chunk // 4096) * 4096  # the engine's slot for this chunk size
    size = args.ref_size // slot * slot or slot
    _say(args, f"reference: engine and fio reading {fmt_size(size)} cold")
    try:
        write_test_file(path, size, min(args.window, 8), slot)
        drop_caches()
        with Engine(args.window, slot) as eng:
            f = eng.open(path)
            secs, _ = engine_read(eng, f, size)
            f.close()
        out: dict[str, Any] = {"size_bytes": size, "engine_gib_s": size / secs / GiB}
        if fio_available():
            drop_caches()
            bs = min(1 << 20, size)  # fio refuses a block larger than what it reads
            out["fio_gib_s"] = fio_read(path, size=size, block_bytes=bs).gib_s
            out["fio_hugemem_gib_s"] = None
            out["fio_hugemem_note"] = huge.note
            if huge.mount is not None:
                drop_caches()
                out["fio_hugemem_gib_s"] = fio_read(
                    path, size=size, block_bytes=bs, iomem=huge.iomem("ref")
                ).gib_s
        return out
    finally:
        path.unlink(missing_ok=True)


def _print(doc: dict[str, Any]) -> None:
    print(
        f"\nlayout {doc['layout']}  W={doc['window']}  chunk {doc['chunk_bytes']} B  "
        f"ranks {doc['ranks']}  cold cache: {doc['cold_cache']}"
    )
    hdr = (
        f"{'':>20} {'through the W slots':^47} {'into a host cache, direct':^42}\n"
        f"{'tokens':>8} {'state/rank':>11} {'RWS peak':>11} {'VmHWM +':>11} {'GiB/s':>6} "
        f"{'vs ssd':>6} {'outcome':>8} {'direct':>6} {'RWS peak':>9} {'VmHWM +':>10} {'GiB/s':>6} "
        f"{'outcome':>8} {'whole-plan L1':>14} {'at budget':>9}"
    )
    print(hdr)
    for r in doc["rows"]:
        vs = f"{r['vs_ssd']:.2f}" if r.get("vs_ssd") else "-"
        d = r.get("direct") or {}
        if "outcome" in d:
            direct = (
                f"{d['direct_chunks']:>6} "
                f"{fmt_size(d['rws_peak_bytes']):>9} {fmt_size(d['vmhwm_growth_bytes']):>10} "
                f"{d['gib_s']:>6.2f} {d['outcome']:>8}"
            )
        else:
            direct = f"{'not run (--dest-cap)':>43}"
        print(
            f"{r['tokens']:>8} {fmt_size(r['state_bytes']):>11} "
            f"{fmt_size(r['rws_peak_bytes']):>11} "
            f"{fmt_size(r['vmhwm_growth_bytes']):>11} {r['gib_s']:>6.2f} {vs:>6} "
            f"{r['outcome']:>8} {direct} {fmt_size(r['whole_plan_l1_peak_bytes']):>14} "
            f"{r['whole_plan_at_budget']:>9}"
        )
    ref = doc["reference"]
    if ref:
        fio = f", fio {ref['fio_gib_s']:.2f} GiB/s" if "fio_gib_s" in ref else ""
        if ref.get("fio_hugemem_gib_s"):
            fio += f", fio on huge pages {ref['fio_hugemem_gib_s']:.2f} GiB/s"
        print(f"reference: engine {ref['engine_gib_s']:.2f} GiB/s{fio}")
    rec, top = doc["records_fio"], doc["rows"][-1]
    for k in ("fio", "fio_hugemem"):
        if rec.get(k + "_s"):
            print(
                f"{k} reading the same {fmt_size(rec['bytes'])} of records: {rec[k + '_s']:.2f} s; "
                f"the restore took {top['restore_s']:.2f} s ({top['restore_over_' + k]:.2f}x)"
            )
    if rec.get("fio_hugemem_s") is None and rec.get("fio_hugemem_note"):
        print(f"fio on huge pages not run: {rec['fio_hugemem_note']}")
