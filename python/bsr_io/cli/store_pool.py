"""`bsr-io store pool fill|probe|verify`: a synthetic state in a Mooncake Store pool.

bsr-io store pool fill   --master H:P --metadata-server URL --layout tiny --tokens 4096
bsr-io store pool probe  (same options): leading chunks the pool holds, metadata only
bsr-io store pool verify (same options): read each held chunk into one engine slot and
                         check key, layout and checksum; exit 1 if any is bad
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
from typing import TYPE_CHECKING, Any

from bsr_io.model.layout import PRESETS

if TYPE_CHECKING:
    from bsr_io.model.keys import ChunkKey
    from bsr_io.model.layout import KVLayout
    from bsr_io.tiers.mooncake import MooncakeConfig, MooncakeTier


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


def add_pool_args(p: argparse.ArgumentParser) -> None:
    """The pool options shared by the commands that talk to Mooncake Store."""
    g = p.add_argument_group("Mooncake Store pool")
    g.add_argument("--master", default=None, help="master RPC address host:port")
    g.add_argument("--metadata-server", default=None, help="e.g. http://HOST:PORT/metadata")
    g.add_argument("--protocol", default="tcp", choices=("tcp", "rdma"))
    g.add_argument("--device-name", default="", help="RDMA devices")
    g.add_argument(
        "--local-hostname",
        default="127.0.0.1",
        help="this host's address as the pool's nodes reach it",
    )
    g.add_argument(
        "--pool-timeout", type=float, default=10.0, help="deadline of each pool call, seconds"
    )


def check_pool_args(args: argparse.Namespace) -> None:
    """Refuse bad pool options before a pool is started or joined, naming the option."""
    if not args.pool_timeout > 0:  # NaN too
        raise ValueError(f"--pool-timeout {args.pool_timeout:g}: must be positive (seconds)")
    threads = getattr(args, "io_threads", None)
    if threads is not None and threads < 1:
        raise ValueError(f"--io-threads {threads}: must be at least 1")


def open_tier(cfg: MooncakeConfig, layout: KVLayout) -> MooncakeTier:
    """Join the pool: its tier, or one line (OSError) when the pool cannot be joined.

    Stderr (fd 2) goes to a file meanwhile: Mooncake's client logs INFO lines and an
    ERROR for its own segment not yet registered (a 404) on every successful join. The
    file is kept, and named, only when the join failed and Mooncake wrote to it."""
    from bsr_io.errors import TierDown
    from bsr_io.tiers.mooncake import MooncakeTier

    # Mooncake logs each failed put or read at WARNING besides the error the command
    # reports in its one line; MC_LOG_LEVEL=INFO (or WARNING) in the environment shows them.
    os.environ.setdefault("MC_LOG_LEVEL", "ERROR")
    fd, log = tempfile.mkstemp(prefix="bsr-mooncake-setup-", suffix=".log")
    sys.stderr.flush()
    saved = os.dup(2)
    os.dup2(fd, 2)
    os.close(fd)
    keep = False
    try:
        return MooncakeTier(cfg, layout=layout, name="L3")
    except TierDown as exc:
        keep = os.path.getsize(log) > 0
        raise OSError(f"{exc}" + (f" (Mooncake's log: {log})" if keep else "")) from None
    finally:
        os.dup2(saved, 2)
        os.close(saved)
        if not keep:
            os.unlink(log)


def close_client(tier: MooncakeTier) -> None:
    """Close the tier, then its Mooncake client while the pool is still up: left to its
    destructor at exit, a client of a loopback pool already stopped logs failed DELETEs
    to the gone metadata server. Only once no transfer is in flight (closing during one
    to a stalled node crashed Mooncake 0.3.13; see `MooncakeTier.close`)."""
    tier.close()
    tier.client.close()


def pool_config(args: argparse.Namespace) -> MooncakeConfig | None:
    from bsr_io.tiers.mooncake import MooncakeConfig

    check_pool_args(args)
    if args.master is None:
        return None
    if not args.metadata_server:
        raise ValueError("--master needs --metadata-server too (e.g. http://HOST:PORT/metadata)")
    return MooncakeConfig(
        master=args.master,
        metadata_server=args.metadata_server,
        protocol=args.protocol,
        device_name=args.device_name,
        local_hostname=args.local_hostname,
        timeout_s=args.pool_timeout,
    )


def _open(args: argparse.Namespace) -> tuple[MooncakeTier, KVLayout, list[ChunkKey]]:
    from bsr_io.cli.synthetic import synthetic_tokens
    from bsr_io.model.keys import chunk_keys
    from bsr_io.model.layout import preset

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
    from bsr_io.cli.synthetic import synthetic_chunk
    from bsr_io.errors import ChunkError

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
    from bsr_io.errors import ChunkError

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
    from bsr_io._core import Engine
    from bsr_io.cli.synthetic import synthetic_chunk
    from bsr_io.errors import ChunkError

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
