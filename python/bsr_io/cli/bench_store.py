"""`bsr-io bench store`: write then read (cold cache) deepseek-v4-flash chunks through
L2, against the engine's raw read and write of one file of the same size, and fio
(on huge-page buffers where it can: the drive's limit; on 4 KiB pages too), in the same
run. Also times the per-chunk open+close that one file per record costs,
and what a record's save costs the process beside its bytes: CPU time and context
switches per record (every thread of the process, the kernel's io_uring workers
included), against the raw write of the same bytes (`--chunk-tokens 16` on
llama-3.1-8b: the 2 MiB records a vLLM step cut writes)."""

from __future__ import annotations

import argparse
import dataclasses
import os
import statistics
import time
from collections import deque
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from bsr_io._core import Engine, File
from bsr_io.cli.fio import (
    HugeMem,
    best_depth,
    drop_caches,
    fio_available,
    fio_read,
    huge_page_buffers,
)
from bsr_io.cli.host import process_cpu_s, process_switches
from bsr_io.cli.report import write_json
from bsr_io.cli.scratch import scratch_dir
from bsr_io.engine import as_numpy
from bsr_io.model.keys import ChunkKey, chunk_keys
from bsr_io.model.layout import PRESETS, KVLayout, preset
from bsr_io.model.record import HEADER_BYTES
from bsr_io.model.sizes import GiB, fmt_size, parse_size
from bsr_io.tiers import SSDTier

ALIGN = 4096  # the O_DIRECT block the raw file's chunks are placed on
FIO_DEPTH = 32  # fio's deepest queue (its buffers); it reads at `best_depth`


def register(bench_subparsers: Any) -> None:
    p = bench_subparsers.add_parser(
        "store", help="L2 chunk store write/read vs raw engine and fio", description=__doc__
    )
    p.add_argument("--size", type=parse_size, default=parse_size("2GiB"), help="state size")
    p.add_argument("--layout", default="deepseek-v4-flash", choices=sorted(PRESETS))
    p.add_argument(
        "--chunk-tokens", type=int, default=None, help="tokens per chunk (default: the layout's)"
    )
    p.add_argument("--window", type=int, default=4, help="W: staging slots (reads in flight)")
    p.add_argument("--dir", type=Path, default=None, help="where to put the store")
    p.add_argument("--json", type=Path, default=None, help="write the results here")
    p.add_argument("--rounds", type=int, default=3, help="read rounds (median is reported)")
    p.add_argument("--backend", default=None, help="engine backend (default: auto)")
    p.set_defaults(func=run)


def engine_read(eng: Engine, f: File, size: int) -> tuple[float, int]:
    """Read the whole file through the window, every slot's read in flight; each slot is
    released as soon as it has been consumed. Returns (seconds, peak live bytes)."""
    slot, window = eng.slot_bytes, eng.window
    eng.reset_peak()
    inflight: deque[Any] = deque()
    off = 0
    t0 = time.perf_counter()
    while off < size or inflight:
        while off < size and len(inflight) < window:
            n = min(slot, size - off)
            inflight.append(eng.submit_read(f, off, n))
            off += n
        s = inflight.popleft().wait()
        # Consume: the slot's bytes are there to be installed; a read of one byte keeps
        # the loop honest without adding a copy. Then straight back to the ring.
        with memoryview(s) as view:
            _ = view[len(s) - 1]
        s.release()
        del s
    elapsed = time.perf_counter() - t0
    return elapsed, eng.peak_bytes()


def _fill_slots(engine: Engine, layout: KVLayout, n: int) -> list[Any]:
    """`n` leased slots of pseudo-random chunk bytes (made once: generating 16 MiB of
    random bytes per chunk would cost more than writing it)."""
    from bsr_io.cli.synthetic import fill_random  # imports torch: not for `--help`

    slots = []
    for i in range(n):
        s = engine.lease()
        s.set_length(layout.chunk_bytes)
        fill_random(as_numpy(s), 0xB5, i)
        slots.append(s)
    return slots


class Cost:
    """The process's CPU time (every thread, user and system) and context switches
    (voluntary and not) between `start()` and `stop()`."""

    def start(self) -> None:
        self._t0, self._cpu0, self._sw0 = time.perf_counter(), process_cpu_s(), process_switches()

    def stop(self) -> dict[str, float]:
        return {
            "wall_s": time.perf_counter() - self._t0,
            "cpu_s": process_cpu_s() - self._cpu0,
            "switches": process_switches() - self._sw0,
        }


def store_write(
    tier: SSDTier, keys: list[ChunkKey], layout: KVLayout, slots: list[Any]
) -> dict[str, float]:
    """Write every chunk, W writers at once (a save runs one chunk per slot). Writer w
    owns slot w and writes chunks w, w+W, ...: a slot is never under two writes."""
    w = len(slots)

    def writer(j: int) -> None:
        for i in range(j, len(keys), w):
            tier.write(keys[i], slots[j], layout)

    cost = Cost()
    with ThreadPoolExecutor(w) as pool:
        cost.start()
        list(pool.map(writer, range(min(w, len(keys)))))
        return cost.stop()


def raw_stride(chunk: int) -> int:
    """Where chunk i starts in the raw file: chunks at whole O_DIRECT blocks (4 KiB), as
    the store's payloads are; the same as `chunk` for a layout of whole blocks."""
    return -(-chunk // ALIGN) * ALIGN


def raw_write(
    engine: Engine, path: Path, slots: list[Any], count: int, chunk: int
) -> dict[str, float]:
    """The engine writing the same bytes to one file, W in flight, one fdatasync. Chunk i
    goes at `i * raw_stride(chunk)` (an O_DIRECT offset must be block-aligned); the file
    is then `count` whole strides long, so a reader reads whole blocks."""
    stride = raw_stride(chunk)
    cost = Cost()
    cost.start()
    f = engine.open(path, create=True)
    inflight: deque[Any] = deque()
    for i in range(count):
        if len(inflight) == len(slots):
            inflight.popleft().wait()
        inflight.append(engine.submit_write(slots[i % len(slots)], f, i * stride, chunk))
    while inflight:
        inflight.popleft().wait()
    if stride != chunk:
        os.truncate(f.fileno(), count * stride)
    f.sync()
    f.close()
    return cost.stop()


def store_read(tier: SSDTier, keys: list[ChunkKey], engine: Engine) -> float:
    """Read and verify every chunk, W reads in flight."""
    t0 = time.perf_counter()
    inflight: deque[Any] = deque()
    for key in keys:
        if len(inflight) == engine.window:
            s = inflight.popleft().wait()
            del s
        inflight.append(tier.submit_read(key, engine))
    while inflight:
        s = inflight.popleft().wait()
        del s
    return time.perf_counter() - t0


def open_close_us(engine: Engine, paths: list[Path]) -> float:
    times = []
    for p in paths:
        t0 = time.perf_counter()
        engine.open(p).close()
        times.append(time.perf_counter() - t0)
    return statistics.median(times) * 1e6


def run(args: argparse.Namespace) -> int:
    layout = preset(args.layout)
    if args.chunk_tokens is not None:
        layout = dataclasses.replace(layout, chunk_tokens=args.chunk_tokens)
    count = args.size // layout.chunk_bytes
    if count < 1 or args.window < 1 or args.rounds < 1:
        raise ValueError(
            f"need --size >= one chunk ({layout.chunk_bytes} bytes), --window >= 1, --rounds >= 1"
        )
    size = count * layout.chunk_bytes
    # The store's records and the raw file beside them.
    need = count * (HEADER_BYTES + 2 * raw_stride(layout.chunk_bytes))
    block = min(1 << 20, count * raw_stride(layout.chunk_bytes))
    with (
        scratch_dir(args.dir, "bsr-io-bench-store-", need_bytes=need) as work,
        huge_page_buffers(block * FIO_DEPTH) as huge,
    ):
        report = measure(args, layout, count, size, work, huge)
    print_report(report)
    write_json(args.json, report)
    return 0


def measure(
    args: argparse.Namespace,
    layout: KVLayout,
    count: int,
    size: int,
    work: Path,
    huge: HugeMem | None = None,
) -> dict[str, Any]:
    from bsr_io.cli.synthetic import synthetic_tokens

    keys = chunk_keys(synthetic_tokens(1, count * layout.chunk_tokens), layout, "bench")
    raw_path = work / "raw.bin"
    # The raw file: the same chunks on whole blocks (a tiny chunk pads to 4 KiB, as the
    # store's payload does). Rates are payload bytes (`size`) per second throughout.
    raw_bytes = count * raw_stride(layout.chunk_bytes)
    # W slots hold the payloads being written; W more are free for reads.
    with Engine(2 * args.window, layout.chunk_bytes, backend=args.backend) as engine:
        tier = SSDTier(work / "l2", None, engine, layout=layout)
        slots = _fill_slots(engine, layout, args.window)
        print(
            f"writing {count} chunks ({fmt_size(size)}) to L2 and to one raw file ...", flush=True
        )
        c_store = store_write(tier, keys, layout, slots)
        c_raw = raw_write(engine, raw_path, slots, count, layout.chunk_bytes)
        w_store, w_raw = c_store["wall_s"], c_raw["wall_s"]
        del slots
        have_fio = fio_available()
        rounds: dict[str, list[float]] = {"store": [], "raw": []}
        # fio on its default 4 KiB pages has its 1 MiB reads split by the disk queue;
        # on huge pages it is the drive's limit, the reference the ratio is taken to.
        huge_fio = have_fio and huge is not None and huge.mount is not None
        if have_fio:
            rounds["fio"] = []
        if huge_fio:
            rounds["fio_hugemem"] = []
        block = min(1 << 20, raw_bytes)
        depth, depth_scan = FIO_DEPTH, dict[int, float]()
        if have_fio and block == 1 << 20:  # whole 1 MiB requests: the file holds one
            # fio at its best: the depth this drive reads fastest at, huge pages or not.
            iomem = huge.iomem("store") if huge_fio and huge else None
            depth, depth_scan = best_depth(raw_path, raw_bytes, iomem=iomem)
        cold = True
        raw_file = engine.open(raw_path)
        for r in range(args.rounds):
            order = list(rounds)[r % len(rounds) :] + list(rounds)[: r % len(rounds)]
            for method in order:
                cold &= drop_caches()
                if method == "store":
                    seconds = store_read(tier, keys, engine)
                elif method == "raw":
                    engine_read_w = Engine(args.window, layout.chunk_bytes, backend=args.backend)
                    with engine_read_w as eng:
                        f = eng.open(raw_path)
                        seconds, _ = engine_read(eng, f, raw_bytes)
                        f.close()
                else:
                    iomem = huge.iomem("store") if method == "fio_hugemem" and huge else None
                    fio = fio_read(
                        raw_path, size=raw_bytes, block_bytes=block, iodepth=depth, iomem=iomem
                    )
                    seconds = raw_bytes / (fio.gib_s * GiB)
                rounds[method].append(size / seconds / GiB)
        raw_file.close()
        drop_caches()
        oc_us = open_close_us(engine, [tier.path_of(k) for k in keys])
        stats = tier.stats()
        backend = engine.backend
    med = {m: statistics.median(v) for m, v in rounds.items()}
    chunk_read_us = layout.chunk_bytes / (med["store"] * GiB) * 1e6
    return {
        "layout": layout.name,
        "chunk_tokens": layout.chunk_tokens,
        "chunk_bytes": layout.chunk_bytes,
        "chunks": count,
        "size_bytes": size,
        "window": args.window,
        "raw_stride_bytes": raw_stride(layout.chunk_bytes),
        "backend": backend,
        "cold_cache": cold,
        "rounds": args.rounds,
        "write_gib_s": {"store": size / w_store / GiB, "raw": size / w_raw / GiB},
        "write_ratio_store_vs_raw": w_raw / w_store,
        # Per record: the store's whole save, and the raw write's share of the same bytes.
        "write_cpu_ms_per_record": {
            "store": 1e3 * c_store["cpu_s"] / count,
            "raw": 1e3 * c_raw["cpu_s"] / count,
        },
        "write_switches_per_record": {
            "store": c_store["switches"] / count,
            "raw": c_raw["switches"] / count,
        },
        "read_gib_s": med,
        "read_rounds_gib_s": rounds,
        "read_ratio_store_vs_raw": med["store"] / med["raw"],
        "read_ratio_store_vs_fio": med["store"] / med["fio"] if have_fio else None,
        "read_ratio_store_vs_fio_hugemem": (
            med["store"] / med["fio_hugemem"] if "fio_hugemem" in med else None
        ),
        "fio_hugemem_note": None if huge is None or huge.mount else huge.note,
        "fio_depth": depth,
        "fio_depth_scan_s": {str(d): s for d, s in depth_scan.items()},
        # Write then read, end to end: time of the raw pair over time of the store pair.
        "write_read_ratio_store_vs_raw": (w_raw + size / (med["raw"] * GiB))
        / (w_store + size / (med["store"] * GiB)),
        "open_close_us_per_chunk": oc_us,
        "chunk_read_us": chunk_read_us,
        "open_close_share": oc_us / chunk_read_us,
        "verified_reads": stats["reads"],
        "dir": os.fspath(work),
    }


def print_report(rep: dict[str, Any]) -> None:
    print(
        f"\nbench store: {rep['chunks']} chunks of {rep['layout']} ({fmt_size(rep['size_bytes'])}),"
        f" W={rep['window']}, backend {rep['backend']}, cold cache "
        f"{'yes' if rep['cold_cache'] else 'NO'}, median of {rep['rounds']} read rounds"
    )
    w = rep["write_gib_s"]
    print(
        f"write GiB/s: L2 store {w['store']:.3f}  raw engine {w['raw']:.3f}  "
        f"ratio {rep['write_ratio_store_vs_raw']:.3f}"
    )
    cpu, sw = rep["write_cpu_ms_per_record"], rep["write_switches_per_record"]
    print(
        f"write per record: L2 store {cpu['store']:.2f} ms CPU, {sw['store']:.1f} switches;"
        f"  raw engine {cpu['raw']:.2f} ms CPU, {sw['raw']:.1f} switches"
    )
    r = rep["read_gib_s"]
    fio = f"  fio {r['fio']:.3f}" if "fio" in r else ""
    fio += f"  fio on huge pages {r['fio_hugemem']:.3f}" if "fio_hugemem" in r else ""
    print(
        f"read  GiB/s: L2 store {r['store']:.3f}  raw engine {r['raw']:.3f}{fio}  "
        f"ratio vs raw {rep['read_ratio_store_vs_raw']:.3f}"
    )
    if rep["read_ratio_store_vs_fio_hugemem"] is not None:
        print(f"read ratio vs fio on huge pages {rep['read_ratio_store_vs_fio_hugemem']:.3f}")
    elif rep["read_ratio_store_vs_fio"] is not None:
        note = rep["fio_hugemem_note"]
        print(f"read ratio vs fio on 4 KiB pages {rep['read_ratio_store_vs_fio']:.3f} ({note})")
    print(f"write then read, store vs raw engine: {rep['write_read_ratio_store_vs_raw']:.3f}")
    print(
        f"open+close per chunk: {rep['open_close_us_per_chunk']:.1f} us vs "
        f"{rep['chunk_read_us']:.0f} us to read a chunk "
        f"({100 * rep['open_close_share']:.2f}%)"
    )
