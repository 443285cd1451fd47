"""`bsr-lab bench ceiling`: how fast the restore loop can go when the drive is not the limit.

The state's record files live on a RAM-backed filesystem that accepts O_DIRECT (tmpfs
does on current kernels), so reads cost a kernel copy and no device time. In the same
run, interleaved, median of rounds after one uncounted warm-up round:

- engine: the engine alone reading every record's payload range through the same W
  slots at the same queue depth (each file opened, each slot released unread): the
  rate the restore could reach if installing and verifying were free;
- restore: BSR restoring the state into a host KV cache: each record read with O_DIRECT
  straight into the cache's blocks and hashed there (no slot, no copy), where the
  blocks are page-aligned and not shared between chunks (the default sizes);
- restore_slots: the same restore through the W slots (fused verify-while-install: one
  pass copies each slot into the blocks and hashes it, in Rust, GIL released);
- restore_unfused: the same restore with the hash and the install copy as two passes
  over the slot (the path CUDA and other destinations take), to show what the fusion
  moved;
- hash: xxh3 over the state's bytes where they lie in the cache, no read: the least CPU
  any restore that verifies every byte spends on top of the read (memory bandwidth).

`ratio` = restore / engine; `restore_cpu_s_per_gib` is the process's user + system CPU
time per GiB restored. From tmpfs that includes the kernel's copy out of the source (the
engine alone pays it too); `restore_own_cpu_s_per_gib` (restore minus engine) is what the
restore adds to the read, the figure that carries over to a drive, and `hash` its floor.
"""

from __future__ import annotations

import argparse
import os
import random
import shutil
import statistics
import time
from collections import deque
from pathlib import Path
from typing import Any

import torch

from bsr_io._core import Engine, xxh3_64
from bsr_io.cli.host import mem_available, process_cpu_s
from bsr_io.cli.report import write_json
from bsr_io.cli.scratch import fs_type, scratch_base, scratch_dir
from bsr_io.cli.synthetic import synthetic_tokens
from bsr_io.load.kvcache import Fence, PagedKVCache
from bsr_io.model.keys import chunk_keys
from bsr_io.model.layout import PRESETS, KVLayout, preset
from bsr_io.model.record import HEADER_BYTES
from bsr_io.model.sizes import GiB, fmt_size, parse_size
from bsr_io.restore import Restorer
from bsr_io.store import Store
from bsr_io.tiers import SSDTier
from bsr_lab.bench_state import write_state
from bsr_lab.machine_load import snapshot, summary
from bsr_lab.targets import not_applicable, verdict

MODEL = "bsr-io-bench-ceiling"
GOAL = 0.85  # restore / engine at W=32 with the deepseek-v4-flash chunk
CPU_GOAL = 0.15  # restore CPU s/GiB (direct reads leave only the hash)
METHODS = ("engine", "restore", "restore_slots", "restore_unfused", "hash")


def register(bench_subparsers: Any) -> None:
    p = bench_subparsers.add_parser(
        "ceiling",
        help="restore loop vs the engine alone, from a RAM-backed O_DIRECT source",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--layout", default="deepseek-v4-flash", choices=sorted(PRESETS))
    p.add_argument("--tokens", type=int, default=32768, help="prefix length (default 32768)")
    p.add_argument("--window", type=int, default=32, help="W: staging slots")
    p.add_argument("--queue-depth", type=int, default=32, help="engine queue depth")
    p.add_argument("--rounds", type=int, default=3, help="rounds (median is reported)")
    p.add_argument(
        "--dir",
        type=Path,
        default=None,
        help="RAM-backed directory for the records (default: /dev/shm)",
    )
    p.add_argument(
        "--dest-cap",
        type=parse_size,
        default=parse_size("2GiB"),
        help="host KV cache size; a larger state cycles through its blocks (and is then "
        "restored through slots: chunks sharing blocks cannot be read in place at once)",
    )
    p.add_argument(
        "--install-threads",
        type=int,
        default=1,
        help="fused installs of several chunks at once (default 1: on the restoring thread)",
    )
    p.add_argument("--backend", default=None, help="engine backend (default: auto)")
    p.add_argument("--json", type=Path, default=None, help="write the results here")
    p.add_argument("--quiet", action="store_true", help="no progress bars")
    p.add_argument("--seed", type=int, default=None, help="seed of the per-round order")
    p.set_defaults(func=run)


class _Unfused:
    """The destination without its host memory runs: installs take the two-pass path
    (copy, then hash the slot), as on a CUDA destination."""

    direct_reads = False

    def __init__(self, inner: PagedKVCache) -> None:
        self.inner = inner
        self.capacity_chunks = inner.capacity_chunks
        self.layout = inner.layout

    def install(self, chunk_index: int, payload: torch.Tensor) -> Fence | None:
        return self.inner.install(chunk_index, payload)

    def extract(self, chunk_index: int, out: torch.Tensor) -> None:
        self.inner.extract(chunk_index, out)

    def synchronize(self) -> None:
        self.inner.synchronize()


def _destination(lay: KVLayout, tokens: int, cap_bytes: int) -> PagedKVCache:
    """A host KV cache; past `cap_bytes`, block ids cycle so memory stays bounded."""
    cap_tokens = max(lay.chunk_tokens, cap_bytes // lay.token_bytes)
    cap_tokens = min(tokens, cap_tokens // lay.chunk_tokens * lay.chunk_tokens)
    small = PagedKVCache.allocate(lay, cap_tokens)
    ids = []
    for g, t in zip(lay.groups, small.tensors, strict=True):
        n = -(-tokens // g.block_tokens)
        ids.append([i % t.shape[0] for i in range(n)])
    return PagedKVCache(lay, small.tensors, ids)


def engine_read_records(eng: Engine, paths: list[Path], payload: int) -> float:
    """Every record's payload through the engine's slots, all W in flight; returns seconds."""
    inflight: deque[Any] = deque()
    t0 = time.perf_counter()
    for p in paths:
        if len(inflight) == eng.window:
            inflight.popleft().wait()  # the slot returns to the ring unread
        f = eng.open(p)
        inflight.append(eng.submit_read(f, HEADER_BYTES, payload))
        f.close()  # the read holds its own reference to the file
    while inflight:
        inflight.popleft().wait()
    return time.perf_counter() - t0


def hash_in_place(dest: PagedKVCache, state: int) -> float:
    """xxh3 over `state` bytes of the cache's memory (cycling through its tensors when the
    cache is smaller); returns seconds."""
    views = [t.view(-1).view(torch.uint8).numpy() for t in dest.tensors]
    t0 = time.perf_counter()
    left = state
    while left > 0:
        for v in views:
            n = min(left, v.nbytes)
            xxh3_64(v[:n].data)
            left -= n
            if left == 0:
                break
    return time.perf_counter() - t0


def run(args: argparse.Namespace) -> int:
    lay = preset(args.layout)
    if args.tokens < lay.chunk_tokens:
        raise ValueError(f"--tokens {args.tokens} is less than one chunk ({lay.chunk_tokens})")
    if args.window < 1 or args.rounds < 1:
        raise ValueError("--window and --rounds must be at least 1")
    # The ceiling asks for memory on purpose: a RAM-backed source, so the drive is not
    # the limit.
    base = scratch_base(args.dir, memory=True)
    chunks = args.tokens // lay.chunk_tokens
    state = chunks * lay.chunk_bytes
    need = chunks * (lay.chunk_bytes + HEADER_BYTES)
    free = shutil.disk_usage(base).free
    avail = mem_available()
    ram = need + min(state, args.dest_cap) + args.window * lay.chunk_bytes
    if need > free or (avail is not None and ram > avail):
        raise ValueError(
            f"{args.tokens} tokens of {lay.name} take {fmt_size(need)} ({need:,} bytes) in "
            f"{base} plus {fmt_size(ram - need)} of KV cache and slots; {fmt_size(free)} free "
            f"there, {fmt_size(avail or 0)} of memory available: pass fewer --tokens"
        )
    with scratch_dir(base, "bsr-io-ceiling-", memory=True) as root:
        doc = measure(args, root, lay)
    print_table(doc)
    write_json(args.json, doc)
    return 0 if doc["outcome"] == "complete" else 1


def measure(args: argparse.Namespace, root: Path, lay: KVLayout) -> dict[str, Any]:
    chunks = args.tokens // lay.chunk_tokens
    tokens = chunks * lay.chunk_tokens
    state = chunks * lay.chunk_bytes
    token_ids = synthetic_tokens(7, tokens)
    keys = chunk_keys(token_ids, lay, MODEL, 0, 1)
    eng = Engine(args.window, lay.chunk_bytes, queue_depth=args.queue_depth, backend=args.backend)
    l2 = SSDTier(root / "l2", None, eng, layout=lay)
    write_state(l2, eng, lay, keys, 7, args.quiet)
    paths = [l2.path_of(k) for k in keys]
    probe = eng.open(paths[0])
    direct = probe.direct
    probe.close()
    restorer = Restorer(
        Store([l2]),
        lay,
        window=args.window,
        engine=eng,
        model=MODEL,
        install_threads=args.install_threads,
    )
    dest = _destination(lay, tokens, args.dest_cap)
    unfused = _Unfused(dest)
    direct_ok = dest.direct_reads
    direct_chunks: dict[str, list[int]] = {m: [] for m in METHODS}
    rounds: dict[str, list[dict[str, float]]] = {m: [] for m in METHODS}
    outcomes, rws = set(), 0
    load0 = os.getloadavg()[0]
    seed = args.seed if args.seed is not None else random.SystemRandom().randrange(1 << 32)
    rng = random.Random(seed)
    orders: list[list[str]] = []
    loads = [snapshot()]
    # Round -1 is a warm-up, not counted: the first pass of each path pays one-time costs
    # (the I/O workers starting, the destination's pages faulting in) that would
    # otherwise land on whichever path runs first.
    for r in range(-1, args.rounds):
        order = list(METHODS)
        rng.shuffle(order)  # a fresh order each round: none always follows another
        if r >= 0:
            orders.append(order)
        for method in order:
            c0 = process_cpu_s()
            if method == "engine":
                secs = engine_read_records(eng, paths, lay.chunk_bytes)
            elif method == "hash":
                secs = hash_in_place(dest, state)
            else:
                plan = restorer.probe(token_ids)
                target = unfused if method == "restore_unfused" else dest
                dest.direct_reads = direct_ok and method == "restore"
                t0 = time.perf_counter()
                res = restorer.restore(plan, target)
                secs = time.perf_counter() - t0
                if r >= 0:
                    direct_chunks[method].append(int(res.timings.get("direct_chunks", 0)))
                outcomes.add(res.outcome)
                rws = max(rws, res.rws_peak_bytes)
                if not res.complete:
                    raise RuntimeError(f"{method} did not complete: {res.reason}")
            cpu_s = process_cpu_s() - c0
            if r < 0:
                continue
            rounds[method].append(
                {"gib_s": state / secs / GiB, "seconds": secs, "cpu_s_per_gib": cpu_s * GiB / state}
            )
        if r >= 0:
            loads.append(snapshot())
    backend = eng.backend
    eng.close()
    med = {m: statistics.median(x["gib_s"] for x in v) for m, v in rounds.items()}
    cpu = {m: statistics.median(x["cpu_s_per_gib"] for x in v) for m, v in rounds.items()}
    ratio = med["restore"] / med["engine"]
    na = not_applicable(lay, chunks, args.window)
    return {
        "source": f"{fs_type(root)} ({'O_DIRECT' if direct else 'buffered: O_DIRECT refused'})",
        "layout": lay.name,
        "tokens": tokens,
        "chunks": chunks,
        "chunk_bytes": lay.chunk_bytes,
        "state_bytes": state,
        "window": args.window,
        "queue_depth": args.queue_depth,
        "install_threads": args.install_threads,
        "backend": backend,
        "rounds": args.rounds,
        "engine_raw_gib_s": med["engine"],
        "restore_gib_s": med["restore"],
        "ratio": ratio,
        # restore / engine within each round (the two runs seconds apart), then the median:
        # less exposed to other processes' load drifting between rounds.
        "ratio_paired": statistics.median(
            r["gib_s"] / e["gib_s"]
            for r, e in zip(rounds["restore"], rounds["engine"], strict=True)
        ),
        "restore_cpu_s_per_gib": cpu["restore"],
        # GiB/s x CPU s/GiB: cores kept busy. Where the restore keeps every core busy the
        # ratio is CPU-bound: it is then the engine's CPU cost over the restore's.
        "engine_cores_busy": med["engine"] * cpu["engine"],
        "restore_cores_busy": med["restore"] * cpu["restore"],
        "engine_cpu_s_per_gib": cpu["engine"],
        # The restore read straight into the cache (chunks per round), against the same
        # restore through the slots.
        "restore_direct_chunks": direct_chunks["restore"],
        "restore_slots_gib_s": med["restore_slots"],
        "ratio_slots": med["restore_slots"] / med["engine"],
        "restore_slots_cpu_s_per_gib": cpu["restore_slots"],
        "direct_over_slots": med["restore"] / med["restore_slots"],
        "goal_cpu_s_per_gib": CPU_GOAL,
        # Why the goals do not apply to this input (None: they do; then the booleans).
        "goal_not_applicable": na,
        "goal_cpu_met": cpu["restore"] <= CPU_GOAL if na is None else None,
        # What the restore adds to the read (both pay the source's kernel copy here), and
        # the floor under it: hashing the same bytes in memory, no read.
        "restore_own_cpu_s_per_gib": cpu["restore"] - cpu["engine"],
        "goal_own_cpu_met": cpu["restore"] - cpu["engine"] <= CPU_GOAL if na is None else None,
        "hash_cpu_s_per_gib": cpu["hash"],
        "hash_gib_s": med["hash"],
        "ratio_rounds": [
            r["gib_s"] / e["gib_s"]
            for r, e in zip(rounds["restore"], rounds["engine"], strict=True)
        ],
        "restore_unfused_gib_s": med["restore_unfused"],
        "ratio_unfused": med["restore_unfused"] / med["engine"],
        "restore_unfused_cpu_s_per_gib": cpu["restore_unfused"],
        "fused_over_unfused": med["restore"] / med["restore_unfused"],
        "goal_ratio": GOAL,
        "goal_met": ratio >= GOAL if na is None else None,
        "rws_peak_bytes": rws,
        "rws_bound_bytes": args.window * eng.slot_bytes,
        "outcome": outcomes.pop() if len(outcomes) == 1 else "mixed",
        "cpus": os.cpu_count(),
        # Other processes' load before and after: the restore needs two cores (the I/O
        # thread's kernel copies and the install), the engine alone one.
        "loadavg_1m": [load0, os.getloadavg()[0]],
        "seed": seed,
        "orders": orders,
        "load": summary(loads),
        "load_snapshots": loads,
        "per_round": rounds,
    }


def print_table(doc: dict[str, Any]) -> None:
    print(
        f"\nbench ceiling: {doc['tokens']:,} tokens of {doc['layout']} = "
        f"{fmt_size(doc['state_bytes'])}, W={doc['window']}, queue depth {doc['queue_depth']}, "
        f"engine {doc['backend']}, source {doc['source']}, median of {doc['rounds']}"
    )
    print(f"{'path':<16} {'GiB/s':>7} {'CPU s/GiB':>10} {'cores busy':>11}")
    for name, key in (
        ("engine alone", "engine_raw"),
        ("restore", "restore"),
        ("restore, slots", "restore_slots"),
        ("restore, 2 pass", "restore_unfused"),
        ("hash in memory", "hash"),
    ):
        cpu = "engine_cpu_s_per_gib" if key == "engine_raw" else key + "_cpu_s_per_gib"
        rate = doc[key + "_gib_s"]
        print(f"{name:<16} {rate:>7.2f} {doc[cpu]:>10.3f} {rate * doc[cpu]:>11.2f}")
    na = doc.get("goal_not_applicable")
    met = verdict(doc["goal_met"], na)
    if doc["restore_cores_busy"] > 0.85 * (doc["cpus"] or 1):
        print(
            f"note: the restore kept {doc['restore_cores_busy']:.2f} of {doc['cpus']} cores busy: "
            "CPU-bound, so the ratio is the engine's CPU cost over the restore's"
        )
    if max(doc["loadavg_1m"]) > 0.5 * (doc["cpus"] or 1):
        print(f"note: the machine was busy (1-minute load {doc['loadavg_1m']}): figures are noisy")
    print(
        f"ratio restore/engine {doc['ratio']:.3f} (goal >= {doc['goal_ratio']}: {met}); "
        f"paired within rounds {doc['ratio_paired']:.3f}; two-pass {doc['ratio_unfused']:.3f}; "
        f"RWS peak {doc['rws_peak_bytes']:,} B; "
        f"outcome {doc['outcome']}"
    )
    rounds = " ".join(f"{x:.2f}" for x in doc["ratio_rounds"])
    cpu_met = verdict(doc["goal_cpu_met"], na, again=True)
    print(
        f"per round {rounds}; read in place {doc['restore_direct_chunks']} chunks per round; "
        f"through slots {doc['ratio_slots']:.3f}; restore CPU {doc['restore_cpu_s_per_gib']:.3f} "
        f"s/GiB (goal <= {doc['goal_cpu_s_per_gib']}: {cpu_met})"
    )
    own_met = verdict(doc["goal_own_cpu_met"], na, again=True)
    print(
        f"restore CPU over the engine's {doc['restore_own_cpu_s_per_gib']:.3f} s/GiB "
        f"({own_met}); hashing the bytes in memory alone {doc['hash_cpu_s_per_gib']:.3f} s/GiB "
        f"at {doc['hash_gib_s']:.2f} GiB/s (the floor of a verifying restore)"
    )
