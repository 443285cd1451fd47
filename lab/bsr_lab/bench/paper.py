"""`bsr-lab bench paper`: the paper's scale on this machine.

DeepSeek-V4-Flash, TP=2, 524,288 tokens: 31.28 GiB of KV state per rank, 62.55 GiB on
disk for both ranks, restored with W=32 by two real ranks (one process each, one gloo
group), each holding RWS = 32 x 16,408,576 = 525,074,432 bytes; then fio reads the
same record payloads (both ranks' at once) on 4 KiB-page and on huge-page buffers.
Beside it, the direct path (every chunk read straight into a host cache, no slot) where
a host cache of the whole state fits `--dest-cap`; a GPU destination takes the slots.
It is `bench sweep` at one size with the paper's settings, after a disk-space check
that refuses with the space needed when the state does not fit. `--ranks 1 --tokens
1048576` is the model's whole context on one rank (62.55 GiB), where the disk allows.
"""

from __future__ import annotations

import argparse
import shutil
from pathlib import Path
from typing import Any

from bsr_io.cli.scratch import scratch_base
from bsr_io.model.layout import PRESETS, preset
from bsr_io.model.record import HEADER_BYTES
from bsr_io.model.sizes import GiB, fmt_size, parse_size
from bsr_lab.bench import sweep as bench_sweep


def register(bench_subparsers: Any) -> None:
    p = bench_subparsers.add_parser(
        "paper",
        help="the paper's scale: 524,288 tokens x 2 ranks, W=32, vs fio on the same bytes",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--layout", default="deepseek-v4-flash", choices=sorted(PRESETS))
    p.add_argument("--tokens", type=int, default=524288, help="prefix length (default 524288)")
    p.add_argument("--ranks", type=int, default=2, help="ranks (default 2, the paper's TP)")
    p.add_argument("--window", type=int, default=32, help="W (default 32)")
    p.add_argument(
        "--dir",
        type=Path,
        default=None,
        help="base of the store directory (default: a temp dir on disk)",
    )
    p.add_argument(
        "--dest-cap",
        type=parse_size,
        default=parse_size("1GiB"),
        help="host KV cache size; the direct path runs only where the state fits it",
    )
    p.add_argument("--json", type=Path, default=None, help="write the results here")
    p.add_argument("--plot", type=Path, default=None, help="write the staging plot (PNG)")
    p.add_argument("--keep", action="store_true", help="keep the store afterwards")
    p.add_argument("--quiet", action="store_true")
    p.set_defaults(func=run)


def disk_needed(layout: str, tokens: int, ranks: int) -> int:
    """Bytes of record files for `tokens` tokens on `ranks` ranks, plus 1 GiB of slack."""
    lay = preset(layout)
    chunks = tokens // lay.chunk_tokens
    return ranks * chunks * (lay.chunk_bytes + HEADER_BYTES) + GiB


def run(args: argparse.Namespace) -> int:
    if args.tokens < 1 or args.ranks < 1 or args.window < 1:
        raise ValueError("--tokens, --ranks and --window must be at least 1")
    lay = preset(args.layout)
    where = scratch_base(args.dir)
    need = disk_needed(args.layout, args.tokens, args.ranks)
    free = shutil.disk_usage(where).free
    if need > free:
        per_rank = lay.state_bytes(args.tokens)
        raise ValueError(
            f"bench paper: {args.tokens:,} tokens of {lay.name} on {args.ranks} rank(s) need "
            f"{fmt_size(need)} ({need:,} bytes) free in {where.resolve()} "
            f"({fmt_size(per_rank)} of KV state per rank as record files, plus 1 GiB); "
            f"{fmt_size(free)} is free, "
            f"{fmt_size(need - free)} short. Free space or pass --dir on a larger disk"
        )
    sweep = argparse.Namespace(
        layout=args.layout,
        tokens=str(args.tokens),
        window=args.window,
        ranks=args.ranks,
        dir=args.dir,
        json=args.json,
        plot=args.plot,
        l1=None,
        whole_plan_max=0,  # whole-plan cannot stage this; it runs at BSR's L1 and says so
        dest_cap=args.dest_cap,
        ref_size=0,  # fio reads the records themselves; no second copy on the disk
        seed=11,
        keep=args.keep,
        quiet=args.quiet,
    )
    return bench_sweep.run(sweep)
