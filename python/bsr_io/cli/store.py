"""`bsr-io store stats|verify|fill DIR`: inspect, check and fill a store directory."""

from __future__ import annotations

import argparse
import json
import sys
from collections import Counter
from pathlib import Path
from typing import Any

from bsr_io._core import Engine
from bsr_io.errors import ChunkError
from bsr_io.model.layout import PRESETS, preset
from bsr_io.model.record import HEADER_BYTES
from bsr_io.model.sizes import fmt_size
from bsr_io.tiers import LowerTier, SSDTier
from bsr_io.tiers.files import FileTier


def register(subparsers: Any) -> None:
    p = subparsers.add_parser("store", help="inspect, verify or fill a chunk store directory")
    sub = p.add_subparsers(dest="store_command", required=True)

    s = sub.add_parser(
        "stats",
        help="records, bytes and namespaces in DIR; exit 1 if a bad header is found. Changes "
        "nothing (verify moves bad records to quarantine)",
    )
    s.add_argument("dir", type=Path)
    s.add_argument("--json", action="store_true", help="print JSON")
    s.set_defaults(func=run_stats)

    v = sub.add_parser(
        "verify",
        help="re-read every record, quarantine the corrupt ones; exit 1 if any is corrupt "
        "or the quarantine holds records (found earlier, by a restore or a verify)",
    )
    v.add_argument("dir", type=Path)
    v.add_argument("--backend", default=None, help="engine backend (default: auto)")
    v.set_defaults(func=run_verify)

    f = sub.add_parser("fill", help="write a synthetic, deterministic state")
    f.add_argument("dir", type=Path)
    f.add_argument("--layout", required=True, choices=sorted(PRESETS))
    f.add_argument("--tokens", type=int, required=True, help="prefix length (full chunks kept)")
    f.add_argument("--rank", type=int, default=0)
    f.add_argument("--world-size", type=int, default=1)
    f.add_argument("--seed", type=int, default=0, help="seed of the token ids and the bytes")
    f.add_argument("--model", default="synthetic", help="model name in the keys")
    f.add_argument(
        "--quiet", action="store_true", help="print the summary line only, not every record's path"
    )
    f.set_defaults(func=run_fill)

    from bsr_io.cli.store_pool import register_pool

    register_pool(sub)  # bsr-io store pool fill|probe|verify: a Mooncake Store pool


def _open_existing(path: Path, *, read_only: bool = False) -> LowerTier:
    if not (path / "chunks").is_dir():
        raise ValueError(f"{path} is not a bsr-io store (no chunks/ directory)")
    return LowerTier(path, read_only=read_only)  # buffered: headers only, no engine needed


def run_stats(args: argparse.Namespace) -> int:
    # A look only: a monitor that runs stats must not move corruption out of verify's
    # sight (bad records stay in place, reported here and by verify).
    tier = _open_existing(args.dir, read_only=True)
    groups: Counter[tuple[str, int, int, str]] = Counter()
    nbytes = 0
    keys = tier.keys()  # checks every record's header once
    for key in keys:
        groups[(key.model, key.world_size, key.rank, key.layout_fingerprint)] += 1
    for header in tier.headers():
        nbytes += header.record_bytes
    out: dict[str, Any] = {
        "dir": str(tier.root),
        "records": len(keys),
        "bytes": nbytes,
        "quarantined": len(tier.quarantined_files()),
        "bad": [{"file": p.path, "reason": p.reason} for p in tier.problems],
        "namespaces": [
            {"model": m, "world_size": w, "rank": r, "layout": fp, "records": n}
            for (m, w, r, fp), n in sorted(groups.items())
        ],
    }
    rc = 1 if tier.problems else 0  # a bad header is news to a monitor
    if args.json:
        print(json.dumps(out, indent=2))
        return rc
    print(
        f"{out['dir']}: {out['records']} records, {fmt_size(nbytes)}, "
        f"{out['quarantined']} quarantined"
        + (
            f", {len(tier.problems)} bad (left in place: verify quarantines them)"
            if tier.problems
            else ""
        )
    )
    for ns in out["namespaces"]:
        print(
            f"  {ns['model']} w{ns['world_size']}r{ns['rank']} layout {ns['layout'][:12]}: "
            f"{ns['records']} records"
        )
    for p in tier.problems:
        print(f"  BAD {p.path}: {p.reason}")
    return rc


def run_verify(args: argparse.Namespace) -> int:
    scan = _open_existing(args.dir)
    sizes = [h.payload_len for h in scan.headers()]
    bad: list[tuple[str, str, str]] = [("?", p.path, p.reason) for p in scan.problems]
    ok = 0
    if sizes:
        with Engine(1, max(sizes), backend=args.backend) as engine:
            tier: FileTier = SSDTier(args.dir, None, engine)
            bad += [("?", p.path, p.reason) for p in tier.problems]  # changed since the scan
            for key in tier.keys():
                path = str(tier.path_of(key))
                try:
                    slot = tier.read_into(key, engine)
                    del slot
                    ok += 1
                except ChunkError as exc:
                    bad.append((key.short(), path, str(exc)))
    for short, path, reason in bad:
        print(f"CORRUPT {short} {path}: {reason}")
    earlier = len(scan.quarantined_files()) - len(bad)
    print(
        f"{ok} records verified, {len(bad)} corrupt"
        + (f" (moved to {scan.quarantine_dir})" if bad else "")
        + (
            f"; {earlier} quarantined earlier (in {scan.quarantine_dir}: remove them once "
            "looked at, and verify passes)"
            if earlier > 0
            else ""
        )
    )
    # Corruption found earlier (by a restore, or a verify) still fails the check until
    # somebody has looked: a monitor never sees a store that had bad records as sound.
    return 1 if bad or earlier > 0 else 0


def run_fill(args: argparse.Namespace) -> int:
    from bsr_io.cli.synthetic import fill_state  # imports torch: fill's alone

    layout = preset(args.layout)
    if args.tokens < layout.chunk_tokens:
        raise ValueError(
            f"--tokens {args.tokens} is less than one chunk ({layout.chunk_tokens} tokens)"
        )
    if args.world_size < 1 or not 0 <= args.rank < args.world_size:
        raise ValueError(
            f"--rank {args.rank} --world-size {args.world_size}: need --world-size >= 1 and "
            "0 <= --rank < --world-size"
        )
    with Engine(2, layout.chunk_bytes) as engine:
        try:
            # A DIR that is a file or cannot be created (under /proc) is refused here.
            tier = SSDTier(args.dir, None, engine, layout=layout)
            _, keys = fill_state(
                tier, layout, args.tokens, args.seed, args.rank, args.world_size, args.model
            )
        except ChunkError as exc:
            print(f"bsr-io: error: {exc}", file=sys.stderr)
            return 2
        print(
            f"seed {args.seed}: {len(keys)} chunks of {layout.name} "
            f"({len(keys) * layout.chunk_tokens} tokens, rank {args.rank}/{args.world_size}, "
            f"{fmt_size(len(keys) * (HEADER_BYTES + layout.chunk_bytes))})"
        )
        if not args.quiet:
            for key in keys:
                print(tier.path_of(key))
    return 0
