"""`bsr-io bench ttft`: time from the restore request to a committed prefix, cold cache.

One run writes a long prefix of a KV layout through the L2 tier once, then, with
the page cache dropped before each measurement:

- naive: the whole-plan path as LMCache 0.5.6's local disk backend runs it: an L1
  buffer for every hit chunk from a resident pool, one buffered Python `readinto` per
  chunk file on 4 reader threads (its `disk_io_threads`), then the install of every
  staged chunk;
- fast: BSR through the engine (O_DIRECT, W staging slots, reads overlapped with the
  install, checksums verified), into the same destination;
- fio: fio (io_uring, O_DIRECT) reading the same number of bytes from a file on the
  same device.

The speedup is naive over fast; fast over fio says how close the fast path is to
the drive.
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import numpy as np
import torch

from bsr_io._core import Engine, Slot
from bsr_io.cli.demo import _mem_available, pick_base_dir
from bsr_io.cli.report import write_json
from bsr_io.cli.sizes import fmt_size
from bsr_io.engine import as_numpy
from bsr_io.fio import drop_caches, fio_available, fio_read
from bsr_io.keys import chunk_keys
from bsr_io.kvcache import PagedKVCache
from bsr_io.layout import PRESETS, KVLayout, preset
from bsr_io.metrics import RestoreMetrics
from bsr_io.progress import bar
from bsr_io.record import HEADER_BYTES
from bsr_io.restore import Restorer
from bsr_io.store import Store, synthetic_tokens
from bsr_io.tiers import SSDTier

GiB = 1 << 30
METHODS = ("naive", "fast", "fio")
MODEL = "bsr-io-bench-ttft"
DONE_RATIO = 1.15  # the target: fast_s within this factor of fio_s


def register(bench_subparsers: Any) -> None:
    p = bench_subparsers.add_parser(
        "ttft",
        help="restore latency: naive whole-plan vs BSR vs fio, cold cache",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--tokens", type=int, default=131072, help="prefix length (default 131072)")
    p.add_argument("--layout", default="deepseek-v4-flash", choices=sorted(PRESETS))
    p.add_argument("--window", type=int, default=32, help="W: BSR staging slots")
    p.add_argument("--dir", type=Path, default=None, help="where to put the store (on disk)")
    p.add_argument("--rounds", type=int, default=3, help="rounds of all three (median kept)")
    p.add_argument("--json", type=Path, default=None, help="write the results here")
    p.add_argument("--plot", type=Path, default=None, help="bar chart of the three times (PNG)")
    p.add_argument(
        "--naive-threads",
        type=int,
        default=4,
        help="reader threads of the naive path (LMCache's disk_io_threads, default 4)",
    )
    p.add_argument(
        "--skip-naive",
        action="store_true",
        help="measure only the fast path and fio (for a state whose whole-plan "
        "staging does not fit in memory, e.g. --tokens 524288)",
    )
    p.add_argument("--backend", default=None, help="engine backend (default: auto)")
    p.add_argument("--keep", action="store_true", help="keep the store afterwards")
    p.add_argument("--quiet", action="store_true", help="no progress bars")
    p.set_defaults(func=run)


# -- the state -------------------------------------------------------------------------
def _random_fill(slot: Slot, n: int, seed: int, index: int) -> None:
    """Deterministic random bytes for chunk `index` (64 random bits at a time)."""
    rng = np.random.default_rng([seed, index, 0x77F7])
    arr = as_numpy(slot, count=n)
    words = n // 8
    arr[: words * 8].view(np.uint64)[:] = rng.bit_generator.random_raw(words)
    arr[words * 8 :] = rng.integers(0, 256, n - words * 8, dtype=np.uint8)


def expected_chunk(lay: KVLayout, seed: int, index: int) -> bytes:
    rng = np.random.default_rng([seed, index, 0x77F7])
    n = lay.chunk_bytes
    words = n // 8
    head = rng.bit_generator.random_raw(words).view(np.uint8).tobytes()
    return head + rng.integers(0, 256, n - words * 8, dtype=np.uint8).tobytes()


def write_state(l2: SSDTier, engine: Engine, lay: KVLayout, keys, seed: int, quiet: bool) -> float:
    """Every chunk through the L2 tier (O_DIRECT, durable); a few writers at a time."""
    n = lay.chunk_bytes

    def one(i: int) -> None:
        slot = engine.lease()
        _random_fill(slot, n, seed, i)
        slot.set_length(n)
        l2.write(keys[i], slot, lay)

    t0 = time.perf_counter()
    workers = min(4, engine.window)
    with bar(len(keys) * n, "write state to L2", quiet=quiet) as b:
        with ThreadPoolExecutor(max_workers=workers, thread_name_prefix="bsr-fill") as pool:
            for _ in pool.map(one, range(len(keys))):
                b.update(n)
    return time.perf_counter() - t0


def write_fio_file(path: Path, size: int, engine: Engine, quiet: bool) -> None:
    """`size` random bytes with O_DIRECT through the engine, for fio to read back."""
    f = engine.open(path, create=True)
    pending = []
    step = engine.slot_bytes
    with bar(size, "write fio reference file", quiet=quiet) as b:
        for i, off in enumerate(range(0, size, step)):
            if len(pending) >= engine.window // 2:
                pending.pop(0).wait()
            n = min(step, size - off)
            slot = engine.lease()
            _random_fill(slot, n, 0xF10, i)
            slot.set_length(n)
            pending.append(engine.submit_write(slot, f, off, n))
            del slot
            b.update(n)
        for p in pending:
            p.wait()
    f.sync()
    f.close()


# -- the naive path --------------------------------------------------------------------
def buffered_read(path: str | os.PathLike[str], out: torch.Tensor) -> None:
    """One buffered Python read of a chunk record's payload into the L1 buffer `out`."""
    with open(path, "rb") as f:
        f.seek(HEADER_BYTES)
        got = f.readinto(out.numpy())
    if got != out.numel():
        raise OSError(f"short read of {path}: {got} of {out.numel()} bytes")


class NaiveRestorer:
    """The whole-plan path as LMCache 0.5.6 runs it from local disk.

    `LocalDiskBackend.batched_get_blocking` takes an L1 buffer for every hit chunk from
    the pre-allocated CPU pool, then reads each chunk file with one buffered `readinto`
    on a pool of `disk_io_threads` threads (default 4); only when the whole hit is staged
    is it installed. The L1 pool here is allocated and faulted in up front, as LMCache's
    is, so the restore does not pay first-touch page faults. No checksum is computed
    (LMCache computes none)."""

    def __init__(self, tier: SSDTier, lay: KVLayout, l1_bytes: int, threads: int = 4) -> None:
        if threads < 1:
            raise ValueError(f"naive reader threads must be at least 1, got {threads}")
        self.tier, self.lay, self.threads = tier, lay, threads
        self.pool = torch.ones(l1_bytes, dtype=torch.uint8)  # resident, like a pinned pool
        self.l1_peak_bytes = 0

    def restore(self, plan, dest: PagedKVCache) -> dict[str, Any]:
        n, cb = plan.hit_chunks, self.lay.chunk_bytes
        if n * cb > self.pool.numel():
            raise RuntimeError(
                f"whole-plan needs {n * cb} bytes of L1, the pool has {self.pool.numel()}"
            )
        t0 = time.perf_counter()
        bufs = [self.pool[i * cb : (i + 1) * cb] for i in range(n)]
        paths = [self.tier.path_of(k) for k in plan.keys[:n]]
        with ThreadPoolExecutor(self.threads, thread_name_prefix="naive-read") as pool:
            list(pool.map(buffered_read, paths, bufs))
        t1 = time.perf_counter()
        for i, buf in enumerate(bufs):
            dest.install(i, buf)
        dest.synchronize()
        self.l1_peak_bytes = n * cb
        return {"stage_s": t1 - t0, "install_s": time.perf_counter() - t1}


# -- one run ---------------------------------------------------------------------------
class _Bench:
    def __init__(self, args: argparse.Namespace, root: Path, lay: KVLayout) -> None:
        self.args, self.root, self.lay = args, root, lay
        self.chunks = args.tokens // lay.chunk_tokens
        self.tokens = self.chunks * lay.chunk_tokens
        self.state = self.chunks * lay.chunk_bytes
        self.seed = 5
        self.token_ids = synthetic_tokens(self.seed, self.tokens)
        self.keys = chunk_keys(self.token_ids, lay, MODEL, 0, 1)
        self.engine = Engine(args.window, lay.chunk_bytes, backend=args.backend)
        self.l2 = SSDTier(root / "l2", None, self.engine, layout=lay)
        self.store = Store([self.l2])
        self.metrics = RestoreMetrics()
        self.fast = Restorer(self.store, lay, window=args.window, engine=self.engine, model=MODEL)
        self.dest: PagedKVCache | None = None
        self.naive_restorer: NaiveRestorer | None = None

    def naive(self) -> dict[str, Any]:
        if self.naive_restorer is None:
            self.naive_restorer = NaiveRestorer(
                self.l2, self.lay, self.state, self.args.naive_threads
            )
        t0 = time.perf_counter()
        plan = self.fast.probe(self.token_ids)
        if plan.hit_chunks != self.chunks:
            raise RuntimeError(f"probe found {plan.hit_chunks} of {self.chunks} chunks")
        parts = self.naive_restorer.restore(plan, self.dest)
        seconds = time.perf_counter() - t0
        return {"seconds": seconds, "rws_bytes": self.naive_restorer.l1_peak_bytes, **parts}

    def fast_path(self) -> dict[str, Any]:
        t0 = time.perf_counter()
        plan = self.fast.probe(self.token_ids)
        res = self.fast.restore(plan, self.dest)
        seconds = time.perf_counter() - t0
        self.metrics.observe(res)
        if not res.complete:
            raise RuntimeError(f"fast restore failed: {res.reason}")
        return {
            "seconds": seconds,
            "rws_bytes": res.rws_peak_bytes,
            "read_wait_s": res.timings["read_wait_s"],
            "install_copy_s": res.timings["install_copy_s"],
            "commit_s": res.timings["commit_s"],
        }

    def check(self) -> bool:
        """The first and last chunk in the destination are the bytes that were written."""
        return all(
            self.dest.chunk_bytes(i) == expected_chunk(self.lay, self.seed, i)
            for i in {0, self.chunks - 1}
        )


def _fio_block(size: int) -> int:
    """fio's request size: 1 MiB like the engine's, smaller only for a tiny state."""
    block = 1 << 20
    while block > 4096 and block > size:
        block //= 2
    return block


def _check_room(base: Path, lay: KVLayout, chunks: int, window: int, naive: bool) -> None:
    state = chunks * lay.chunk_bytes
    disk = chunks * (lay.chunk_bytes + HEADER_BYTES) + state + (256 << 20)
    free = shutil.disk_usage(base).free
    if free < disk:
        raise ValueError(
            f"not enough free space in {base} for {chunks * lay.chunk_tokens} tokens of "
            f"{lay.name}: the records take {fmt_size(state)} and fio's reference file as much "
            f"again, {fmt_size(disk)} in all, and {fmt_size(free)} is free; use --dir on a "
            f"larger disk or fewer --tokens"
        )
    # The destination and BSR's slots, plus the naive path's L1 pool of the whole state.
    mem = (2 if naive else 1) * state + window * lay.chunk_bytes
    avail = _mem_available()
    if avail is not None and avail < mem:
        what = (
            f"the naive path stages the whole state ({fmt_size(state)}) in L1 next to the "
            f"destination, {fmt_size(mem)} in all"
            if naive
            else f"the destination KV cache alone is {fmt_size(state)}"
        )
        hint = (
            "fewer --tokens, or --skip-naive to measure only BSR and fio"
            if naive
            else ("fewer --tokens")
        )
        raise ValueError(
            f"not enough memory for {chunks * lay.chunk_tokens} tokens of {lay.name}: {what}, "
            f"and {fmt_size(avail)} is available; use {hint}"
        )


def run(args: argparse.Namespace) -> int:
    lay = preset(args.layout)
    if args.tokens < lay.chunk_tokens:
        raise ValueError(
            f"--tokens {args.tokens} is less than one chunk ({lay.chunk_tokens} tokens)"
        )
    if args.window < 1:
        raise ValueError(f"--window must be at least 1, got {args.window}")
    if args.rounds < 1:
        raise ValueError(f"--rounds must be at least 1, got {args.rounds}")
    if args.naive_threads < 1:
        raise ValueError(f"--naive-threads must be at least 1, got {args.naive_threads}")
    have_fio = fio_available()
    if not have_fio:
        raise ValueError("fio is not installed (Debian/Ubuntu: apt-get install fio); it is the "
                         "reference this benchmark reports against")  # fmt: skip
    base = pick_base_dir(args.dir)
    chunks = args.tokens // lay.chunk_tokens
    _check_room(base, lay, chunks, args.window, naive=not args.skip_naive)
    root = Path(tempfile.mkdtemp(prefix="bsr-io-ttft-", dir=base))
    try:
        doc = measure(args, root, lay)
    finally:
        if not args.keep:
            shutil.rmtree(root, ignore_errors=True)
    print_table(doc)
    write_json(args.json, doc)
    if args.plot:
        from bsr_io.plots import plot_ttft

        plot_ttft(doc, args.plot)
        print(f"wrote {args.plot}")
    return 0


def _one(b: _Bench, method: str, fio_path: Path) -> dict[str, Any]:
    if method == "naive":
        return b.naive()
    if method == "fast":
        return b.fast_path()
    res = fio_read(fio_path, size=b.state, block_bytes=_fio_block(b.state))
    # The time fio's rate needs for the state's bytes (fio reads whole blocks only).
    return {"seconds": b.state / (res.gib_s * GiB), "gib_s": res.gib_s,
            "bytes_read": res.bytes_read}  # fmt: skip


def measure(args: argparse.Namespace, root: Path, lay: KVLayout) -> dict[str, Any]:
    b = _Bench(args, root, lay)
    q = args.quiet
    write_s = write_state(b.l2, b.engine, lay, b.keys, b.seed, q)
    fio_path = root / "fio-reference.bin"
    write_fio_file(fio_path, b.state, b.engine, q)
    b.dest = PagedKVCache.allocate(lay, b.tokens)
    for t in b.dest.tensors:
        t.zero_()  # fault the destination in once: a serving engine's KV pool is resident
    methods = tuple(m for m in METHODS if m != "naive" or not args.skip_naive)
    if "naive" in methods:
        b.naive_restorer = NaiveRestorer(b.l2, lay, b.state, args.naive_threads)
    rounds: dict[str, list[dict[str, Any]]] = {m: [] for m in methods}
    cold = True
    ok = True
    for r in range(args.rounds):
        # fast and fio always run back to back (the drive's speed drifts over tens of
        # seconds on shared or virtual disks); which goes first alternates.
        order = list(methods if r % 2 == 0 else methods[::-1])
        for method in order:
            for t in b.dest.tensors:
                t.zero_()  # so the check below sees this run's bytes, not an earlier run's
            cold &= drop_caches()
            with bar(None, f"round {r + 1}/{args.rounds}: {method}", quiet=q, unit="it"):
                rounds[method].append(_one(b, method, fio_path))
            if method != "fio":
                ok &= b.check()
    med = {m: statistics.median(x["seconds"] for x in v) for m, v in rounds.items()}
    # Where the fast path's time went, in its median round (parts of one run add up).
    mid = min(rounds["fast"], key=lambda x: abs(x["seconds"] - med["fast"]))
    profile = {k: mid[k] for k in ("read_wait_s", "install_copy_s", "commit_s")}
    profile["other_s"] = mid["seconds"] - sum(profile.values())
    naive = "naive" in med
    nmid = min(rounds["naive"], key=lambda x: abs(x["seconds"] - med["naive"])) if naive else {}
    doc = {
        "layout": lay.name,
        "tokens": b.tokens,
        "chunks": b.chunks,
        "chunk_bytes": lay.chunk_bytes,
        "state_bytes": b.state,
        "window": args.window,
        "backend": b.engine.backend,
        "cold_cache": cold,
        "rounds": args.rounds,
        "naive_s": med.get("naive"),
        "naive_measured": naive,
        "fast_s": med["fast"],
        "fio_s": med["fio"],
        "speedup": med["naive"] / med["fast"] if naive else None,
        "fast_vs_fio": med["fast"] / med["fio"],
        "fast_within_target": med["fast"] <= DONE_RATIO * med["fio"],
        # The same ratio taken within each round (fast and fio adjacent), then the median.
        "fast_vs_fio_paired": statistics.median(
            f["seconds"] / g["seconds"] for f, g in zip(rounds["fast"], rounds["fio"], strict=True)
        ),
        "target_fast_vs_fio": DONE_RATIO,
        "gib_s": {m: b.state / med[m] / GiB if m in med else None for m in METHODS},
        # Unmeasured, the naive path's staging is still the whole state: it needs that L1.
        "rws_naive_bytes": max(x["rws_bytes"] for x in rounds["naive"]) if naive else b.state,
        "rws_fast_bytes": max(x["rws_bytes"] for x in rounds["fast"]),
        "data_ok": ok,
        "write_s": write_s,
        "naive_threads": args.naive_threads,
        "fast_profile_s": profile,
        "naive_profile_s": {k: nmid[k] for k in ("stage_s", "install_s")} if naive else None,
        "per_round": rounds,
        "metrics": b.metrics.snapshot(),
        "dir": os.fspath(root),
    }
    b.engine.close()
    return doc


def print_table(doc: dict[str, Any]) -> None:
    print(
        f"\nbench ttft: {doc['tokens']:,} tokens of {doc['layout']} = "
        f"{fmt_size(doc['state_bytes'])} ({doc['chunks']} chunks), W={doc['window']}, "
        f"engine {doc['backend']}, cold cache "
        f"{'yes' if doc['cold_cache'] else 'NO (not root)'}, median of {doc['rounds']}"
    )
    hdr = f"{'path':<8} {'seconds':>8} {'GiB/s':>7} {'staging peak':>13}"
    print(hdr)
    print("-" * len(hdr))
    peaks = {"naive": doc["rws_naive_bytes"], "fast": doc["rws_fast_bytes"], "fio": None}
    for m in METHODS:
        peak = "-" if peaks[m] is None else fmt_size(peaks[m])
        if doc[m + "_s"] is None:
            print(f"{m:<8} {'skipped':>8} {'-':>7} {'needs ' + peak:>13}")
            continue
        print(f"{m:<8} {doc[m + '_s']:>8.2f} {doc['gib_s'][m]:>7.2f} {peak:>13}")
    p = doc["fast_profile_s"]
    met = "met" if doc["fast_within_target"] else "NOT met"
    speedup = "not measured" if doc["speedup"] is None else f"{doc['speedup']:.2f}x"
    print(
        f"speedup naive/fast {speedup}; fast/fio {doc['fast_vs_fio']:.3f} "
        f"(target <= {doc['target_fast_vs_fio']}: {met}); within each round: median "
        f"{doc['fast_vs_fio_paired']:.3f}"
    )
    naive = doc["naive_profile_s"]
    print(
        f"fast path: {p['read_wait_s']:.2f} s waiting for reads, {p['install_copy_s']:.2f} s "
        f"installing, {p['commit_s']:.3f} s committing, {p['other_s']:.2f} s submitting and "
        "probing"
        + (
            f"; naive: {naive['stage_s']:.2f} s staging, {naive['install_s']:.2f} s installing"
            if naive
            else ""
        )
    )
    print(f"bytes checked (first and last chunk): {'ok' if doc['data_ok'] else 'MISMATCH'}")
    if not doc["cold_cache"]:
        print("note: the page cache could not be dropped (needs root); buffered reads may be warm",
              file=sys.stderr)  # fmt: skip
