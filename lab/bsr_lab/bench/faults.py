"""`bsr-lab bench faults`: the fault matrix on real ranks, outcome and data per scenario.

Every scenario (bsr_lab.scenarios.FAULT_MATRIX) starts its ranks as processes
in one gloo group, injects its faults (bsr_io.faults, a documented test double)
and restores. A scenario passes when every surviving rank ends with the expected
outcome, all ranks agree, and a complete restore installed exactly the saved bytes.
"""

from __future__ import annotations

import argparse
import shutil
from pathlib import Path
from typing import Any

from bsr_io.cli.ranks import launch
from bsr_io.cli.report import write_json
from bsr_io.cli.scratch import make_scratch
from bsr_lab.scenarios import FAULT_MATRIX

RESTORE = "bsr_lab.scenarios:restore_on_rank"  # one rank's restore, run by launch


def register(bench_subparsers: Any) -> None:
    p = bench_subparsers.add_parser("faults", help="fault matrix on real ranks (all-or-nothing)")
    p.add_argument("--ranks", type=int, default=2)
    p.add_argument("--chunks", type=int, default=12, help="chunks in the restored state")
    p.add_argument("--window", type=int, default=3)
    p.add_argument("--layout", default="tiny")
    p.add_argument("--only", default=None, help="comma-separated scenario names")
    p.add_argument("--dir", type=Path, default=None)
    p.add_argument("--json", type=Path, default=None)
    p.set_defaults(func=run)


def evaluate(case: dict, results: list[dict], chunks: int) -> dict[str, Any]:
    killed = case["kw"].get("kill_rank") if case.get("survivors_only") else None
    live = [r for i, r in enumerate(results) if i != killed]
    failed = [r for r in live if "outcome" not in r]
    outcomes = sorted({r.get("outcome", "crashed") for r in live})
    outcome = outcomes[0] if len(outcomes) == 1 else "asymmetric:" + "/".join(outcomes)
    committed = {r.get("committed_chunks") for r in live}
    want_chunks = case.get("committed_chunks", chunks) if case["expected"] == "complete" else 0
    data = [r.get("data_ok") for r in live]
    data_ok = (
        all(d is True for d in data)
        if case["expected"] == "complete"
        else all(r.get("committed_tokens") == 0 for r in live)
    )
    ok = (
        not failed
        and outcome == case["expected"]
        and committed == {want_chunks}
        and data_ok
        and (killed is None or results[killed].get("exit_code") not in (0, None))
    )
    return {
        "name": case["name"],
        "expected": case["expected"],
        "outcome": outcome,
        "committed_chunks": sorted(c for c in committed if c is not None),
        "data_ok": data_ok,
        "passed": ok,
        "reasons": sorted({r.get("reason", "") for r in live if r.get("reason")}),
        "fallback_tiers": sorted({t for r in live for t in r.get("fallback_tiers", [])}),
        # Which read path the restore took: chunks read straight into the cache's blocks
        # per rank ("in place") or none ("slots"); the faults must fire on either.
        "direct_chunks": [int(r.get("timings", {}).get("direct_chunks", 0)) for r in live],
        "read_path": "in place"
        if any(r.get("timings", {}).get("direct_chunks", 0) for r in live)
        else "slots",
    }


def run(args: argparse.Namespace) -> int:
    if args.ranks < 2:
        raise ValueError("the fault matrix needs at least 2 ranks")
    cases = FAULT_MATRIX
    if args.only:
        names = set(args.only.split(","))
        unknown = names - {c["name"] for c in cases}
        if unknown:
            raise ValueError(f"unknown scenarios {sorted(unknown)}")
        cases = [c for c in cases if c["name"] in names]
    base = make_scratch(args.dir, "bsr-faults-")
    chunk_tokens = 16 if args.layout == "tiny" else 256
    rows = []
    try:
        for i, case in enumerate(cases):
            kw = {
                "root": str(base / str(i)),
                "layout": args.layout,
                "window": args.window,
                "tokens": args.chunks * chunk_tokens,
                **case["kw"],
            }
            results = launch(
                args.ranks, RESTORE, kw, timeout_s=300, env={"BSR_IO_EXIT_WAIT_S": "5"}
            )
            row = evaluate(case, results, args.chunks)
            # Reasons name record files: keep this machine's scratch path out of results.
            row["reasons"] = [r.replace(str(base), "<scratch>") for r in row["reasons"]]
            rows.append(row)
            mark = "ok  " if row["passed"] else "FAIL"
            print(
                f"{mark} {row['name']:<36} expected {row['expected']:<8} got "
                f"{row['outcome']:<8} data_ok {row['data_ok']} ({row['read_path']})",
                flush=True,
            )
    finally:
        shutil.rmtree(base, ignore_errors=True)
    doc = {
        "layout": args.layout,
        "ranks": args.ranks,
        "chunks": args.chunks,
        "window": args.window,
        "scenarios": rows,
    }
    write_json(args.json, doc)
    return 0 if all(r["passed"] for r in rows) else 1
