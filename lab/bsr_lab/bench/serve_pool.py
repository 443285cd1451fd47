"""`bsr-lab bench serve-pool`: the miss penalty of several `bench serve` runs pooled, with
a bootstrap confidence interval, so that a difference of a few percent can be told from
the bench's noise.

One run has 8 rounds, and its per-round ratios spread over +-5% (two servers without
the connector differ by as much), so one run cannot settle a -3% goal. Pooled runs of
the same configuration can: each round is a unit (the same prompts on every server of
that round, in an order that rotates), resampled with replacement 10,000 times, and
since a server's speed is partly its own, the servers too: each resample first picks
runs (and epochs, between the restarts of `bench serve --restarts`) with replacement,
then rounds within each; each resample's figure is computed as a run's is (output
tokens/s in the saturated phase's steady state, pooled over the resampled rounds; TTFT
p50 of the resampled misses), and the interval is the middle 95% of the resamples. The
same is done for the control (a second server without the connector, A/A) and for
bsr-io against the control. Beside each interval, where its width comes from
(`spread`): the rounds' ratio split into what differs between epochs and what moves
within one, which says whether more restarts or more rounds would narrow it. Every
request streams exactly `max_tokens` tokens (`ignore_eos`), which the committed JSONs
record instead of the tokens themselves.

Runs pool across sessions: a committed run keeps its rounds in NAME.trace.json.gz beside
its JSON (`bench serve --json` writes both), read back here, so epochs measured on one
machine type in different sessions add up to one interval, with the goal's verdict over
it (verdict.py), as `bench serve` states its own.
"""

from __future__ import annotations

import argparse
import gzip
import json
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

from bsr_io.cli.report import trace_path, write_json, write_trace
from bsr_lab.bench.verdict import judge, lines

RESAMPLES = 10_000
# Who is compared with whom. The two references (baseline, control) are the same server
# started twice, yet pooled over 24 rounds one ran 2.8% faster than the other (95%
# interval 1.5-4.2%): a server's own speed differs by as much as the goal. So bsr-io is
# also compared with both together (their mean rate, their misses' TTFTs together).
PAIRS = {
    "bsr_io_vs_baseline": (("bsr_io",), ("baseline",)),
    "control_vs_baseline": (("control",), ("baseline",)),
    "bsr_io_vs_control": (("bsr_io",), ("control",)),
    "bsr_io_vs_references": (("bsr_io",), ("baseline", "control")),
}


def register(bench_subparsers: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    p = bench_subparsers.add_parser(
        "serve-pool", help="pool `bench serve` runs: miss penalty with a 95%% interval"
    )
    p.add_argument("runs", nargs="+", help="JSONs written by `bsr-lab bench serve --json`")
    p.add_argument("--phase", default="saturated", choices=("saturated", "paced"))
    p.add_argument("--seed", type=int, default=0, help="the resampling's seed")
    p.add_argument("--resamples", type=int, default=RESAMPLES, help="bootstrap resamples")
    p.add_argument("--json", default=None, help="write the result here")
    p.set_defaults(func=run)


def round_figures(rd: dict[str, Any], phase: str, ramp: int, max_tokens: int) -> dict[str, Any]:
    """One round's phase on one server: steady-state tokens and span (as `bench serve`'s
    `steady_rate`), and its misses' TTFTs."""
    reqs = rd[phase]["requests"]
    ends = sorted(r["end_s"] for r in reqs)
    cut = ends[ramp - 1]
    forward = rd[phase].get("sched", {}).get("forward")  # runs from before sched.py: none
    return {
        "tokens": max_tokens * sum(r["end_s"] > cut for r in reqs),
        "span": ends[-1] - cut,
        "ttft": [r["ttft_s"] for r in reqs if r["kind"] == "miss"],
        # The whole phase: its tokens, wall time and the seconds the forward thread ran.
        "all_tokens": max_tokens * len(reqs),
        "wall": rd[phase]["wall_s"],
        "forward_run": forward["run_s"] if forward else None,
    }


def forward_split(servers: list[list[dict[str, Any]]], pick: np.ndarray) -> tuple[float, float]:
    """(forward duty, forward speed) over the rounds `pick` names, of several servers
    their mean: the share of the phase's wall time the forward thread ran, and the
    tokens out per second it ran. Their product is the phase's throughput: a connector
    that takes the forward's turn lowers the first, one that slows its compute (memory
    or cache it shares) the second, as does the machine's own speed from one phase to
    the next."""
    duty = [
        sum(rounds[i]["forward_run"] for i in pick) / sum(rounds[i]["wall"] for i in pick)
        for rounds in servers
    ]
    speed = [
        sum(rounds[i]["all_tokens"] for i in pick) / sum(rounds[i]["forward_run"] for i in pick)
        for rounds in servers
    ]
    return float(np.mean(duty)), float(np.mean(speed))


def figures(servers: list[list[dict[str, Any]]], pick: np.ndarray) -> tuple[float, float]:
    """(steady tokens/s, TTFT p50) over the rounds `pick` names; of several servers (the
    two references), the mean of their rates and the median of their TTFTs together."""
    rates = [
        sum(rounds[i]["tokens"] for i in pick) / sum(rounds[i]["span"] for i in pick)
        for rounds in servers
    ]
    ttfts = [rounds[i]["ttft"] for rounds in servers for i in pick]
    return float(np.mean(rates)), float(np.median(np.concatenate(ttfts)))


def members_of(groups: Sequence[int] | None) -> list[np.ndarray] | None:
    """The rounds of each group (None: no groups, or only one)."""
    if groups is None or len(set(groups)) < 2:
        return None
    ids = np.asarray(groups)
    return [np.flatnonzero(ids == g) for g in sorted(set(groups))]


def resample(rng: np.random.Generator, n: int, members: list[np.ndarray] | None) -> np.ndarray:
    """One bootstrap pick of `n` rounds: with replacement; with groups (`members_of`: each
    round's servers, a run or an epoch between restarts), the groups first, then the
    rounds of each group picked, so that what differs between servers started apart
    counts."""
    if members is None:
        return rng.integers(0, n, size=n)
    chosen = rng.integers(0, len(members), size=len(members))
    return np.concatenate(
        [members[c][rng.integers(0, len(members[c]), size=len(members[c]))] for c in chosen]
    )


def spread(
    a: list[list[dict[str, Any]]],
    b: list[list[dict[str, Any]]],
    members: list[np.ndarray] | None,
) -> dict[str, float | None]:
    """How much a's steady rate over b's moves from round to round (sd of the log ratio:
    0.03 is about 3%) and, with epochs, how that splits: the sd of the epochs' means
    (servers started apart: more epochs narrow it) and of the rounds about their epoch's
    mean (the machine within one epoch, phase to phase: only more rounds or a finer
    interleaving narrow it)."""
    n = len(a[0])
    logs = np.log([figures(a, np.array([i]))[0] / figures(b, np.array([i]))[0] for i in range(n)])
    out: dict[str, float | None] = {"round_sd": float(np.std(logs, ddof=1)) if n > 1 else None}
    if members is not None:
        means = [float(logs[m].mean()) for m in members]
        left = float(sum(((logs[m] - logs[m].mean()) ** 2).sum() for m in members))
        dof = n - len(members)
        out["epoch_sd"] = float(np.std(means, ddof=1))
        out["within_epoch_sd"] = float(np.sqrt(left / dof)) if dof else None
    return out


def compare(
    a: list[list[dict[str, Any]]],
    b: list[list[dict[str, Any]]],
    rng: np.random.Generator,
    resamples: int = RESAMPLES,
    groups: Sequence[int] | None = None,
) -> dict[str, Any]:
    """Servers a against servers b over the same rounds: the pooled ratios and their
    bootstrap 95% intervals (rounds resampled, by `groups` where given: `resample`; the
    same picks for all)."""
    n = len(a[0])
    every = np.arange(n)
    (ra, ta), (rb, tb) = figures(a, every), figures(b, every)
    thr, ttft, duty, speed = [], [], [], []
    members = members_of(groups)
    counted = all(r["forward_run"] for side in (*a, *b) for r in side)
    for _ in range(resamples):
        pick = resample(rng, n, members)
        (xa, ya), (xb, yb) = figures(a, pick), figures(b, pick)
        thr.append(xa / xb)
        ttft.append(ya / yb)
        if counted:
            (da, sa), (db, sb) = forward_split(a, pick), forward_split(b, pick)
            duty.append(da / db)
            speed.append(sa / sb)
    split: dict[str, Any] = {}
    if counted:
        (da, sa), (db, sb) = forward_split(a, every), forward_split(b, every)
        split = {
            "forward_duty_ratio": da / db,
            "forward_duty_ratio_95": [float(x) for x in np.percentile(duty, [2.5, 97.5])],
            "forward_speed_ratio": sa / sb,
            "forward_speed_ratio_95": [float(x) for x in np.percentile(speed, [2.5, 97.5])],
        }
    return {
        "rounds": n,
        "groups": len(set(groups)) if groups is not None else None,
        "steady_throughput_ratio": ra / rb,
        "steady_throughput_ratio_95": [float(x) for x in np.percentile(thr, [2.5, 97.5])],
        "ttft_p50_ratio": ta / tb,
        "ttft_p50_ratio_95": [float(x) for x in np.percentile(ttft, [2.5, 97.5])],
        "steady_throughput_spread": spread(a, b, members),
        # Throughput's two factors over the whole phase (`forward_split`), where the
        # runs counted the forward thread's time (sched.py).
        **split,
    }


def intervals(
    rounds: dict[str, list[dict[str, Any]]],
    phase: str,
    ramp: int,
    max_tokens: int,
    seed: int = 0,
    resamples: int = RESAMPLES,
    groups: Sequence[int] | None = None,
) -> dict[str, Any]:
    """Every pair of `PAIRS` over these rounds (those of one run, or of several pooled):
    the pooled ratios with their bootstrap 95% intervals (`groups`: each round's servers,
    `resample`)."""
    sides = {
        s: [round_figures(rd, phase, ramp, max_tokens) for rd in rds]
        for s, rds in rounds.items()
        if s in ("baseline", "bsr_io", "control")
    }
    rng = np.random.default_rng(seed)
    return {
        name: compare([sides[s] for s in a], [sides[s] for s in b], rng, resamples, groups)
        for name, (a, b) in PAIRS.items()
        if all(s in sides for s in (*a, *b))
    }


def run_epochs(doc: dict[str, Any]) -> list[int]:
    """Each round's epoch in one `bench serve` run (all 0 where it never restarted)."""
    n = len(doc["rounds"]["baseline"])
    return list(doc.get("round_epochs") or [0] * n)


def split_trace(doc: dict[str, Any], path: Path) -> None:
    """Move `doc`'s rounds and memory samples into the trace file beside `path`: the
    JSON keeps the summaries (docs/results keeps summaries), each side its peak RSS."""
    rss = {}
    for side in doc["rounds"]:
        if "rss_mib" in doc.get(side, {}):
            rss[side] = doc[side].pop("rss_mib")
            doc[side]["rss_mib_max"] = max((m for _, m in rss[side]), default=None)
    trace = {"from": path.name, "rounds": doc.pop("rounds"), "rss_mib": rss}
    doc["rounds_file"] = write_trace(path, trace)


def load_run(path: Path) -> dict[str, Any]:
    """A `bench serve` JSON with its rounds, from the trace file beside it where they
    were split off (`split_trace`). ValueError where neither has them."""
    doc: dict[str, Any] = json.loads(path.read_text())
    if "rounds" not in doc:
        gz = trace_path(path)
        if not gz.exists():
            raise ValueError(f"{path}: no rounds in it and no {gz.name} beside it")
        doc["rounds"] = json.loads(gzip.decompress(gz.read_bytes()))["rounds"]
    return doc


# What pooled runs must share: the load's shape, the model and its dtype (a run from
# before --dtype ran the default, bfloat16).
KEEP = ("saturated", "misses", "concurrency", "max_tokens", "save_in_steps", "hidden", "dtype")
MACHINE = ("cpu", "cpus", "amx")  # report.machine(): what every run has recorded


def run(args: argparse.Namespace) -> int:
    try:
        docs = [load_run(Path(p)) for p in args.runs]
    except ValueError as e:
        print(e, file=sys.stderr)
        return 2
    shapes = {
        json.dumps({k: d["args"].get(k, "bfloat16" if k == "dtype" else None) for k in KEEP})
        for d in docs
    }
    if len(shapes) != 1:
        print(f"the runs differ in their configuration: {sorted(shapes)}", file=sys.stderr)
        return 2
    # One machine type's noise and penalty: runs of another CPU answer another question.
    machines = {json.dumps({k: d.get("machine", {}).get(k) for k in MACHINE}) for d in docs}
    if len(machines) != 1:
        print(f"the runs ran on different machines: {sorted(machines)}", file=sys.stderr)
        return 2
    if any("control" not in d["rounds"] for d in docs):
        print("every run needs its control's rounds (`bench serve --control`)", file=sys.stderr)
        return 2
    ramp, max_tokens = docs[0]["args"]["concurrency"], docs[0]["args"]["max_tokens"]
    pooled = {
        s: [rd for d in docs for rd in d["rounds"][s]] for s in ("baseline", "bsr_io", "control")
    }
    # Each run's servers are its own (and each epoch's, where a run restarted them).
    epochs = [(i, e) for i, d in enumerate(docs) for e in run_epochs(d)]
    index = {x: i for i, x in enumerate(sorted(set(epochs)))}
    groups = [index[x] for x in epochs]
    pairs = intervals(pooled, args.phase, ramp, max_tokens, args.seed, args.resamples, groups)
    doc = {
        "bench": "serve-pool",
        "device": docs[0]["device"],
        "phase": args.phase,
        "resamples": args.resamples,
        "runs": [
            {"file": Path(p).name, "commit": d["commit"]}
            for p, d in zip(args.runs, docs, strict=True)
        ],
        **({"machine": docs[0]["machine"]} if "machine" in docs[0] else {}),  # the runs'
        "config": json.loads(shapes.pop()),
        **pairs,
    }
    # The goal holds at saturation only (verdict.py): the paced phase gets no verdict.
    if args.phase == "saturated":
        doc["verdict"] = judge(pairs)
    print(json.dumps(pairs, indent=1))
    for line in lines(doc.get("verdict", {})):
        print("pooled", line)
    write_json(args.json, doc)
    return 0
