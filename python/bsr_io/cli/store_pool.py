"""`bsr-io store pool fill|probe|verify`: a synthetic state in a Mooncake Store pool.

bsr-io store pool fill   --master H:P --metadata-server URL --layout tiny --tokens 4096
bsr-io store pool probe  (same options): leading chunks the pool holds, metadata only
bsr-io store pool verify (same options): read each held chunk into one engine slot and
                         check key, layout and checksum; exit 1 if any is bad
"""

from __future__ import annotations

import argparse
import json
from typing import TYPE_CHECKING, Any

from bsr_io._core import Engine
from bsr_io.cli.bench_remote import add_pool_args, close_client, open_tier, pool_config
from bsr_io.cli.synthetic import synthetic_chunk, synthetic_tokens
from bsr_io.errors import ChunkError
from bsr_io.model.keys import ChunkKey, chunk_keys
from bsr_io.model.layout import PRESETS, KVLayout, preset

if TYPE_CHECKING:
    from bsr_io.tiers.mooncake import MooncakeTier


def register_pool(store_sub: Any) -> None:
    p = store_sub.add_parser(
        "pool",
        help="fill, probe or verify a state in a Mooncake pool",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    sub = p.add_subparsers(dest="pool_command", required=True)
    for name, func, text in (
        ("fill", run_fill, "write a synthetic, deterministic state"),
        ("probe", run_probe, "how many leading chunks the pool holds (metadata only)"),
        ("verify", run_verify, "read and verify every held chunk; exit 1 if any is bad"),
    ):
        s = sub.add_parser(name, help=text)
        s.add_argument("--layout", required=True, choices=sorted(PRESETS))
        s.add_argument("--tokens", type=int, required=True, help="prefix length (full chunks)")
        s.add_argument("--rank", type=int, default=0)
        s.add_argument("--world-size", type=int, default=1)
        s.add_argument("--seed", type=int, default=0)
        s.add_argument("--model", default="synthetic")
        add_pool_args(s)
        s.set_defaults(func=func)


def _open(args: argparse.Namespace) -> tuple[MooncakeTier, KVLayout, list[ChunkKey]]:
    cfg = pool_config(args)
    if cfg is None:
        raise ValueError("give the pool: --master HOST:PORT --metadata-server URL")
    layout = preset(args.layout)
    if args.tokens < layout.chunk_tokens:
        raise ValueError(
            f"--tokens {args.tokens} is less than one chunk ({layout.chunk_tokens} tokens of "
            f"{layout.name})"
        )
    if args.world_size < 1 or not 0 <= args.rank < args.world_size:
        raise ValueError(
            f"--rank {args.rank} --world-size {args.world_size}: need --world-size >= 1 and "
            "0 <= --rank < --world-size"
        )
    keys = chunk_keys(
        synthetic_tokens(args.seed, args.tokens), layout, args.model, args.rank, args.world_size
    )
    return open_tier(cfg, layout), layout, keys


def run_fill(args: argparse.Namespace) -> int:
    tier, layout, keys = _open(args)
    new = done = 0
    try:
        for i, k in enumerate(keys):
            new += tier.write(k, synthetic_chunk(layout, args.seed, i, args.rank), layout)
            done += 1
    except ChunkError as exc:  # a full or gone pool: one line, saying how far it got
        raise OSError(f"{done} of {len(keys)} chunks in the pool, then: {exc}") from None
    finally:
        tier.close()
    close_client(tier)  # every call returned: nothing in flight
    print(json.dumps({"chunks": len(keys), "written": new, "already_held": len(keys) - new}))
    return 0


def run_probe(args: argparse.Namespace) -> int:
    tier, layout, keys = _open(args)
    try:
        held = tier.probe(keys)
    except ChunkError as exc:  # the pool went down between joining and asking
        raise OSError(str(exc)) from None
    finally:
        tier.close()
    close_client(tier)  # every call returned: nothing in flight
    print(
        json.dumps(
            {"chunks": len(keys), "leading_held": held, "tokens": held * layout.chunk_tokens}
        )
    )
    return 0


def run_verify(args: argparse.Namespace) -> int:
    tier, layout, keys = _open(args)
    bad: list[dict[str, str]] = []
    ok = 0
    try:
        try:
            held = tier.probe(keys)
        except ChunkError as exc:  # the pool went down between joining and asking
            raise OSError(str(exc)) from None
        with Engine(1, layout.chunk_bytes) as engine:
            for i, k in enumerate(keys[:held]):
                try:
                    slot = tier.read_into(k, engine)
                    same = (
                        bytes(memoryview(slot))
                        == synthetic_chunk(layout, args.seed, i, args.rank).tobytes()
                    )
                    del slot
                except ChunkError as exc:
                    bad.append({"chunk": str(i), "error": str(exc)})
                    continue
                if same:
                    ok += 1
                else:
                    bad.append({"chunk": str(i), "error": "verified record of other bytes"})
    finally:
        tier.close()
    close_client(tier)  # every call returned: nothing in flight
    print(json.dumps({"chunks": len(keys), "held": held, "verified": ok, "bad": bad}))
    return 1 if bad else 0
