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
import shutil
import signal
import sys
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from bsr_io.cli.demo.report import print_report, summarize
from bsr_io.cli.host import check_memory
from bsr_io.cli.progress import ProgressWatcher
from bsr_io.cli.report import write_json
from bsr_io.cli.scratch import check_room, make_scratch, scratch_base
from bsr_io.model.layout import PRESETS, preset
from bsr_io.model.record import HEADER_BYTES
from bsr_io.model.sizes import fmt_size, parse_size

RANKS = 2
TARGET = "bsr_io.cli.demo.rank:demo_rank"
DEFAULT_STATE = 1 << 30
# Each record is a file with a 4 KiB header: 1 GiB of tiny's 2 KiB chunks would be half a
# million files per rank and tier (minutes, and 4 KiB of header per 2 KiB record). The
# demo keeps to this many records per rank: the default state shrinks to fit, and a
# --state beyond it is refused.
MAX_RECORDS = 4096


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
        help="where to put the temporary store (default: a temp dir on disk, never the cwd)",
    )
    p.add_argument(
        "--state",
        type=parse_size,
        default=None,
        help="KV state per rank (whole chunks are kept, at least 2 x --window of them and "
        f"at most {MAX_RECORDS:,} records; default 1GiB, or {MAX_RECORDS:,} chunks where "
        "the layout's chunks are smaller than 1GiB / "
        f"{MAX_RECORDS:,}: tiny's 2 KiB chunks make {fmt_size(MAX_RECORDS * 2112)})",
    )
    p.add_argument("--window", type=int, default=32, help="W: staging slots per rank")
    p.add_argument(
        "--layout", default="deepseek-v4-flash", choices=sorted(PRESETS), help="KV layout preset"
    )
    p.add_argument("--quiet", action="store_true", help="no progress bars")
    p.add_argument("--json", type=Path, default=None, help="also write every figure here")
    p.add_argument("--keep", action="store_true", help="keep the store directory afterwards")
    p.add_argument("--seed", type=int, default=1, help="seed of the token ids and KV bytes")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    if args.window < 1:
        raise ValueError(f"--window must be at least 1, got {args.window}")
    lay = preset(args.layout)
    chunks = state_chunks(args.state, lay.chunk_bytes, lay.name)
    asked = fmt_size(DEFAULT_STATE if args.state is None else args.state)
    if chunks < 2:
        raise ValueError(
            f"--state {asked} holds {chunks} chunk(s) of {fmt_size(lay.chunk_bytes)}"
            f" ({lay.name}); the demo needs at least 2"
        )
    if chunks < 2 * args.window:
        # Below 2W chunks the half state does not fill the window and the whole-plan
        # baseline at BSR's budget (W slots of L1) can stage the state: the comparison
        # the demo prints would not hold, so it is refused rather than shown.
        raise ValueError(
            f"--state {asked} holds {chunks} chunk(s) of "
            f"{fmt_size(lay.chunk_bytes)} ({lay.name}); with --window {args.window} the demo "
            f"needs at least 2 x W = {2 * args.window} so that half the state still fills "
            f"the window: pass --state >= {fmt_size(2 * args.window * lay.chunk_bytes)} or "
            f"--window <= {chunks // 2}"
        )
    state = chunks * lay.chunk_bytes
    # L2 and an L3 copy on disk for each rank.
    disk = RANKS * 2 * chunks * (lay.chunk_bytes + HEADER_BYTES) + (64 << 20)
    hint = "use --dir elsewhere or a smaller --state"
    check_room(scratch_base(args.dir), disk, "the demo's store", hint)
    # Per rank: source, destination, the whole-plan's staging and the W slots.
    check_memory(
        RANKS * (3 * state + args.window * lay.chunk_bytes),
        f"the demo ({RANKS} ranks x (source + destination + whole-plan L1) of {fmt_size(state)})",
        "a smaller --state",
    )
    root: Path | None = None
    t0 = time.perf_counter()
    with _signals_exit():
        try:
            root = make_scratch(
                args.dir, "bsr-io-demo-", need_bytes=disk, what="the demo's store", hint=hint
            )
            results = _run_ranks(args, root, chunks, state)
        finally:
            if root is not None and not args.keep:
                shutil.rmtree(root, ignore_errors=True)
    if results is None:
        return 1
    assert root is not None
    doc = summarize(results, time.perf_counter() - t0, root, args.keep)
    print_report(doc)
    write_json(args.json, doc)
    return 0 if doc["checks"]["all_ok"] else 1


def state_chunks(state: int | None, chunk_bytes: int, layout: str) -> int:
    """Chunks per rank: `state` in whole chunks, or the default's, within MAX_RECORDS."""
    if state is None:
        chunks = min(DEFAULT_STATE // chunk_bytes, MAX_RECORDS)
        if chunks < DEFAULT_STATE // chunk_bytes:
            print(
                f"bsr-io demo: {layout}'s {fmt_size(chunk_bytes)} chunks: the state is "
                f"{chunks:,} chunks ({fmt_size(chunks * chunk_bytes)}) per rank, not "
                f"{fmt_size(DEFAULT_STATE)} (at most {MAX_RECORDS:,} records)",
                file=sys.stderr,
                flush=True,
            )
        return chunks
    chunks = state // chunk_bytes
    if chunks > MAX_RECORDS:
        raise ValueError(
            f"--state {fmt_size(state)} with --layout {layout} is {chunks:,} records of "
            f"{fmt_size(chunk_bytes)} per rank; the demo writes at most {MAX_RECORDS:,}: "
            f"pass --state <= {fmt_size(MAX_RECORDS * chunk_bytes)}, or leave --state out"
        )
    return chunks


@contextmanager
def _signals_exit() -> Iterator[None]:
    """SIGTERM and SIGHUP (a timeout, a service manager, a closed terminal) end the
    demo as Ctrl-C does: through its `finally`, which removes the store, and `launch`'s,
    which stops the ranks. Exit status 128 + the signal, as if it had killed us."""
    if threading.current_thread() is not threading.main_thread():
        yield  # only the main thread may set handlers; a caller's thread keeps its own
        return

    def stop(signum: int, _frame: object) -> None:
        raise SystemExit(128 + signum)

    saved = {sig: signal.signal(sig, stop) for sig in (signal.SIGTERM, signal.SIGHUP)}
    try:
        yield
    finally:
        for sig, handler in saved.items():
            signal.signal(sig, handler)


def _run_ranks(
    args: argparse.Namespace, root: Path, chunks: int, state: int
) -> list[dict[str, Any]] | None:
    """The ranks' results, or None (said on stderr) when a rank failed."""
    from bsr_io.cli.ranks import launch  # imports torch: not for `--help`

    kwargs = {
        "root": str(root),
        "layout": args.layout,
        "chunks": chunks,
        "window": args.window,
        "seed": args.seed,
        "fault_chunk": chunks // 2,
        "fault_rank": RANKS - 1,
        "progress_dir": None if args.quiet else str(root / "progress"),
    }
    if not args.quiet:
        print(
            f"bsr-io demo: {RANKS} ranks saving and restoring "
            f"{fmt_size(state)} each under {root} ...",
            file=sys.stderr,
            flush=True,
        )
    with ProgressWatcher(root / "progress", RANKS, quiet=args.quiet):
        results: list[dict[str, Any]] = launch(
            RANKS, TARGET, kwargs, timeout_s=900, env={"BSR_IO_EXIT_WAIT_S": "20"}
        )
    failed = [r for r in results if "runs" not in r]
    for r in failed:
        print(
            f"rank {r.get('rank')} failed ({r.get('exit_code')}):\n{r.get('stderr', '')}",
            file=sys.stderr,
        )
    return None if failed else results
