"""`bsr-lab bench remote`: restore a state from a Mooncake Store pool through a window
of W reads, against the Mooncake client's own bulk read of the same objects into one
registered buffer, in the same run.

The restore is the whole BSR path: discovery (one batched existence check), reads
(straight into the destination's blocks where it is host memory, else into engine
slots), key/layout/checksum verification, commit. The reference stages the whole state
in one buffer with one `batch_get_into` call and verifies nothing: the client's best
case. Two more paths per round say where the time goes: the restore through the W
slots (an install copy per chunk) and the bulk read issued from a thread at the tier's
data-call priority (`io_priority`). Each round runs the paths in a shuffled order. With
no `--master`, a loopback pool (a master and one storage node) is started for the run
(inside a loopback-only network namespace when run as root) and stopped afterwards;
its storage node's CPU time is then recorded per path.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import random
import statistics
import threading
import time
from collections.abc import Callable, Sequence
from contextlib import ExitStack
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeVar

import numpy as np
import numpy.typing as npt

from bsr_io._core import Engine
from bsr_io.cli.host import check_memory, process_cpu_s
from bsr_io.cli.report import write_json
from bsr_io.cli.store_pool import (
    add_pool_args,
    close_client,
    open_tier,
    pool_config,
)
from bsr_io.cli.synthetic import fill_random, synthetic_tokens
from bsr_io.engine import as_numpy
from bsr_io.load.kvcache import PagedKVCache
from bsr_io.model.keys import ChunkKey, chunk_keys
from bsr_io.model.layout import PRESETS, KVLayout, preset
from bsr_io.model.record import HEADER_BYTES
from bsr_io.model.sizes import GiB, fmt_size, parse_size
from bsr_io.restore import Restorer, RestoreResult
from bsr_io.store import Store
from bsr_io.tiers.base import Tier
from bsr_io.tiers.mooncake import IO_PRIORITIES, lower_thread_priority
from bsr_lab.machine_load import snapshot, summary

if TYPE_CHECKING:
    import subprocess

    from bsr_io.tiers.mooncake import MooncakeTier

_T = TypeVar("_T")


def register(bench_subparsers: Any) -> None:
    p = bench_subparsers.add_parser(
        "remote",
        help="restore from a Mooncake Store pool vs the client's bulk read",
        description=__doc__,
    )
    p.add_argument("--size", type=parse_size, default=parse_size("1GiB"), help="state size")
    p.add_argument("--layout", default="deepseek-v4-flash", choices=sorted(PRESETS))
    p.add_argument("--window", type=int, default=4, help="W: staging slots (reads in flight)")
    p.add_argument("--rounds", type=int, default=3, help="rounds (medians are reported)")
    p.add_argument(
        "--io-threads",
        type=int,
        default=None,
        help="the tier's data call threads (default: its config's)",
    )
    p.add_argument(
        "--io-priority",
        default=None,
        choices=IO_PRIORITIES,
        help="CPU priority of those threads (default: its config's)",
    )
    p.add_argument(
        "--no-direct", action="store_true", help="the main restore reads through the slots too"
    )
    p.add_argument("--seed", type=int, default=None, help="seed of the per-round order")
    add_pool_args(p)
    p.add_argument("--json", type=Path, default=None, help="write the results here")
    p.set_defaults(func=run)


def check_json_path(path: Path | None) -> None:
    """Refuse a --json path that cannot be written before the run, not after it: its
    directory is made as write_json would, the file opened for append (a new one removed)."""
    if path is None:
        return
    existed = path.exists()
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        with open(path, "a"):
            pass
    except OSError as exc:
        raise OSError(f"--json {path}: cannot write it: {exc.strerror or exc}") from None
    if not existed:
        path.unlink()


def run(args: argparse.Namespace) -> int:
    layout = preset(args.layout)
    chunk = layout.chunk_bytes
    n = args.size // chunk
    if n < 1:
        raise ValueError(f"--size {args.size} is less than one chunk ({chunk} bytes)")
    for flag, value in (("--window", args.window), ("--rounds", args.rounds)):
        if value < 1:
            raise ValueError(f"{flag} {value}: must be at least 1")
    state_bytes = n * chunk
    record = HEADER_BYTES + chunk
    cfg = pool_config(args)
    check_json_path(args.json)
    # This host holds the bulk buffer (records) and the destination (the state), and a
    # loopback pool's segment (sized below) as well.
    need = n * record + state_bytes
    if cfg is None:
        need += n * record + max(n * record // 4, 256 << 20)
    check_memory(need, f"--size {fmt_size(args.size)}", "a smaller --size")
    measured = False
    with ExitStack() as stack:
        where = "given pool"
        if cfg is None:
            from bsr_lab.loopback_pool import LoopbackPool, loopback_netns

            inside = stack.enter_context(loopback_netns())
            segment = n * record + max(n * record // 4, 256 << 20)
            # Leases outlast a bulk read of the whole state on a slow, shared machine.
            try:
                pool = stack.enter_context(LoopbackPool(segment, lease_ttl_ms=20000))
            except RuntimeError as exc:  # a master or node that would not start: one line
                raise OSError(f"cannot start a loopback pool: {exc}") from None
            cfg = pool.config(timeout_s=args.pool_timeout)
            where = "loopback pool" + (" (loopback-only netns)" if inside else "")
        if args.io_threads is not None:
            cfg = dataclasses.replace(cfg, io_threads=args.io_threads)
        if args.io_priority is not None:
            cfg = dataclasses.replace(cfg, io_priority=args.io_priority)
        if args.no_direct:
            cfg = dataclasses.replace(cfg, direct_reads=False)
        node = None if where == "given pool" else pool.node
        # Said before the pool is joined: a closed stdout stops the run with no client.
        print(
            f"{where} at {cfg.master}: writing {n} chunks of {fmt_size(chunk)} "
            f"({fmt_size(state_bytes)})"
        )
        tier = open_tier(cfg, layout)
        # After a finished run nothing is in flight: the client closes before the pool
        # stops (registered first, so it runs after the callbacks below).
        stack.callback(lambda: close_client(tier) if measured else tier.close())
        engine = stack.enter_context(Engine(args.window, chunk))
        model = f"bench-remote-{os.getpid()}-{time.time_ns()}"
        tokens = synthetic_tokens(7, n * layout.chunk_tokens)
        keys = chunk_keys(tokens, layout, model)
        _fill(tier, engine, layout, keys)
        stack.callback(lambda: [tier.remove(k) for k in keys])
        doc = _measure(tier, engine, layout, keys, tokens, args, model, node)
        measured = True
    doc.update(
        pool=where,
        master=cfg.master,
        protocol=cfg.protocol,
        layout=layout.name,
        chunk_bytes=chunk,
        chunks=n,
        state_bytes=state_bytes,
        window=args.window,
        slot_bytes=engine.slot_bytes,
        rounds=args.rounds,
        io_threads=cfg.io_threads,
        io_priority=cfg.io_priority,
        direct_reads=cfg.direct_reads,
    )
    print(
        f"restore {doc['restore_gib_s']:.2f} GiB/s ({doc['direct_chunks']} of {n} chunks read "
        f"straight into the destination, at most {args.window} in flight) vs client bulk "
        f"{doc['client_bulk_gib_s']:.2f} GiB/s into one {fmt_size(doc['bulk_buffer_bytes'])} "
        f"buffer: ratio {doc['ratio']:.3f} (median of rounds "
        f"{doc['ratio_median_of_rounds']:.3f}); "
        f"RWS {fmt_size(doc['rws_peak_bytes'])} (bound W x slot = "
        f"{fmt_size(doc['rws_bound_bytes'])}), state {fmt_size(state_bytes)}, outcome "
        f"{doc['outcome']}; {doc['restore_read_wait_share']:.0%} of the restore waiting for "
        f"the pool, CPU {doc['restore_cpu_s_per_gib']:.2f} s/GiB (bulk "
        f"{doc['bulk_cpu_s_per_gib']:.2f}). Through the slots: {doc['restore_slots_gib_s']:.2f} "
        f"GiB/s (ratio {doc['ratio_slots']:.3f}); bulk from a {cfg.io_priority}-priority "
        f"thread: {doc['client_bulk_low_gib_s']:.2f} GiB/s"
    )
    write_json(args.json, doc)
    return 0 if doc["outcome"] == "complete" else 1


def _fill(tier: Tier, engine: Engine, layout: KVLayout, keys: Sequence[ChunkKey]) -> None:
    slot = engine.lease()
    slot.set_length(layout.chunk_bytes)
    view = as_numpy(slot)
    for i, k in enumerate(keys):
        fill_random(view, 0xB5, i)
        tier.write(k, slot, layout)
    del view, slot


def _node_cpu_s(node: subprocess.Popen[bytes] | None) -> float:
    """The storage node's CPU time (the pool's side of every read), 0 when not ours."""
    if node is None:
        return 0.0
    try:
        with open(f"/proc/{node.pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
    except OSError:
        return 0.0
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def _on_thread(fn: Callable[[], _T], priority: str) -> _T:
    """`fn()` on a fresh thread at `priority` (as the tier's data calls run)."""
    out: list[_T] = []

    def body() -> None:
        lower_thread_priority(priority)
        out.append(fn())

    t = threading.Thread(target=body, name="bsr-bench-bulk")
    t.start()
    t.join()
    if not out:
        raise OSError("the bulk read on its thread raised (see above)")
    return out[0]


def _measure(
    tier: MooncakeTier,
    engine: Engine,
    layout: KVLayout,
    keys: Sequence[ChunkKey],
    tokens: npt.NDArray[np.int64],
    args: argparse.Namespace,
    model: str,
    node: subprocess.Popen[bytes] | None,
) -> dict[str, Any]:
    n, chunk = len(keys), layout.chunk_bytes
    record = HEADER_BYTES + chunk
    names = [tier.object_name(k) for k in keys]
    bulk = np.empty(n * record, dtype=np.uint8)
    bulk.fill(0)  # fault the pages in before the clock runs
    rc = tier.client.register_buffer(bulk.ctypes.data, bulk.nbytes)
    if rc != 0:
        raise OSError(f"cannot register the bulk buffer with the pool: {rc}")
    ptrs = [bulk.ctypes.data + i * record for i in range(n)]
    # The whole state's blocks, faulted in: a host cache the window may read straight into.
    dest = PagedKVCache.allocate(layout, n * layout.chunk_tokens)
    direct_ok = dest.direct_reads and tier.config.direct_reads
    restorer = Restorer(Store([tier]), layout, window=args.window, engine=engine, model=model)
    state = n * chunk

    def bulk_read() -> None:
        got = tier.client.batch_get_into(names, ptrs, [record] * n)
        if list(got) != [record] * n:
            raise OSError(f"client bulk read failed: {sorted(set(got))}")

    def restore(direct: bool) -> RestoreResult:
        dest.direct_reads = direct
        plan = restorer.probe(tokens)
        res = restorer.restore(plan, dest)
        if not res.complete:
            raise OSError(f"restore from the pool ended {res.outcome}: {res.reason}")
        return res

    # One untimed pass first: the first transfers pay for connections and page faults.
    bulk_read()
    restore(direct_ok)
    restore(False)
    rounds: list[dict[str, Any]] = []
    results: dict[str, RestoreResult] = {}
    seed = args.seed if args.seed is not None else random.SystemRandom().randrange(1 << 32)
    rng = random.Random(seed)
    loads = [snapshot()]
    for _ in range(args.rounds):
        row: dict[str, Any] = {}
        order = ["bulk", "restore", "restore_slots", "bulk_low"]
        rng.shuffle(order)
        row["order"] = order
        for which in order:
            c0, n0 = process_cpu_s(), _node_cpu_s(node)
            t0 = time.perf_counter()
            if which == "bulk":
                bulk_read()
            elif which == "bulk_low":
                _on_thread(bulk_read, tier.config.io_priority)
            else:
                results[which] = res = restore(direct_ok and which == "restore")
            row[f"{which}_s"] = time.perf_counter() - t0
            row[f"{which}_cpu_s_per_gib"] = (process_cpu_s() - c0) * GiB / state
            if node is not None:
                row[f"{which}_node_cpu_s_per_gib"] = (_node_cpu_s(node) - n0) * GiB / state
            if which.startswith("restore"):
                # Waiting for the pool vs verifying and installing: which bounds it.
                row[f"{which}_read_wait_s"] = res.timings["read_wait_s"]
                row[f"{which}_install_s"] = res.timings["install_copy_s"]
                row[f"{which}_direct_chunks"] = int(res.timings["direct_chunks"])
                row[f"{which}_rws_peak_bytes"] = res.rws_peak_bytes
        row["ratio"] = row["bulk_s"] / row["restore_s"]
        row["ratio_slots"] = row["bulk_s"] / row["restore_slots_s"]
        row["ratio_vs_bulk_low"] = row["bulk_low_s"] / row["restore_s"]
        rounds.append(row)
        loads.append(snapshot())
    tier.client.unregister_buffer(bulk.ctypes.data)
    med = {k: statistics.median(r[k] for r in rounds) for k in rounds[0] if k != "order"}
    rws = max(r[f"{p}_rws_peak_bytes"] for r in rounds for p in ("restore", "restore_slots"))
    bound = args.window * engine.slot_bytes
    if rws > bound:
        raise OSError(f"staging peaked at {rws} bytes, above W x slot = {bound}")
    out = {
        "restore_gib_s": state / med["restore_s"] / GiB,
        "client_bulk_gib_s": state / med["bulk_s"] / GiB,
        "ratio": med["bulk_s"] / med["restore_s"],
        "ratio_median_of_rounds": med["ratio"],
        "ratio_min_of_rounds": min(r["ratio"] for r in rounds),
        "restore_slots_gib_s": state / med["restore_slots_s"] / GiB,
        "ratio_slots": med["bulk_s"] / med["restore_slots_s"],
        "ratio_slots_median_of_rounds": med["ratio_slots"],
        "client_bulk_low_gib_s": state / med["bulk_low_s"] / GiB,
        "ratio_vs_bulk_low_median_of_rounds": med["ratio_vs_bulk_low"],
        "direct_chunks": med["restore_direct_chunks"],
        "rws_peak_bytes": rws,  # the larger of the two restores' (the slots' path)
        "rws_peak_bytes_direct": max(r["restore_rws_peak_bytes"] for r in rounds),
        "rws_bound_bytes": bound,
        "bulk_buffer_bytes": int(bulk.nbytes),
        "outcome": results["restore"].outcome,
        "rounds_detail": rounds,
        "restore_cpu_s_per_gib": med["restore_cpu_s_per_gib"],
        "restore_slots_cpu_s_per_gib": med["restore_slots_cpu_s_per_gib"],
        "bulk_cpu_s_per_gib": med["bulk_cpu_s_per_gib"],
        # GiB/s x CPU s/GiB: cores kept busy (2 here): near 2, the path is CPU-bound.
        "restore_cores_busy": state / med["restore_s"] / GiB * med["restore_cpu_s_per_gib"],
        "bulk_cores_busy": state / med["bulk_s"] / GiB * med["bulk_cpu_s_per_gib"],
        "restore_read_wait_share": med["restore_read_wait_s"] / med["restore_s"],
        "restore_slots_read_wait_share": med["restore_slots_read_wait_s"] / med["restore_slots_s"],
        "seed": seed,
        "load": summary(loads),
        "load_snapshots": loads,
        "note": "loopback TCP on a shared 2-core machine; the reference verifies nothing",
    }
    if node is not None:
        for p in ("restore", "restore_slots", "bulk", "bulk_low"):
            out[f"{p}_node_cpu_s_per_gib"] = med[f"{p}_node_cpu_s_per_gib"]
        # Both processes' CPU per GiB: what the 2 cores must supply for each path.
        for p in ("restore", "bulk"):
            out[f"{p}_total_cpu_s_per_gib"] = (
                med[f"{p}_cpu_s_per_gib"] + med[f"{p}_node_cpu_s_per_gib"]
            )
    return out
