"""The `bsr-io` command line.

Each subcommand lives in its own module and exposes `register(subparsers)`,
which adds its parser and sets `func` (called with the parsed args; returns the
exit status). `bench` subcommands register under the `bench` parser.
"""

from __future__ import annotations

import argparse
import importlib
import sys

# Modules that add top-level subcommands, and modules that add `bench` subcommands.
COMMANDS = ("demo", "store")
BENCHES = (
    "bench_ssd",
    "bench_store",
    "bench_sweep",
    "bench_faults",
    "bench_ttft",
    "bench_model",
    "bench_lmcache",
    "bench_ceiling",
    "bench_paper",
    "bench_remote",
    "bench_stripe",
    "bench_vllm",
)


def _load(name: str):
    try:
        return importlib.import_module(f"bsr_io.cli.{name}")
    except ModuleNotFoundError as exc:
        if exc.name == f"bsr_io.cli.{name}":
            return None  # not built yet in this checkout
        raise


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="bsr-io",
        description="Bounded-State Restoration of long KV-cache prefixes.",
    )
    sub = parser.add_subparsers(dest="command", required=True)
    for name in COMMANDS:
        mod = _load(name)
        if mod is not None:
            mod.register(sub)
    bench = sub.add_parser("bench", help="benchmarks (each reports ratios against a reference)")
    bench_sub = bench.add_subparsers(dest="bench", required=True)
    for name in BENCHES:
        mod = _load(name)
        if mod is not None:
            mod.register(bench_sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return int(args.func(args) or 0)
    except KeyboardInterrupt:
        return 130
    except (ValueError, OSError) as exc:
        print(f"bsr-io: error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
