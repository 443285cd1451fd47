"""`bsr_io.cli.ranks.launch` itself: every rank's pipes are drained while the others
run, so a chatty rank never stalls the group. Real processes, real gloo group."""

from __future__ import annotations

import sys
from pathlib import Path

from bsr_io.cli.ranks import launch

NOISE = 8 << 20  # far beyond a pipe's buffer (64 KiB on Linux)


def noisy_rank(rank: int, world_size: int, nbytes: int) -> dict:
    """Rank 1 writes `nbytes` to stderr before it returns; rank 0 returns at once and
    then (as the store's host) waits for every rank's exit mark."""
    if rank == 1:
        line = b"x" * 1023 + b"\n"
        for _ in range(nbytes // len(line)):
            sys.stderr.buffer.write(line)
        sys.stderr.buffer.flush()
    return {"rank": rank, "wrote": nbytes if rank == 1 else 0}


def test_a_rank_that_fills_its_stderr_does_not_stall_the_launch():
    # Read one after another, rank 1 blocks on its full pipe, never marks its exit, and
    # rank 0 waits for it past the launch's timeout: both come back as timeouts.
    results = launch(
        2,
        f"{__name__}:noisy_rank",
        {"nbytes": NOISE},
        timeout_s=40,
        env={"BSR_IO_EXIT_WAIT_S": "120", "PYTHONPATH": str(Path(__file__).parent)},
    )
    assert results == [{"rank": 0, "wrote": 0}, {"rank": 1, "wrote": NOISE}], results


def test_a_failed_rank_reports_its_stderr():
    results = launch(
        2,
        f"{__name__}:no_such_function",
        {},
        timeout_s=60,
        env={"BSR_IO_EXIT_WAIT_S": "5", "PYTHONPATH": str(Path(__file__).parent)},
    )
    for rank, r in enumerate(results):
        assert r["rank"] == rank and r["exit_code"] == 1, r
        assert "no_such_function" in r["stderr"]
