"""`bsr-lab`: the lab-only benchmarks, on the same command-line frame as `bsr-io`.

`bsr-io bench store` (the drive-level benchmark a user sizes a deployment with) ships in
the wheel; these need a serving stack, a model, fault scenarios, several drives, a pool,
or measure the package itself."""

from __future__ import annotations

import sys

from bsr_io.cli import build_parser, run

BENCHES = (
    "bsr_lab.bench.ssd",
    "bsr_lab.bench.sweep",
    "bsr_lab.bench.ttft",
    "bsr_lab.bench.ceiling",
    "bsr_lab.bench.paper",
    "bsr_lab.bench.remote",
    "bsr_lab.bench.stripe",
    "bsr_lab.bench.faults",
    "bsr_lab.bench.lmcache",
    "bsr_lab.bench.model",
    "bsr_lab.bench.serve",
    "bsr_lab.bench.serve_pool",
    "bsr_lab.bench.soak",
    "bsr_lab.bench.sglang",
    "bsr_lab.bench.vllm",
    "bsr_lab.bench.vllm_trace",
)


def main(argv: list[str] | None = None) -> int:
    return run(build_parser("bsr-lab", commands=(), benches=BENCHES), argv)


if __name__ == "__main__":
    sys.exit(main())
