"""`bsr-io demo`: what bsr-io does, in one command and about a minute.

Two ranks (two real processes, one gloo group) each save a long prefix of the
`deepseek-v4-flash` layout to a store in a temporary directory, then restore it
three ways: BSR through W staging slots, the whole-plan baseline at BSR's staging
budget (it fails cleanly and says how much L1 it needed) and the whole-plan
baseline with L1 as large as the state. A half-size restore shows that BSR's
staging peak does not grow with the state. Then a fault round: one rank cannot
read one chunk, and the outcome is zero reuse on both ranks; with a copy in the
lower tier (L3) the chunk is served from there and the outcome is complete.
Every number printed is measured in the run.
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path
from typing import Any

import numpy as np
import torch

from bsr_io._core import Engine, xxh3_64
from bsr_io.cli.progress import ProgressWatcher, RankProgress
from bsr_io.cli.report import write_json
from bsr_io.commit import Agreement
from bsr_io.kvcache import PagedKVCache
from bsr_io.layout import PRESETS, KVLayout, preset
from bsr_io.metrics import RestoreMetrics
from bsr_io.record import HEADER_BYTES
from bsr_io.restore import Restorer
from bsr_io.sizes import GiB, fmt_size, parse_size
from bsr_io.store import Store
from bsr_io.testing.faults import Fault, FaultPlan
from bsr_io.testing.synthetic import synthetic_tokens
from bsr_io.tiers import LowerTier, SSDTier
from bsr_io.whole_plan import WholePlanRestorer

RANKS = 2
TARGET = "bsr_io.cli.demo:demo_rank"
MEMORY_FS = {"tmpfs", "ramfs", "devtmpfs", "hugetlbfs", "squashfs", "overlay"}


def register(subparsers: Any) -> None:
    p = subparsers.add_parser(
        "demo",
        help="save and restore a long prefix on two ranks: BSR vs whole-plan, faults",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument(
        "--dir",
        type=Path,
        default=None,
        help="where to put the temporary store (default: a local-disk temp dir)",
    )
    p.add_argument(
        "--state",
        type=parse_size,
        default=parse_size("1GiB"),
        help="KV state per rank (whole chunks are kept; default 1GiB)",
    )
    p.add_argument("--window", type=int, default=32, help="W: staging slots per rank")
    p.add_argument(
        "--layout", default="deepseek-v4-flash", choices=sorted(PRESETS), help="KV layout preset"
    )
    p.add_argument("--quiet", action="store_true", help="no progress bars")
    p.add_argument("--json", type=Path, default=None, help="also write every figure here")
    p.add_argument("--keep", action="store_true", help="keep the store directory afterwards")
    p.add_argument("--seed", type=int, default=1, help="seed of the token ids and KV bytes")
    p.set_defaults(func=run)  # fmt: skip


# -- on each rank ----------------------------------------------------------------------
class _Counting:
    """A destination that reports each installed chunk to the progress file."""

    def __init__(self, inner: PagedKVCache, progress: RankProgress, chunk_bytes: int) -> None:
        self.inner, self.progress, self.chunk_bytes = inner, progress, chunk_bytes
        self.capacity_chunks = inner.capacity_chunks

    def install(self, chunk_index: int, payload: torch.Tensor):
        fence = self.inner.install(chunk_index, payload)
        self.progress.advance(self.chunk_bytes)
        return fence

    def extract(self, chunk_index: int, out: torch.Tensor) -> None:
        self.inner.extract(chunk_index, out)

    def synchronize(self) -> None:
        self.inner.synchronize()


def _fill_random(cache: PagedKVCache, seed: int, rank: int, progress: RankProgress) -> None:
    """Random KV bytes (the demo's stand-in for a prefill), 16 MiB at a time."""
    rng = np.random.default_rng([seed, rank, 0xDE])
    step = 16 << 20
    for t in cache.tensors:
        flat = t.view(-1).view(torch.uint8).numpy()
        for off in range(0, flat.size, step):
            n = min(step, flat.size - off)
            words = n // 8  # 64 random bits at a time is several times faster than bytes
            flat[off : off + words * 8].view(np.uint64)[:] = rng.bit_generator.random_raw(words)
            flat[off + words * 8 : off + n] = rng.integers(0, 256, n - words * 8, dtype=np.uint8)
            progress.advance(n)


def _chunk_sums(cache: PagedKVCache, chunks: int) -> list[tuple[int, ...]]:
    """xxh3 of each chunk's blocks, per group, read in place. `PagedKVCache.allocate` gives
    a request consecutive blocks, so a chunk is one contiguous slice of each group tensor."""
    lay = cache.layout
    out = []
    for i in range(chunks):
        sums = []
        for g, t in zip(lay.groups, cache.tensors, strict=True):
            per = lay.chunk_tokens // g.block_tokens
            sums.append(xxh3_64(t[i * per : (i + 1) * per].reshape(-1).view(torch.uint8).numpy()))
        out.append(tuple(sums))
    return out


def _barrier(world_size: int) -> None:
    if world_size > 1:
        import torch.distributed as dist

        dist.barrier()


def demo_rank(
    rank: int,
    world_size: int,
    *,
    root: str,
    layout: str,
    chunks: int,
    window: int,
    seed: int,
    fault_chunk: int,
    fault_rank: int,
    progress_dir: str | None = None,
    model: str = "bsr-io-demo",
    timeout_s: float = 60.0,
) -> dict[str, Any]:
    """One rank of the demo (run by `bsr_io.testing.ranks.launch`); returns its figures."""
    lay = preset(layout)
    cb = lay.chunk_bytes
    tokens = chunks * lay.chunk_tokens
    half_chunks = chunks // 2
    state = chunks * cb
    prog = RankProgress(progress_dir, rank)
    base = Path(root)
    engine = Engine(window, cb)
    l2 = SSDTier(base / "l2", None, engine, layout=lay)
    l3 = LowerTier(base / "l3", layout=lay)
    l3_empty = LowerTier(base / "l3-empty", layout=lay)
    agreement = (
        Agreement.from_process_group(timeout_s=timeout_s) if world_size > 1 else Agreement.local()
    )
    token_ids = synthetic_tokens(seed, tokens)
    metrics = RestoreMetrics()  # what a serving engine would export, for every BSR restore

    def restorer(store: Store) -> Restorer:
        # One Agreement for every request, so the ranks' request numbers stay in step.
        return Restorer(store, lay, window=window, engine=engine, model=model,
                        agreement=agreement)  # fmt: skip

    out: dict[str, Any] = {
        "rank": rank, "layout": lay.name, "chunk_bytes": cb, "slot_bytes": engine.slot_bytes,
        "chunks": chunks, "tokens": tokens, "state_bytes": state, "backend": engine.backend,
        "window": window, "runs": {},
    }  # fmt: skip

    # The prefix: random KV in a paged cache, saved through the W slots.
    src = PagedKVCache.allocate(lay, tokens, zero=False)
    prog.phase("prefill KV (random bytes)", state)
    _fill_random(src, seed, rank, prog)
    want = _chunk_sums(src, chunks)
    bsr = restorer(Store([l2]))
    prog.phase("save prefix to L2", state)
    _barrier(world_size)
    t0 = time.perf_counter()
    engine.reset_peak()
    written = bsr.save(token_ids, src, progress=lambda n: prog.advance(n * cb))
    out["save_s"] = time.perf_counter() - t0
    out["save_staging_peak_bytes"] = engine.peak_bytes()
    out["saved_chunks"] = written
    del src

    dest = PagedKVCache.allocate(lay, tokens)

    def check(n: int) -> bool:
        return _chunk_sums(dest, n) == want[:n]

    def clear() -> None:
        # So a chunk that was not installed cannot pass the check with an earlier copy.
        for t in dest.tensors:
            t.zero_()

    def bsr_restore(name: str, r: Restorer, n_tokens: int, verify: bool = True) -> dict[str, Any]:
        if verify:
            clear()
        prog.phase(name, (n_tokens // lay.chunk_tokens) * cb)
        _barrier(world_size)
        t0 = time.perf_counter()
        plan = r.probe(token_ids[:n_tokens])
        res = r.restore(plan, _Counting(dest, prog, cb))
        wall = time.perf_counter() - t0
        metrics.observe(res)
        prog.finish()
        return {
            "outcome": res.outcome,
            "committed_tokens": res.committed_tokens,
            "committed_chunks": res.committed_chunks,
            "state_bytes": plan.hit_chunks * cb,
            "rws_peak_bytes": res.rws_peak_bytes,
            "time_to_commit_s": wall,
            "gib_s": plan.hit_chunks * cb / wall / GiB if res.complete else None,
            "reason": res.reason,
            "sources": dict(Counter(res.source_tiers)),
            "fallbacks": res.fallbacks,
            "data_ok": check(res.committed_chunks) if res.complete and verify else None,
        }

    runs = out["runs"]
    runs["bsr"] = bsr_restore("restore: BSR, full state", bsr, tokens)
    # The half-size restore only measures the staging peak (its bytes were just checked).
    runs["bsr_half"] = bsr_restore(
        "restore: BSR, half state", bsr, half_chunks * lay.chunk_tokens, verify=False
    )

    def whole_plan(name: str, l1_bytes: int) -> dict[str, Any]:
        if l1_bytes >= state:
            clear()
        wp = WholePlanRestorer(Store([l2]), lay, l1_bytes=l1_bytes)
        wp.on_chunk = lambda _i: prog.advance(cb)
        wp.prepare(state)  # LMCache's L1 pool is resident before any request
        prog.phase(name, state)
        _barrier(world_size)
        t0 = time.perf_counter()
        plan = bsr.probe(token_ids)
        res = wp.restore(plan, dest)
        wall = time.perf_counter() - t0
        prog.finish()
        return {
            "outcome": res.outcome,
            "l1_bytes": l1_bytes,
            "l1_required_bytes": res.l1_required_bytes,
            "l1_peak_bytes": wp.l1_peak_bytes if res.complete else 0,
            "committed_tokens": res.committed_tokens,
            "time_to_commit_s": wall,
            "gib_s": state / wall / GiB if res.complete else None,
            "reason": res.reason,
            "data_ok": check(res.committed_chunks) if res.complete else None,
        }

    budget = window * engine.slot_bytes  # BSR's staging bound
    runs["whole_plan_same_l1"] = whole_plan("restore: whole-plan, L1 = BSR's window", budget)
    runs["whole_plan_big_l1"] = whole_plan("restore: whole-plan, L1 = state", state)

    # The lower tier gets a copy of the chunk that will fail (as demotion from L2 would
    # leave it), before the first fault round, which restores without it.
    prog.phase("copy the chunk to L3", cb)
    fault_key = bsr.keys(token_ids)[fault_chunk]
    l3.adopt(fault_key, l2.path_of(fault_key))
    prog.finish()

    # Fault round: one rank cannot read one chunk from L2.
    faults = FaultPlan([Fault("error", "L2", chunks=[fault_chunk], ranks=[fault_rank])])
    keys = bsr.keys(token_ids)  # the request whose chunk positions the fault names
    runs["fault_no_l3_copy"] = bsr_restore(
        "fault round: no L3 copy",
        restorer(Store(faults.wrap_all([l2, l3_empty], rank, keys))),
        tokens,
        verify=False,
    )
    runs["fault_l3_copy"] = bsr_restore(
        "fault round: L3 holds a copy",
        restorer(Store(faults.wrap_all([l2, l3], rank, keys))),
        tokens,
    )
    out["l3_records"] = l3.stats()["records"]
    prog.phase("done", 0)
    out["phase_s"] = prog.durations
    out["metrics"] = metrics.snapshot()
    engine.close()
    return out


# -- in the parent -----------------------------------------------------------------------
def _fs_type(path: Path) -> str:
    """Filesystem type of the mount holding `path` (from /proc/mounts; '' if unknown)."""
    path = path.resolve()
    best, kind = "", ""
    try:
        lines = Path("/proc/mounts").read_text().splitlines()
    except OSError:
        return ""
    for line in lines:
        parts = line.split()
        if len(parts) < 3:
            continue
        mnt = parts[1].replace("\\040", " ")
        if (path == Path(mnt) or Path(mnt) in path.parents) and len(mnt) >= len(best):
            best, kind = mnt, parts[2]
    return kind


def pick_base_dir(explicit: Path | None) -> Path:
    """`explicit`, else the first of $TMPDIR, the system temp dir, /var/tmp and the current
    directory that lies on a disk (not in memory: a tmpfs would make the I/O figures
    meaningless and O_DIRECT is refused there)."""
    if explicit is not None:
        explicit.mkdir(parents=True, exist_ok=True)
        kind = _fs_type(explicit)
        if kind in MEMORY_FS:
            raise ValueError(
                f"--dir {explicit} is on {kind}, in memory: choose a directory on disk"
            )
        return explicit
    candidates = [os.environ.get("TMPDIR"), tempfile.gettempdir(), "/var/tmp", os.getcwd()]
    for c in candidates:
        if c and os.path.isdir(c) and os.access(c, os.W_OK) and _fs_type(Path(c)) not in MEMORY_FS:
            return Path(c)
    raise ValueError("no writable directory on disk found for the store; pass --dir")


def _mem_available() -> int | None:
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


def _check_resources(base: Path, lay: KVLayout, chunks: int, window: int) -> None:
    state = chunks * lay.chunk_bytes
    # L2 and an L3 copy on disk for each rank.
    disk = RANKS * 2 * chunks * (lay.chunk_bytes + HEADER_BYTES) + (64 << 20)
    free = shutil.disk_usage(base).free
    if free < disk:
        raise ValueError(
            f"not enough free space in {base}: the demo needs {fmt_size(disk)}, "
            f"{fmt_size(free)} is free; use --dir elsewhere or a smaller --state"
        )
    # Per rank: source, destination, the whole-plan's staging and the W slots.
    mem = RANKS * (3 * state + window * lay.chunk_bytes)
    avail = _mem_available()
    if avail is not None and avail < mem:
        raise ValueError(
            f"not enough memory: the demo needs about {fmt_size(mem)} ({RANKS} ranks x "
            f"(source + destination + whole-plan L1) of {fmt_size(state)}), "
            f"{fmt_size(avail)} is available; use a smaller --state"
        )


def run(args: argparse.Namespace) -> int:
    from bsr_io.testing.ranks import launch

    if args.window < 1:
        raise ValueError(f"--window must be at least 1, got {args.window}")
    lay = preset(args.layout)
    chunks = args.state // lay.chunk_bytes
    if chunks < 2:
        raise ValueError(
            f"--state {fmt_size(args.state)} holds {chunks} chunk(s) of {fmt_size(lay.chunk_bytes)}"
            f" ({lay.name}); the demo needs at least 2"
        )
    base = pick_base_dir(args.dir)
    _check_resources(base, lay, chunks, args.window)
    root = Path(tempfile.mkdtemp(prefix="bsr-io-demo-", dir=base))
    t0 = time.perf_counter()
    try:
        kwargs = {
            "root": str(root), "layout": args.layout, "chunks": chunks, "window": args.window,
            "seed": args.seed, "fault_chunk": chunks // 2, "fault_rank": RANKS - 1,
            "progress_dir": None if args.quiet else str(root / "progress"),
        }  # fmt: skip
        if not args.quiet:
            print(
                f"bsr-io demo: {RANKS} ranks saving and restoring "
                f"{fmt_size(chunks * lay.chunk_bytes)} each under {root} ...",
                file=sys.stderr,
                flush=True,
            )
        with ProgressWatcher(root / "progress", RANKS, quiet=args.quiet):
            results = launch(RANKS, TARGET, kwargs, timeout_s=900, env={"BSR_IO_EXIT_WAIT_S": "20"})
        failed = [r for r in results if "runs" not in r]
        if failed:
            for r in failed:
                print(f"rank {r.get('rank')} failed ({r.get('exit_code')}):\n{r.get('stderr', '')}",
                      file=sys.stderr)  # fmt: skip
            return 1
    finally:
        if not args.keep:
            shutil.rmtree(root, ignore_errors=True)
    doc = summarize(results, time.perf_counter() - t0, root, args.keep)
    print_report(doc)
    write_json(args.json, doc)
    return 0 if doc["checks"]["all_ok"] else 1


def summarize(results: list[dict], wall_s: float, root: Path, kept: bool) -> dict[str, Any]:
    r0 = results[0]
    runs = {name: [r["runs"][name] for r in results] for name in r0["runs"]}
    bsr, half = runs["bsr"], runs["bsr_half"]
    small, big = runs["whole_plan_same_l1"], runs["whole_plan_big_l1"]
    no_copy, copy = runs["fault_no_l3_copy"], runs["fault_l3_copy"]
    fault_rank = len(results) - 1
    checks = {
        "bsr_complete": all(x["outcome"] == "complete" for x in bsr + half)
        and all(x["data_ok"] for x in bsr),
        "rws_same_for_half_state": {x["rws_peak_bytes"] for x in bsr + half}.__len__() == 1,
        "rws_is_window": all(x["rws_peak_bytes"] <= r0["window"] * r0["slot_bytes"] for x in bsr),
        # The baseline at BSR's budget must fail whenever the state exceeds that budget.
        "whole_plan_same_l1_fails": all(
            (x["outcome"] == "zero") == (x["l1_required_bytes"] > x["l1_bytes"]) for x in small
        ),
        "whole_plan_big_l1_complete": all(x["outcome"] == "complete" and x["data_ok"] for x in big),
        "fault_no_copy_zero_everywhere": all(
            x["outcome"] == "zero" and x["committed_tokens"] == 0 for x in no_copy
        ),
        "fault_l3_copy_complete": all(x["outcome"] == "complete" and x["data_ok"] for x in copy),
        "fault_served_from_l3": copy[fault_rank]["sources"].get("L3", 0) >= 1,
    }
    checks["all_ok"] = all(checks.values())
    return {
        "layout": r0["layout"],
        "ranks": len(results),
        "window": r0["window"],
        "chunk_bytes": r0["chunk_bytes"],
        "slot_bytes": r0["slot_bytes"],
        "backend": r0["backend"],
        "chunks": r0["chunks"],
        "tokens": r0["tokens"],
        "state_bytes": r0["state_bytes"],
        "half_state_bytes": half[0]["state_bytes"],
        "save_s": [r["save_s"] for r in results],
        "phase_s": [r["phase_s"] for r in results],
        "metrics": [r["metrics"] for r in results],
        "save_staging_peak_bytes": [r["save_staging_peak_bytes"] for r in results],
        "runs": runs,
        "fault": {"kind": "error", "tier": "L2", "chunk": r0["chunks"] // 2, "rank": fault_rank},
        "checks": checks,
        "wall_s": wall_s,
        "store_dir": str(root) if kept else None,  # a removed temp dir means nothing later
        "store_kept": kept,
    }


def _max(xs: list[dict], key: str) -> float:
    return max(x[key] for x in xs)


def _outcomes(xs: list[dict]) -> str:
    return "/".join(x["outcome"] for x in xs)


def print_report(doc: dict[str, Any]) -> None:
    runs = doc["runs"]
    state, w = doc["state_bytes"], doc["window"]
    print(
        f"\nbsr-io demo: layout {doc['layout']}, {doc['ranks']} ranks (one process each), "
        f"W={w}, chunk {doc['chunk_bytes']:,} B, engine {doc['backend']}"
    )
    print(
        f"state per rank: {fmt_size(state)} ({doc['chunks']} chunks, {doc['tokens']:,} tokens); "
        f"saved in {max(doc['save_s']):.2f} s "
        f"({state / max(doc['save_s']) / GiB:.2f} GiB/s per rank, staging peak "
        f"{fmt_size(max(doc['save_staging_peak_bytes']))})"
    )
    print("figures are the worst rank's; outcomes are rank 0/rank 1\n")
    hdr = f"{'restore':<34} {'outcome':<18} {'staging peak':>13} {'GiB/s':>6} {'to commit':>10}"
    print("GiB/s: per rank, both ranks reading the same drive at once")
    print(hdr)
    print("-" * len(hdr))

    def row(label: str, xs: list[dict], peak_key: str) -> None:
        rate = min(x["gib_s"] for x in xs) if all(x["gib_s"] for x in xs) else None
        print(
            f"{label:<34} {_outcomes(xs):<18} {fmt_size(_max(xs, peak_key)):>13} "
            f"{'-' if rate is None else f'{rate:.2f}':>6} {_max(xs, 'time_to_commit_s'):>8.2f} s"
        )

    row(f"BSR, {fmt_size(state)}", runs["bsr"], "rws_peak_bytes")
    row(f"BSR, {fmt_size(doc['half_state_bytes'])} (half)", runs["bsr_half"], "rws_peak_bytes")
    small = runs["whole_plan_same_l1"]
    print(
        f"{'whole-plan, L1 = ' + fmt_size(small[0]['l1_bytes']):<34} {_outcomes(small):<18} "
        f"{'needs ' + fmt_size(_max(small, 'l1_required_bytes')):>13}   (fails cleanly: "
        f"its L1 cannot stage the hit)"
    )
    big = runs["whole_plan_big_l1"]
    row(f"whole-plan, L1 = {fmt_size(big[0]['l1_bytes'])}", big, "l1_peak_bytes")
    rws = _max(runs["bsr"], "rws_peak_bytes")
    rws_half = _max(runs["bsr_half"], "rws_peak_bytes")
    print(
        f"\nBSR's staging peak (RWS) is {fmt_size(rws)} for the {fmt_size(state)} state and "
        f"{fmt_size(rws_half)} for the {fmt_size(doc['half_state_bytes'])} one: "
        f"{'the same' if rws == rws_half else 'NOT the same'}; it is the window "
        f"(W x chunk = {fmt_size(w * doc['slot_bytes'])}), not the state. "
        f"The whole-plan baseline stages {_max(big, 'l1_peak_bytes') / rws:.2f}x more."
    )
    if doc["chunks"] // 2 < w:
        print(
            f"note: the half state has fewer than W={w} chunks, so its RWS is its chunk count; "
            "use a larger --state or smaller --window to see the bound"
        )
    f = doc["fault"]
    print(
        f"\nfault round: rank {f['rank']} cannot read chunk {f['chunk']} from L2 "
        f"(injected I/O error); then L3 holds a copy of that chunk"
    )
    for key, label in (("fault_no_l3_copy", "no copy in L3"), ("fault_l3_copy", "L3 holds a copy")):
        xs = runs[key]
        parts = []
        for i, x in enumerate(xs):
            part = f"rank {i} {x['outcome']}, {x['committed_tokens']:,} tokens"
            if x["sources"].get("L3"):
                part += f" ({x['sources']['L3']} chunk from L3)"
            parts.append(part)
        print(f"  {label:<16} " + "; ".join(parts))
        if xs[0]["reason"]:
            print(f"  {'':<16} reason: {xs[0]['reason'][:150]}")
    checks = doc["checks"]
    print(
        "\nchecks: "
        + ", ".join(f"{k} {'ok' if v else 'FAILED'}" for k, v in checks.items() if k != "all_ok")
    )
    print(
        "restored bytes were compared (xxh3 per chunk and group) with what was saved after "
        "the full BSR, whole-plan and L3 restores; "
        f"{'store kept in ' + doc['store_dir'] if doc['store_kept'] else 'temp store removed'}; "
        f"{doc['wall_s']:.1f} s in all"
    )
