"""`bsr-lab bench lmcache`: stock LMCache 0.5.6 against LMCache with bsr-io, side by side.

Stock rows: LMCache's LocalDiskBackend and its stock retrieve, for each state size,
walking up a ladder of L1 sizes until a retrieve gives full reuse. Each rung runs in
a child process; a retrieve still running `--timeout` seconds after its store is
reported `hang` (LMCache's allocate busy-waits) and the child is killed.
bsr rows: the same states stored through LMCache into bsr-io's plugin (SSD tier,
engine I/O) and restored by the bounded retrieve at one small L1 size.

GPU: LMCache's CUDA connector is replaced by bsr-io's CPUPagedConnector (LMCache's
connector interface over CPU tensors); everything else is the real lmcache package.
"""

from __future__ import annotations

import logging
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path

from bsr_io.cli.report import write_json
from bsr_io.cli.scratch import scratch_dir
from bsr_io.model.sizes import fmt_size, parse_size


def register(bench_subparsers) -> None:
    p = bench_subparsers.add_parser(
        "lmcache",
        help="stock LMCache (L1 ladder, hangs) vs LMCache with bsr-io (fixed small L1)",
        description=__doc__,
    )
    p.add_argument("--json", metavar="PATH", help="write stock and bsr rows as JSON here")
    p.add_argument(
        "--states",
        default="2MiB,8MiB,16MiB",
        help="state sizes per rank (rounded down to whole chunks)",
    )
    p.add_argument(
        "--ladder",
        default="1MiB,2MiB,4MiB,8MiB,16MiB,32MiB",
        help="stock L1 sizes (max_local_cpu_size) to try, ascending",
    )
    p.add_argument("--bsr-l1", default="1MiB", help="L1 size for the bsr-io rows")
    p.add_argument("--window", type=int, default=2, help="W, chunks staged at once")
    p.add_argument(
        "--timeout",
        type=float,
        default=5.0,
        help="seconds a stock retrieve may run before it counts as a hang",
    )
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--kv-heads", type=int, default=2)
    p.add_argument("--head-size", type=int, default=64)
    p.add_argument("--chunk-tokens", type=int, default=256)
    p.add_argument(
        "--dir",
        type=Path,
        default=None,
        help="base of the scratch directory (default: a temp dir on disk)",
    )
    p.set_defaults(func=run)


def _sizes(text: str) -> list[int]:
    return [parse_size(s) for s in text.split(",") if s.strip()]


def stock_rows(shape, states: list[int], ladder: list[int], timeout_s: float, scratch: str):
    from bsr_lab.lmcache import harness as h

    rows = []
    for state in states:
        n = state // shape.chunk_bytes
        for l1 in sorted(ladder):
            d = tempfile.mkdtemp(dir=scratch, prefix="stock-")
            try:
                res = h.run_stock_case(shape, n, l1, d, timeout_s)
            finally:
                shutil.rmtree(d, ignore_errors=True)
            rows.append({"state_bytes": n * shape.chunk_bytes, "l1_bytes": l1, **res})
            _progress(f"stock {fmt_size(n * shape.chunk_bytes)} L1 {fmt_size(l1)}: {res['result']}")
            if res["result"] == "ok":
                break
    return rows


def bsr_case(shape, n_chunks: int, l1: int, window: int, scratch: str, seed: int = 0) -> dict:
    """Store a state through LMCache into bsr-io's plugin, then restore it bounded."""
    from bsr_io.integrations.lmcache.config import lmcache_settings
    from bsr_lab.lmcache import harness as h

    tier_dir = tempfile.mkdtemp(dir=scratch, prefix="bsr-")
    engines = h.Engines(shape)
    try:
        engine = engines(
            l1 // shape.chunk_bytes, settings=lmcache_settings(tier_dir, window=window)
        )
        plugin = engine.storage_manager.storage_backends.get("bsr")
        if plugin is None or plugin.retriever is None:
            raise RuntimeError("LMCache did not load bsr-io's plugin (see LMCache's log)")
        src = h.make_state(shape, n_chunks, seed)
        h.store_windowed(engine, src, max(1, window))
        h.drop_l1(engine)
        dst = h.empty_like(src)
        plugin.read_engine.reset_peak()
        t0 = time.perf_counter()
        with h.PeakSampler(engine) as l1_peak:
            mask = engine.retrieve(src.tokens, **dst.kwargs())
        seconds = time.perf_counter() - t0
        rep = plugin.retriever.last
        full = bool(mask.all())
        return {
            "state_bytes": n_chunks * shape.chunk_bytes,
            "l1_bytes": l1,
            "result": "ok" if full else ("short" if mask.any() else "zero"),
            "staging_peak_bytes": rep.staging_peak_bytes,  # L1 objects held by the retrieve
            "l1_peak_bytes": l1_peak.peak,  # L1 allocated (staging + LMCache's hot cache)
            "engine_peak_bytes": plugin.read_engine.peak_bytes(),  # bsr-io's W read slots
            "window": window,
            "seconds": seconds,
            "gib_per_s": n_chunks * shape.chunk_bytes / seconds / 2**30 if seconds else None,
            "engine_backend": plugin.read_engine.backend,
            "data_ok": h.restored_equal(src, dst, len(src.tokens)) if full else False,
        }
    finally:
        engines.close()
        shutil.rmtree(tier_dir, ignore_errors=True)


def _progress(msg: str) -> None:
    print(f"  {msg}", file=sys.stderr, flush=True)


def table(report: dict) -> str:
    """Markdown table: one line per state size."""
    head = (
        "| state/rank | stock: first full-reuse L1 | stock L1 peak | stock hangs at L1 "
        "| stock s | bsr-io L1 | bsr-io result | staging peak | state/staging | bsr-io s | data |"
    )
    lines = [head, "|" + "---|" * head.count(" | ") + "---|"]
    for state in sorted({r["state_bytes"] for r in report["stock"]}):
        st = [r for r in report["stock"] if r["state_bytes"] == state]
        ok = [r for r in st if r["result"] == "ok"]
        hangs = ", ".join(fmt_size(r["l1_bytes"]) for r in st if r["result"] == "hang") or "-"
        b = next((r for r in report["bsr"] if r["state_bytes"] == state), None)
        cells = [
            fmt_size(state),
            fmt_size(ok[0]["l1_bytes"]) if ok else "none in ladder",
            fmt_size(ok[0]["l1_peak_bytes"]) if ok else "-",
            hangs,
            f"{ok[0]['seconds']:.2f}" if ok else "-",
        ]
        if b is None:
            cells += ["-"] * 6
        else:
            peak = b["staging_peak_bytes"]
            cells += [
                fmt_size(b["l1_bytes"]),
                b["result"],
                fmt_size(peak),
                f"{state / peak:.1f}x" if peak else "-",
                f"{b['seconds']:.2f}",
                "equal" if b["data_ok"] else "DIFFERENT",
            ]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def run(args) -> int:
    logging.disable(logging.WARNING)  # LMCache's busy-wait and store warnings are expected
    os.environ.setdefault("PYTHONHASHSEED", "0")
    from bsr_lab.lmcache.harness import Shape

    shape = Shape(args.layers, args.kv_heads, args.head_size, args.chunk_tokens)
    states = [s for s in _sizes(args.states) if s >= shape.chunk_bytes]
    if not states:
        raise ValueError(f"every state is smaller than one chunk ({shape.chunk_bytes} bytes)")
    bsr_l1 = parse_size(args.bsr_l1)
    if bsr_l1 < args.window * shape.chunk_bytes:
        raise ValueError(f"--bsr-l1 must hold W={args.window} chunks of {shape.chunk_bytes} B")
    # Stock LMCache's disk tier and bsr-io's each hold the largest state at a time.
    need = 2 * max(states)
    with scratch_dir(args.dir, "bsr-bench-lmcache-", need_bytes=need) as root:
        scratch = str(root)
        stock = stock_rows(shape, states, _sizes(args.ladder), args.timeout, scratch)
        bsr = []
        for state in states:
            row = bsr_case(shape, state // shape.chunk_bytes, bsr_l1, args.window, scratch)
            bsr.append(row)
            _progress(f"bsr {fmt_size(row['state_bytes'])}: {row['result']}")
    report = {
        "lmcache": _lmcache_version(),
        "shape": {**shape.__dict__, "chunk_bytes": shape.chunk_bytes},
        "window": args.window,
        "timeout_s": args.timeout,
        "connector": "CPUPagedConnector (LMCache GPUConnectorInterface over CPU tensors)",
        "stock": stock,
        "bsr": bsr,
    }
    print(table(report))
    write_json(args.json, report)
    ok = all(r["result"] == "ok" and r["data_ok"] for r in bsr)
    return 0 if ok else 1


def _lmcache_version() -> str:
    from importlib.metadata import version

    return version("lmcache")
