"""What the Mooncake client itself gives per call shape on a loopback pool, with no bsr-io
path around it: the measurement behind the Mooncake tier's calls (tiers/mooncake/).

The same objects (one chunk record each) are read into registered buffers: the whole
state in one `batch_get_into` call (the bulk read `bench remote` compares with), or one
or four objects per call with 1, 2 or 4 calls in flight, each from caller threads at
normal or low (nice 19) priority. Per shape: GiB/s, this process's CPU, the calling
threads' own CPU (Mooncake 0.3.13 spins there until the transfer ends) and the storage
node's CPU, per GiB. Shapes run in a shuffled order each round; medians over rounds.

Run from the repository root: `python benches/mooncake_calls.py --size 1GiB --rounds 5
--json docs/results/remote-calls.json` (starts and stops its own pool).
"""

from __future__ import annotations

import argparse
import os
import random
import resource
import statistics
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import numpy as np

from bsr_io.cli.report import write_json
from bsr_io.model.layout import preset
from bsr_io.model.record import HEADER_BYTES
from bsr_io.model.sizes import GiB, parse_size
from bsr_io.tiers.mooncake import lower_thread_priority, open_client
from bsr_lab.loopback_pool import LoopbackPool, loopback_netns
from bsr_lab.machine_load import snapshot, summary

TICK = os.sysconf("SC_CLK_TCK")
SHAPES = [  # (name, objects per call, calls in flight); 0 objects: all in one call
    ("bulk", 0, 1),
    ("1 per call, 1 in flight", 1, 1),
    ("1 per call, 2 in flight", 1, 2),
    ("1 per call, 4 in flight", 1, 4),
    ("4 per call, 1 in flight", 4, 1),
]


def thread_cpu_s(tids: list[int]) -> float:
    total = 0
    for t in tids:
        try:
            with open(f"/proc/self/task/{t}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
        except OSError:
            continue
        total += int(fields[11]) + int(fields[12])
    return total / TICK


def proc_cpu_s(pid: int) -> float:
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / TICK


def self_cpu_s() -> float:
    ru = resource.getrusage(resource.RUSAGE_SELF)
    return ru.ru_utime + ru.ru_stime


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--size", type=parse_size, default=parse_size("1GiB"))
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--json", type=Path, default=None)
    args = ap.parse_args()
    layout = preset("deepseek-v4-flash")
    record = HEADER_BYTES + layout.chunk_bytes
    n = max(8, args.size // layout.chunk_bytes)
    state = n * record
    with loopback_netns(), LoopbackPool(state + (256 << 20), lease_ttl_ms=20000) as pool:
        client = open_client(pool.config())
        assert pool.node is not None
        node = pool.node.pid
        src = np.random.default_rng(7).integers(0, 255, state, dtype=np.uint8)
        assert client.register_buffer(src.ctypes.data, src.nbytes) == 0
        names = [f"calls/{i}" for i in range(n)]
        ptrs = [src.ctypes.data + i * record for i in range(n)]
        assert client.batch_put_from(names, ptrs, [record] * n) == [0] * n
        assert client.batch_is_exist(names) == [1] * n
        ring = np.zeros(16 * record, dtype=np.uint8)  # like the engine's slots, reused
        assert client.register_buffer(ring.ctypes.data, ring.nbytes) == 0
        bulk = np.zeros(state, dtype=np.uint8)
        assert client.register_buffer(bulk.ctypes.data, bulk.nbytes) == 0

        def read(idx: list[int], into_bulk: bool) -> None:
            base = bulk.ctypes.data if into_bulk else ring.ctypes.data
            got = client.batch_get_into(
                [names[i] for i in idx],
                [base + (i if into_bulk else i % 16) * record for i in idx],
                [record] * len(idx),
            )
            if list(got) != [record] * len(idx):
                raise OSError(f"read failed: {sorted(set(got))}")

        def run(per_call: int, in_flight: int, priority: str) -> tuple[float, float]:
            """(seconds, CPU seconds of the calling threads)."""
            tids: list[int] = []

            def init() -> None:
                tids.append(threading.get_native_id())
                lower_thread_priority(priority)

            calls = (
                [list(range(n))]
                if per_call == 0
                else [list(range(i, min(n, i + per_call))) for i in range(0, n, per_call)]
            )
            with ThreadPoolExecutor(in_flight, initializer=init) as ex:
                t0 = time.perf_counter()
                for f in [ex.submit(read, c, per_call == 0) for c in calls]:
                    f.result()
                took = time.perf_counter() - t0
                return took, thread_cpu_s(tids)  # before the threads end

        cases = [(s, p) for s in SHAPES for p in ("normal", "low")]
        for (_, per_call, k), p in cases:  # untimed: connections, page faults
            run(per_call, k, p)
        rows: dict[str, list[dict[str, float]]] = {}
        rng = random.Random(int(time.time()))
        loads = [snapshot()]
        for _ in range(args.rounds):
            rng.shuffle(cases)
            for (name, per_call, k), p in cases:
                c0, n0 = self_cpu_s(), proc_cpu_s(node)
                took, callers = run(per_call, k, p)
                rows.setdefault(f"{name}, {p} priority", []).append(
                    {
                        "s": took,
                        "cpu_s_per_gib": (self_cpu_s() - c0) * GiB / state,
                        "callers_cpu_s_per_gib": callers * GiB / state,
                        "node_cpu_s_per_gib": (proc_cpu_s(node) - n0) * GiB / state,
                    }
                )
            loads.append(snapshot())
        client.remove_all(True)
    out: dict[str, Any] = {
        "objects": n,
        "object_bytes": record,
        "state_bytes": state,
        "rounds": args.rounds,
        "shapes": {},
    }
    ref = statistics.median(r["s"] for r in rows["bulk, normal priority"])
    for key, rs in rows.items():
        med = {k: statistics.median(r[k] for r in rs) for k in rs[0]}
        out["shapes"][key] = {
            "gib_s": state / med["s"] / GiB,
            "vs_bulk": ref / med["s"],
            **{k: v for k, v in med.items() if k != "s"},
            "rounds_s": [r["s"] for r in rs],
        }
        print(
            f"{key:42s} {state / med['s'] / GiB:5.2f} GiB/s ({ref / med['s']:.2f} of bulk), "
            f"CPU {med['cpu_s_per_gib']:.2f} s/GiB (callers {med['callers_cpu_s_per_gib']:.2f}),"
            f" node {med['node_cpu_s_per_gib']:.2f}"
        )
    out["load"] = summary(loads)
    out["load_snapshots"] = loads
    out["note"] = "loopback TCP on a shared 2-core machine, Mooncake 0.3.13 (non-CUDA build)"
    write_json(args.json, out)


if __name__ == "__main__":
    main()
