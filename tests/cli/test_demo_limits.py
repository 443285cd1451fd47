"""`bsr-io demo` on any choice its --help offers: a state of too many tiny records is
refused (or, by default, shrunk to fit and said so), and a demo stopped by SIGTERM or
SIGHUP removes its temp store and its ranks, as Ctrl-C does."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest

from bsr_io.cli import main
from bsr_io.cli.demo import DEFAULT_STATE, MAX_RECORDS, state_chunks
from bsr_io.model.layout import preset

TINY = preset("tiny").chunk_bytes  # 2,112 B


def test_a_state_of_too_many_tiny_records_is_refused(tmp_path, capsys):
    argv = ["demo", "--layout", "tiny", "--state", "1GiB", "--dir", str(tmp_path), "--quiet"]
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert "--state 1.00 GiB with --layout tiny is 508,400 records" in err
    assert f"at most {MAX_RECORDS:,}" in err and "leave --state out" in err
    assert list(tmp_path.iterdir()) == []  # refused before anything was written


def test_the_default_state_shrinks_to_the_record_limit_and_says_so(capsys):
    assert state_chunks(None, TINY, "tiny") == MAX_RECORDS
    assert "the state is 4,096 chunks (8.25 MiB) per rank" in capsys.readouterr().err
    # A layout whose 1 GiB is few records keeps the 1 GiB default, silently.
    big = preset("deepseek-v4-flash").chunk_bytes
    assert state_chunks(None, big, "deepseek-v4-flash") == DEFAULT_STATE // big
    assert capsys.readouterr().err == ""
    # An explicit state at the limit is taken as it is.
    assert state_chunks(MAX_RECORDS * TINY, TINY, "tiny") == MAX_RECORDS


def _store_files(tmp_path: Path) -> list[Path]:
    return [p for p in tmp_path.glob("bsr-io-demo-*/l2/**/*") if p.is_file()]


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGHUP])
def test_a_demo_stopped_by_a_signal_removes_its_store_and_ranks(tmp_path, sig):
    cmd = [sys.executable, "-m", "bsr_io.cli", "demo", "--layout", "tiny"]
    cmd += ["--dir", str(tmp_path), "--quiet"]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        # Stop it once the ranks are writing records (none is written until they run).
        deadline = time.monotonic() + 300
        while not _store_files(tmp_path):
            assert proc.poll() is None, proc.communicate()
            assert time.monotonic() < deadline, "the ranks wrote no record"
            time.sleep(0.05)
        ranks = psutil.Process(proc.pid).children(recursive=True)
        assert ranks, "the demo's ranks are its children"
        os.kill(proc.pid, sig)
        _, err = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode == 128 + sig, err
    assert list(tmp_path.iterdir()) == [], "the temp store was left behind"
    gone, alive = psutil.wait_procs(ranks, timeout=30)
    assert not alive, f"ranks outlived the demo: {alive}"
