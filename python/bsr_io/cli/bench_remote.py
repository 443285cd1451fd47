"""`bsr-io bench remote`: restore a state from a Mooncake Store pool through W slots,
against the Mooncake client's own bulk read of the same objects into one registered
buffer, in the same run.

The restore is the whole BSR path: discovery (one batched existence check), reads
scattered into engine slots, key/layout/checksum verification, install into a paged
cache, commit. The reference stages the whole state in one buffer with one
`batch_get_into` call and verifies nothing: the client's best case. With no
`--master`, a loopback pool (a master and one storage node) is started for the run
(inside a loopback-only network namespace when run as root) and stopped afterwards.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import random
import resource
import statistics
import time
from contextlib import ExitStack
from pathlib import Path
from typing import Any

import numpy as np

from bsr_io._core import Engine
from bsr_io.cli.load import snapshot, summary
from bsr_io.cli.report import write_json
from bsr_io.engine import as_numpy
from bsr_io.keys import chunk_keys
from bsr_io.kvcache import PagedKVCache
from bsr_io.layout import PRESETS, preset
from bsr_io.record import HEADER_BYTES
from bsr_io.restore import Restorer
from bsr_io.sizes import GiB, fmt_size, parse_size
from bsr_io.store import Store
from bsr_io.testing.synthetic import fill_random, synthetic_tokens
from bsr_io.tiers.mooncake_config import MooncakeConfig


def register(bench_subparsers: Any) -> None:
    p = bench_subparsers.add_parser(
        "remote", help="restore from a Mooncake Store pool vs the client's bulk read",
        description=__doc__,
    )  # fmt: skip
    p.add_argument("--size", type=parse_size, default=parse_size("1GiB"), help="state size")
    p.add_argument("--layout", default="deepseek-v4-flash", choices=sorted(PRESETS))
    p.add_argument("--window", type=int, default=4, help="W: staging slots (reads in flight)")
    p.add_argument("--rounds", type=int, default=3, help="rounds (medians are reported)")
    p.add_argument("--io-threads", type=int, default=None,
                   help="the tier's data call threads (default: its config's)")  # fmt: skip
    p.add_argument("--seed", type=int, default=None, help="seed of the per-round order")
    add_pool_args(p)
    p.add_argument("--json", type=Path, default=None, help="write the results here")
    p.set_defaults(func=run)


def add_pool_args(p: argparse.ArgumentParser) -> None:
    """The pool options shared by the commands that talk to Mooncake Store."""
    g = p.add_argument_group("Mooncake Store pool (default: start one on loopback)")
    g.add_argument("--master", default=None, help="master RPC address host:port")
    g.add_argument("--metadata-server", default=None, help="e.g. http://HOST:PORT/metadata")
    g.add_argument("--protocol", default="tcp", choices=("tcp", "rdma"))
    g.add_argument("--device-name", default="", help="RDMA devices")
    g.add_argument("--local-hostname", default="127.0.0.1",
                   help="this host's address as the pool's nodes reach it")  # fmt: skip
    g.add_argument("--pool-timeout", type=float, default=10.0,
                   help="deadline of each pool call, seconds")  # fmt: skip


def pool_config(args: argparse.Namespace) -> MooncakeConfig | None:
    if args.master is None:
        return None
    if not args.metadata_server:
        raise ValueError("--master needs --metadata-server too (e.g. http://HOST:PORT/metadata)")
    return MooncakeConfig(
        master=args.master, metadata_server=args.metadata_server, protocol=args.protocol,
        device_name=args.device_name, local_hostname=args.local_hostname,
        timeout_s=args.pool_timeout,
    )  # fmt: skip


def _capped_destination(layout, tokens: int, cap_chunks: int) -> PagedKVCache:
    """A paged cache for `tokens` whose block ids cycle through `cap_chunks` chunks'
    blocks: every byte is still installed, host memory stays bounded."""
    small = PagedKVCache.allocate(layout, cap_chunks * layout.chunk_tokens)
    ids = []
    for g, t in zip(layout.groups, small.tensors, strict=True):
        n = -(-tokens // g.block_tokens)
        ids.append([i % t.shape[0] for i in range(n)])
    return PagedKVCache(layout, small.tensors, ids)


def run(args: argparse.Namespace) -> int:
    from bsr_io.tiers.mooncake import MooncakeTier

    layout = preset(args.layout)
    chunk = layout.chunk_bytes
    n = args.size // chunk
    if n < 1:
        raise ValueError(f"--size {args.size} is less than one chunk ({chunk} bytes)")
    if args.window < 1 or args.rounds < 1:
        raise ValueError("--window and --rounds must be at least 1")
    state_bytes = n * chunk
    record = HEADER_BYTES + chunk
    cfg = pool_config(args)
    with ExitStack() as stack:
        where = "given pool"
        if cfg is None:
            from bsr_io.testing.mooncake_pool import LoopbackPool, loopback_netns

            inside = stack.enter_context(loopback_netns())
            segment = n * record + max(n * record // 4, 256 << 20)
            # Leases outlast a bulk read of the whole state on a slow, shared machine.
            pool = stack.enter_context(LoopbackPool(segment, lease_ttl_ms=20000))
            cfg = pool.config(timeout_s=args.pool_timeout)
            where = "loopback pool" + (" (loopback-only netns)" if inside else "")
        if args.io_threads is not None:
            cfg = dataclasses.replace(cfg, io_threads=args.io_threads)
        tier = MooncakeTier(cfg, layout=layout, name="L3")
        stack.callback(tier.close)
        engine = stack.enter_context(Engine(args.window, chunk))
        model = f"bench-remote-{os.getpid()}-{time.time_ns()}"
        tokens = synthetic_tokens(7, n * layout.chunk_tokens)
        keys = chunk_keys(tokens, layout, model)
        print(f"{where} at {cfg.master}: writing {n} chunks of {fmt_size(chunk)} "
              f"({fmt_size(state_bytes)})")  # fmt: skip
        _fill(tier, engine, layout, keys)
        stack.callback(lambda: [tier.remove(k) for k in keys])
        doc = _measure(tier, engine, layout, keys, tokens, args, model)
    doc.update(
        pool=where, master=cfg.master, protocol=cfg.protocol, layout=layout.name,
        chunk_bytes=chunk, chunks=n, state_bytes=state_bytes, window=args.window,
        slot_bytes=engine.slot_bytes, rounds=args.rounds, io_threads=cfg.io_threads,
    )  # fmt: skip
    print(f"restore {doc['restore_gib_s']:.2f} GiB/s through {args.window} slots vs client bulk "
          f"{doc['client_bulk_gib_s']:.2f} GiB/s into one {fmt_size(doc['bulk_buffer_bytes'])} "
          f"buffer: ratio {doc['ratio']:.3f}; RWS {fmt_size(doc['rws_peak_bytes'])} "
          f"(W x chunk = {fmt_size(args.window * chunk)}), state {fmt_size(state_bytes)}, "
          f"outcome {doc['outcome']}; {doc['restore_read_wait_share']:.0%} of the restore "
          f"waiting for the pool, CPU {doc['restore_cpu_s_per_gib']:.2f} s/GiB (bulk "
          f"{doc['bulk_cpu_s_per_gib']:.2f})")  # fmt: skip
    write_json(args.json, doc)
    return 0 if doc["outcome"] == "complete" else 1


def _cpu_s() -> float:
    """This process's CPU time (the pool's storage node is another process)."""
    ru = resource.getrusage(resource.RUSAGE_SELF)
    return ru.ru_utime + ru.ru_stime


def _fill(tier, engine: Engine, layout, keys) -> None:
    slot = engine.lease()
    slot.set_length(layout.chunk_bytes)
    view = as_numpy(slot)
    for i, k in enumerate(keys):
        fill_random(view, 0xB5, i)
        tier.write(k, slot, layout)
    del view, slot


def _measure(tier, engine, layout, keys, tokens, args, model) -> dict[str, Any]:
    n, chunk = len(keys), layout.chunk_bytes
    record = HEADER_BYTES + chunk
    names = [tier.object_name(k) for k in keys]
    bulk = np.empty(n * record, dtype=np.uint8)
    bulk.fill(0)  # fault the pages in before the clock runs
    rc = tier.client.register_buffer(bulk.ctypes.data, bulk.nbytes)
    if rc != 0:
        raise OSError(f"cannot register the bulk buffer with the pool: {rc}")
    ptrs = [bulk.ctypes.data + i * record for i in range(n)]
    dest = _capped_destination(layout, n * layout.chunk_tokens, max(2, args.window))
    restorer = Restorer(Store([tier]), layout, window=args.window, engine=engine, model=model)
    # One untimed round first: the first transfers pay for connections and page faults.
    tier.client.batch_get_into(names, ptrs, [record] * n)
    restorer.restore(restorer.probe(tokens), dest)
    rounds = []
    res = None
    seed = args.seed if args.seed is not None else random.SystemRandom().randrange(1 << 32)
    rng = random.Random(seed)
    loads = [snapshot()]
    for _ in range(args.rounds):
        row: dict[str, Any] = {}
        order = ["bulk", "restore"]
        rng.shuffle(order)
        row["order"] = order
        for which in order:
            c0 = _cpu_s()
            if which == "bulk":
                t0 = time.perf_counter()
                got = tier.client.batch_get_into(names, ptrs, [record] * n)
                row["bulk_s"] = time.perf_counter() - t0
                row["bulk_cpu_s_per_gib"] = (_cpu_s() - c0) * GiB / (n * chunk)
                if list(got) != [record] * n:
                    raise OSError(f"client bulk read failed: {sorted(set(got))}")
            else:
                t0 = time.perf_counter()
                plan = restorer.probe(tokens)
                t1 = time.perf_counter()
                res = restorer.restore(plan, dest)
                row["probe_s"] = t1 - t0
                row["restore_s"] = time.perf_counter() - t1
                row["restore_cpu_s_per_gib"] = (_cpu_s() - c0) * GiB / (n * chunk)
                # Waiting for the pool vs verifying and installing: which bounds it.
                row["restore_read_wait_s"] = res.timings["read_wait_s"]
                row["restore_install_s"] = res.timings["install_copy_s"]
                if not res.complete:
                    raise OSError(f"restore from the pool ended {res.outcome}: {res.reason}")
        row["ratio"] = row["bulk_s"] / row["restore_s"]
        rounds.append(row)
        loads.append(snapshot())
    tier.client.unregister_buffer(bulk.ctypes.data)
    med = {k: statistics.median(r[k] for r in rounds) for k in rounds[0] if k != "order"}
    state = n * chunk
    assert res is not None
    return {
        "restore_gib_s": state / med["restore_s"] / GiB,
        "client_bulk_gib_s": state / med["bulk_s"] / GiB,
        "ratio": med["bulk_s"] / med["restore_s"],
        "ratio_median_of_rounds": med["ratio"],
        "probe_s": med["probe_s"],
        "rws_peak_bytes": res.rws_peak_bytes,
        "rws_expected_bytes": args.window * engine.slot_bytes,
        "bulk_buffer_bytes": int(bulk.nbytes),
        "outcome": res.outcome,
        "rounds_detail": rounds,
        "restore_cpu_s_per_gib": med["restore_cpu_s_per_gib"],
        "bulk_cpu_s_per_gib": med["bulk_cpu_s_per_gib"],
        # GiB/s x CPU s/GiB: cores kept busy (2 here): near 2, the path is CPU-bound.
        "restore_cores_busy": state / med["restore_s"] / GiB * med["restore_cpu_s_per_gib"],
        "bulk_cores_busy": state / med["bulk_s"] / GiB * med["bulk_cpu_s_per_gib"],
        "restore_read_wait_share": med["restore_read_wait_s"] / med["restore_s"],
        "seed": seed,
        "load": summary(loads),
        "load_snapshots": loads,
        "note": "loopback TCP on a shared 2-core machine; the reference verifies nothing",
    }
