"""`bsr-lab bench stripe`: a restore from L2 striped over several drives against fio
reading the same record files on all of them at once.

The state is written through `StripedSSDTier` (one directory per drive, chunks placed
by key). Each round, in a fresh random order, with the page cache dropped before each:

- restore: BSR restoring the state through W slots into a host KV cache (verified,
  installed, committed), its reads spread over every drive by placement;
- fio_hugemem (fio where huge pages cannot be had): fio reading every record's payload
  range on every directory at the same time, one set of jobs per directory, each at
  the engine's queue depth: every drive busy, the drives' limit together.

`ratio` = restore / fio, the median over rounds (each round's ratio kept). With no
`--dirs`, the two directories are a scratch directory on disk and one in memory
(tmpfs, which accepts O_DIRECT): two devices of very different speed, which the JSON
says; on a server, pass one directory per NVMe drive.
"""

from __future__ import annotations

import argparse
import os
import random
import shutil
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

from bsr_io._core import Engine
from bsr_io.cli.fio import HugeMem, drop_caches, fio_available, fio_read_payloads, huge_page_buffers
from bsr_io.cli.host import mem_available
from bsr_io.cli.report import write_json
from bsr_io.cli.scratch import fs_type, scratch_base
from bsr_io.cli.synthetic import synthetic_tokens
from bsr_io.model.keys import chunk_keys
from bsr_io.model.layout import PRESETS, preset
from bsr_io.model.record import HEADER_BYTES
from bsr_io.model.sizes import GiB, fmt_size, parse_size
from bsr_io.restore import Restorer
from bsr_io.store import Store
from bsr_io.tiers import StripedSSDTier
from bsr_lab.bench.ceiling import _destination
from bsr_lab.bench_state import write_state
from bsr_lab.machine_load import snapshot, summary

MODEL = "bsr-io-bench-stripe"
FIO_DEPTH = 32


def register(bench_subparsers: Any) -> None:
    p = bench_subparsers.add_parser(
        "stripe",
        help="restore from L2 striped over several drives vs fio on all of them at once",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument(
        "--dirs",
        type=Path,
        nargs="+",
        default=None,
        help="one directory per drive (default: one on disk, one in tmpfs)",
    )
    p.add_argument(
        "--layout",
        default="deepseek-v4-flash",
        choices=sorted(PRESETS),
        help="KV layout; its chunk must be whole 4 KiB blocks (fio's unit), so not tiny",
    )
    p.add_argument("--tokens", type=int, default=32768, help="prefix length (default 32768)")
    p.add_argument("--window", type=int, default=32, help="W: staging slots")
    p.add_argument("--queue-depth", type=int, default=32, help="engine queue depth")
    p.add_argument("--rounds", type=int, default=3, help="rounds (median is reported)")
    p.add_argument(
        "--dest-cap",
        type=parse_size,
        default=parse_size("2GiB"),
        help="host KV cache size; a larger state cycles through its blocks",
    )
    p.add_argument(
        "--install-threads",
        type=int,
        default=1,
        help="fused installs of several chunks at once (default 1)",
    )
    p.add_argument("--seed", type=int, default=None, help="seed of the per-round order")
    p.add_argument("--backend", default=None, help="engine backend (default: auto)")
    p.add_argument("--json", type=Path, default=None, help="write the results here")
    p.add_argument("--quiet", action="store_true", help="no progress bars")
    p.set_defaults(func=run)


def _device(path: Path) -> dict[str, Any]:
    st = os.stat(path)
    return {"fs": fs_type(path), "dev": f"{os.major(st.st_dev)}:{os.minor(st.st_dev)}"}


def whole_block_layouts() -> list[str]:
    """The layouts whose chunk is whole 4 KiB blocks, the unit fio's O_DIRECT reads take."""
    return [n for n in sorted(PRESETS) if preset(n).chunk_bytes % 4096 == 0]


def run(args: argparse.Namespace) -> int:
    lay = preset(args.layout)
    if lay.chunk_bytes % 4096:
        raise ValueError(
            f"--layout {lay.name}: its {lay.chunk_bytes}-byte chunk is not a whole number of "
            "4 KiB blocks, which the fio reference reads in; --layout must be one of "
            + ", ".join(whole_block_layouts())
        )
    if not fio_available():
        raise ValueError(
            "fio is not installed (Debian/Ubuntu: apt-get install fio); it is the "
            "reference this benchmark reports against"
        )
    if args.tokens < lay.chunk_tokens or args.window < 1 or args.rounds < 1:
        raise ValueError(
            f"--tokens must hold a chunk (>= {lay.chunk_tokens} for {lay.name}); "
            "--window and --rounds must be >= 1"
        )
    bases = args.dirs or [scratch_base(None), scratch_base(None, memory=True)]
    chunks = args.tokens // lay.chunk_tokens
    need = chunks * (lay.chunk_bytes + HEADER_BYTES)
    avail = mem_available()
    ram = min(chunks * lay.chunk_bytes, args.dest_cap) + args.window * lay.chunk_bytes
    if avail is not None and ram + need // len(bases) > avail:
        raise ValueError(
            f"{fmt_size(ram)} of KV cache and slots (and a tmpfs share of "
            f"{fmt_size(need // len(bases))}) exceed the {fmt_size(avail)} "
            "available: pass fewer --tokens"
        )
    roots: list[Path] = []
    try:
        for b in bases:
            b.mkdir(parents=True, exist_ok=True)
            roots.append(Path(tempfile.mkdtemp(prefix="bsr-io-stripe-", dir=b)))
        with huge_page_buffers(len(roots) * FIO_DEPTH << 20) as huge:
            doc = measure(args, roots, huge)
    finally:
        for r in roots:
            shutil.rmtree(r, ignore_errors=True)
    doc["drives"] = [{**_device(b), "default": args.dirs is None} for b in bases]
    print_table(doc)
    write_json(args.json, doc)
    return 0 if doc["outcome"] == "complete" else 1


def measure(args: argparse.Namespace, roots: list[Path], huge: HugeMem) -> dict[str, Any]:
    lay = preset(args.layout)
    chunks = args.tokens // lay.chunk_tokens
    tokens = chunks * lay.chunk_tokens
    state = chunks * lay.chunk_bytes
    token_ids = synthetic_tokens(11, tokens)
    keys = chunk_keys(token_ids, lay, MODEL, 0, 1)
    eng = Engine(args.window, lay.chunk_bytes, queue_depth=args.queue_depth, backend=args.backend)
    l2 = StripedSSDTier(roots, None, eng, layout=lay)
    write_state(l2, eng, lay, keys, 11, args.quiet)
    per_drive = [sum(l2.drive_of(k) == d for k in keys) for d in range(len(roots))]
    ns_dirs = [l2.drives_dir(d, keys[0]) for d in range(len(roots))]
    restorer = Restorer(
        Store([l2]),
        lay,
        window=args.window,
        engine=eng,
        model=MODEL,
        install_threads=args.install_threads,
    )
    dest = _destination(lay, tokens, args.dest_cap)
    for t in dest.tensors:
        t.zero_()  # fault the cache in once: a serving engine's KV pool is resident
    fio_name = "fio_hugemem" if huge.mount is not None else "fio"
    methods = ("restore", fio_name)
    seed = args.seed if args.seed is not None else random.SystemRandom().randrange(1 << 32)
    rng = random.Random(seed)
    rounds: dict[str, list[float]] = {m: [] for m in methods}
    profile: list[dict[str, float]] = []  # where each restore's time went
    orders: list[list[str]] = []
    loads = [snapshot()]
    outcomes, rws, cold = set(), 0, True
    used = [i for i, n in enumerate(per_drive) if n]
    for _ in range(args.rounds):
        order = list(methods)
        rng.shuffle(order)
        orders.append(order)
        for method in order:
            cold &= drop_caches()
            if method == "restore":
                plan = restorer.probe(token_ids)
                t0 = time.perf_counter()
                res = restorer.restore(plan, dest)
                secs = time.perf_counter() - t0
                outcomes.add(res.outcome)
                rws = max(rws, res.rws_peak_bytes)
                if not res.complete:
                    raise RuntimeError(f"striped restore did not complete: {res.reason}")
                profile.append(
                    {k: res.timings[k] for k in ("read_wait_s", "install_copy_s")}
                    | {"seconds": secs}
                )
            else:
                fio = fio_read_payloads(
                    [ns_dirs[i] for i in used],
                    payload_offset=HEADER_BYTES,
                    payload_bytes=lay.chunk_bytes,
                    files=[per_drive[i] for i in used],
                    iodepth=FIO_DEPTH,
                    hugemem=huge if huge.mount else None,
                )
                secs = fio.seconds
            rounds[method].append(state / secs / GiB)
        loads.append(snapshot())
    backend = eng.backend
    eng.close()
    med = {m: statistics.median(v) for m, v in rounds.items()}
    per_round = [r / f for r, f in zip(rounds["restore"], rounds[fio_name], strict=True)]
    return {
        "layout": lay.name,
        "tokens": tokens,
        "chunks": chunks,
        "chunk_bytes": lay.chunk_bytes,
        "state_bytes": state,
        "window": args.window,
        "queue_depth": args.queue_depth,
        "backend": backend,
        "rounds": args.rounds,
        "cold_cache": cold,
        "chunks_per_drive": per_drive,
        "reference": fio_name,
        "fio_hugemem_note": huge.note,
        "restore_gib_s": med["restore"],
        "fio_gib_s": med[fio_name],
        "ratio": med["restore"] / med[fio_name],
        "ratio_rounds": per_round,
        "ratio_median_of_rounds": statistics.median(per_round),
        "rounds_gib_s": rounds,
        # Waiting for reads vs installing (copy + hash): which one bounds the restore.
        "restore_profile_s": profile,
        "restore_read_wait_share": statistics.median(
            p["read_wait_s"] / p["seconds"] for p in profile
        ),
        "restore_install_share": statistics.median(
            p["install_copy_s"] / p["seconds"] for p in profile
        ),
        "install_threads": args.install_threads,
        "rws_peak_bytes": rws,
        "rws_bound_bytes": args.window * lay.chunk_bytes,
        "outcome": outcomes.pop() if len(outcomes) == 1 else "mixed",
        "seed": seed,
        "orders": orders,
        "load": summary(loads),
        "load_snapshots": loads,
    }


def print_table(doc: dict[str, Any]) -> None:
    drives = ", ".join(f"{d['fs']} ({d['dev']})" for d in doc["drives"])
    print(
        f"\nbench stripe: {doc['tokens']:,} tokens of {doc['layout']} = "
        f"{fmt_size(doc['state_bytes'])} over {len(doc['drives'])} directories on {drives}, "
        f"chunks per drive {doc['chunks_per_drive']}, W={doc['window']}, median of "
        f"{doc['rounds']}"
    )
    rr = " ".join(f"{x:.2f}" for x in doc["rounds_gib_s"]["restore"])
    fr = " ".join(f"{x:.2f}" for x in doc["rounds_gib_s"][doc["reference"]])
    print(f"striped restore {doc['restore_gib_s']:.2f} GiB/s   rounds {rr}")
    print(f"{doc['reference']:<15} {doc['fio_gib_s']:.2f} GiB/s   rounds {fr}")
    per = " ".join(f"{x:.2f}" for x in doc["ratio_rounds"])
    print(
        f"restore time: {doc['restore_read_wait_share']:.0%} waiting for reads, "
        f"{doc['restore_install_share']:.0%} installing (copy + hash), medians over rounds"
    )
    load = doc["load"]
    print(
        f"ratio restore/{doc['reference']} {doc['ratio']:.3f} (per round {per}); RWS peak "
        f"{fmt_size(doc['rws_peak_bytes'])}; outcome {doc['outcome']}; load "
        f"{load['loadavg_1m_min']:.2f}-{load['loadavg_1m_max']:.2f}, others up to "
        f"{load['others_cores_max']:.2f} cores"
    )
