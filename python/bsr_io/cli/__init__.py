"""The `bsr-io` command line.

Each subcommand lives in its own module and exposes `register(subparsers)`,
which adds its parser and sets `func` (called with the parsed args; returns the
exit status). `bench` subcommands register under the `bench` parser.
"""

from __future__ import annotations

import argparse
import importlib
import os
import sys

# Modules that add top-level subcommands, and modules that add `bench` subcommands: the
# drive-level benchmark a user sizes a deployment with (a store on their drive against
# fio). Every other benchmark is the lab's (`bsr-lab bench`, not installed).
COMMANDS = ("bsr_io.cli.demo", "bsr_io.cli.store")
BENCHES = ("bsr_io.cli.bench_store",)


def build_parser(
    prog: str = "bsr-io",
    commands: tuple[str, ...] = COMMANDS,
    benches: tuple[str, ...] = BENCHES,
) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog=prog,
        description="Bounded-State Restoration of long KV-cache prefixes.",
    )
    sub = parser.add_subparsers(dest="command", required=True)
    for name in commands:
        importlib.import_module(name).register(sub)
    bench = sub.add_parser("bench", help="benchmarks (each reports ratios against a reference)")
    bench_sub = bench.add_subparsers(dest="bench", required=True)
    for name in benches:
        importlib.import_module(name).register(bench_sub)
    return parser


def run(parser: argparse.ArgumentParser, argv: list[str] | None = None) -> int:
    """Parse `argv` and run the chosen command: its exit status, 2 on a bad argument."""
    args = parser.parse_args(argv)
    try:
        return int(args.func(args) or 0)
    except KeyboardInterrupt:
        return 130
    except BrokenPipeError:
        # Whoever read stdout closed it (`| head`): stop quietly, as a command killed by
        # SIGPIPE would (128 + 13), and keep the interpreter's final flush from failing.
        _silence_stdout()
        return 141
    except (ValueError, OSError) as exc:
        print(f"bsr-io: error: {exc}", file=sys.stderr)
        return 2


def _silence_stdout() -> None:
    try:
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        os.close(devnull)
    except (OSError, ValueError):  # stdout without a descriptor (captured): nothing to do
        pass


def main(argv: list[str] | None = None) -> int:
    return run(build_parser(), argv)


if __name__ == "__main__":
    sys.exit(main())
