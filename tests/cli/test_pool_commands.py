"""`bsr-io store pool fill|probe|verify` and `bsr-lab bench remote` on small and bad
inputs, against a real loopback pool (mooncake_master + a storage node): a successful
run prints its result and nothing from Mooncake on stderr (no setup log, no teardown
errors); a bad argument, a pool that cannot be reached or is too small, a --json path
that cannot be written get one line and exit status 2, before any pool is started where
the argument alone says so; a closed stdout stops quietly (141)."""

from __future__ import annotations

import json
import subprocess
import sys

import mooncake_fixtures as mf
import pytest
from cli_errors import one_line

from bsr_io.cli import main
from bsr_io.model.layout import preset
from bsr_lab.cli import main as lab_main
from bsr_lab.loopback_pool import free_port

mf.require_mooncake()
_loopback_ns, netns, pool = mf._loopback_ns, mf.netns, mf.pool

TINY = preset("tiny")


def _pool_args(p: mf.LoopbackPool) -> list[str]:
    return ["--master", p.master_address, "--metadata-server", p.metadata_server]


def _store_pool(cmd: str, p: mf.LoopbackPool, *extra: str) -> list[str]:
    return ["store", "pool", cmd, "--layout", "tiny", *extra, *_pool_args(p)]


def _dead_pool() -> list[str]:
    return ["--master", f"127.0.0.1:{free_port()}", "--metadata-server", "http://127.0.0.1:1/m"]


def _cli(argv: list[str]) -> subprocess.CompletedProcess[str]:
    """The command in a process of its own: a Mooncake client whose setup failed leaves
    threads behind in its process (still retrying the dead master), and later clients of
    that process then cannot set up (seen: every pool test after this module timed out)."""
    cmd = [sys.executable, "-m", "bsr_io.cli", *argv]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=300)


# -- store pool ---------------------------------------------------------------------------
def test_store_pool_fill_probe_verify_one_chunk_and_quiet_stderr(pool):
    # One chunk (the smallest state --tokens allows), a seed no other test writes. Each
    # command in a process of its own, as a user runs it: it closes its Mooncake client
    # at the end, which leaves Mooncake's process-wide state unusable to later clients
    # of the same process (seen: every pool test after this module timed out).
    args = ("--tokens", str(TINY.chunk_tokens), "--seed", "30")
    docs = []
    for cmd in ("fill", "probe", "verify"):
        proc = _cli(_store_pool(cmd, pool, *args))
        assert proc.returncode == 0, proc.stderr
        # Mooncake's client logs its setup (INFO lines, an ERROR 404) on fd 2: kept off it.
        assert proc.stderr == ""
        docs += [json.loads(line) for line in proc.stdout.splitlines()]
    assert docs == [
        {"chunks": 1, "written": 1, "already_held": 0},
        {"chunks": 1, "leading_held": 1, "tokens": TINY.chunk_tokens},
        {"chunks": 1, "held": 1, "verified": 1, "bad": []},
    ]


@pytest.mark.parametrize(
    ("extra", "says"),
    [
        (["--tokens", "8"], "--tokens 8 is less than one chunk (16 tokens of tiny)"),
        (["--tokens", "64", "--rank", "2", "--world-size", "2"], "0 <= --rank < --world-size"),
        (["--tokens", "64", "--world-size", "0"], "need --world-size >= 1"),
        (["--tokens", "64", "--pool-timeout", "0"], "--pool-timeout 0: must be positive"),
    ],
)
def test_store_pool_bad_arguments_are_one_line(pool, capsys, extra, says):
    assert main(_store_pool("fill", pool, *extra)) == 2
    assert says in one_line(capsys.readouterr().err)


def test_store_pool_unreachable_pool_is_one_line():
    argv = ["store", "pool", "probe", "--layout", "tiny", "--tokens", "64", *_dead_pool()]
    proc = _cli([*argv, "--pool-timeout", "2"])
    assert proc.returncode == 2, proc.stderr
    line = one_line(proc.stderr)
    assert line.startswith("bsr-io: error: cannot reach the Mooncake master at 127.0.0.1:")


def test_store_pool_fill_into_a_pool_too_small_is_one_line(netns, tmp_path):
    # One llama-3.1-8b chunk (32 MiB) into the smallest segment Mooncake takes (16 MiB).
    small = mf.start_pool(tmp_path / "pool", segment_bytes=16 << 20)
    try:
        big = preset("llama-3.1-8b")
        argv = [
            "store",
            "pool",
            "fill",
            "--layout",
            "llama-3.1-8b",
            "--tokens",
            str(big.chunk_tokens),
        ]
        proc = _cli([*argv, *_pool_args(small)])
    finally:
        small.stop()
    assert proc.returncode == 2, proc.stderr
    line = one_line(proc.stderr)
    assert "0 of 1 chunks in the pool, then: pool full or no storage node" in line


def test_store_pool_into_a_closed_pipe_stops_quietly(pool):
    cmd = [sys.executable, "-m", "bsr_io.cli", *_store_pool("probe", pool, "--tokens", "64")]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    assert proc.stdout is not None and proc.stderr is not None
    proc.stdout.close()  # `| head -0`: gone before the command prints
    err = proc.stderr.read().decode()
    assert proc.wait(timeout=120) == 141, err
    assert err == ""


# -- bench remote -------------------------------------------------------------------------
def _remote(*extra: str) -> list[str]:
    return ["bench", "remote", "--layout", "tiny", "--rounds", "1", *extra]


def test_bench_remote_state_under_w_chunks_ends_without_teardown_errors(tmp_path):
    # One chunk through W = 8 slots, a loopback pool of its own, stdout closed after the
    # first line: the summary after teardown meets the closed pipe (141), and stderr
    # holds nothing (Mooncake's setup log aside; the client closed before its pool).
    out = tmp_path / "r.json"
    cmd = [sys.executable, "-m", "bsr_lab.cli", *_remote("--size", "3KiB", "--window", "8")]
    proc = subprocess.Popen(
        [*cmd, "--json", str(out)], stdout=subprocess.PIPE, stderr=subprocess.PIPE
    )
    assert proc.stdout is not None and proc.stderr is not None
    first = proc.stdout.readline()
    proc.stdout.close()
    err = proc.stderr.read().decode()
    rc = proc.wait(timeout=180)
    assert first.startswith(b"loopback pool") and b"writing 1 chunks" in first
    assert rc == 141, err
    assert err == ""
    assert not out.exists()  # stopped at the summary, before the JSON


def test_bench_remote_state_under_w_chunks_json(tmp_path):
    # A subprocess: its loopback pool lives in a network namespace of its own, apart
    # from the module's pool (Mooncake keeps one transfer engine per process).
    out = tmp_path / "r.json"
    cmd = [sys.executable, "-m", "bsr_lab.cli", *_remote("--size", "3KiB", "--window", "8")]
    proc = subprocess.run([*cmd, "--json", str(out)], capture_output=True, text=True, timeout=180)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stderr == ""
    assert "outcome complete" in proc.stdout and f"wrote {out}" in proc.stdout
    doc = json.loads(out.read_text())
    assert doc["chunks"] == 1 and doc["outcome"] == "complete"
    # Through the slots one chunk occupies one slot, within the bound of W slots.
    assert doc["rws_peak_bytes"] == doc["slot_bytes"] < doc["rws_bound_bytes"]
    assert doc["rws_bound_bytes"] == 8 * doc["slot_bytes"]


@pytest.mark.parametrize(
    ("extra", "says"),
    [
        (["--window", "0"], "--window 0: must be at least 1"),
        (["--rounds", "0"], "--rounds 0: must be at least 1"),
        (["--io-threads", "0"], "--io-threads 0: must be at least 1"),
        (["--pool-timeout", "-1"], "--pool-timeout -1: must be positive"),
        (["--json", "/proc/bsr-io-nope/r.json"], "--json /proc/bsr-io-nope/r.json: cannot write"),
        (["--json", "."], "--json .: cannot write it: Is a directory"),
        (["--size", "64TiB"], "not enough memory: --size 64.00 TiB needs about"),
    ],
)
def test_bench_remote_bad_arguments_refused_before_a_pool(capsys, extra, says):
    assert lab_main(_remote("--size", "64KiB", *extra)) == 2
    assert says in one_line(capsys.readouterr().err)


def test_bench_remote_unreachable_pool_is_one_line(capfd):
    assert lab_main(_remote("--size", "64KiB", *_dead_pool(), "--pool-timeout", "2")) == 2
    line = one_line(capfd.readouterr().err)
    assert line.startswith("bsr-io: error: cannot reach the Mooncake master at 127.0.0.1:")
