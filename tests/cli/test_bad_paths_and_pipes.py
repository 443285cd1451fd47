"""`bsr-io store` commands on a DIR that cannot be a store (a file, a path under /proc)
and with stdout closed early (`| head`): one line and exit status 2, or a quiet stop
(141, as a command ended by SIGPIPE), never a traceback."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
from cli_errors import one_line

from bsr_io.cli import main


def _fill(target: Path | str, *extra: str) -> list[str]:
    return ["store", "fill", str(target), "--layout", "tiny", "--tokens", "64", *extra]


def test_fill_into_a_file_is_one_line(tmp_path, capsys):
    f = tmp_path / "afile"
    f.write_bytes(b"x")
    assert main(_fill(f)) == 2
    line = one_line(capsys.readouterr().err)
    assert line.startswith(f"bsr-io: error: cannot create or open store directory {f}")
    assert "Not a directory" in line
    assert f.read_bytes() == b"x"


@pytest.mark.skipif(not Path("/proc/self").is_dir(), reason="no /proc")
def test_fill_under_proc_is_one_line(capsys):
    assert main(_fill("/proc/bsr-io-no-such-dir")) == 2
    line = one_line(capsys.readouterr().err)
    assert "cannot create or open store directory /proc/bsr-io-no-such-dir" in line


@pytest.mark.parametrize("cmd", ["stats", "verify"])
def test_other_store_commands_on_a_file_are_one_line(tmp_path, capsys, cmd):
    f = tmp_path / "afile"
    f.write_bytes(b"x")
    assert main(["store", cmd, str(f)]) == 2
    assert "is not a bsr-io store" in one_line(capsys.readouterr().err)


def test_fill_rank_outside_world_is_refused(tmp_path, capsys):
    assert main(_fill(tmp_path, "--rank", "2", "--world-size", "2")) == 2
    line = one_line(capsys.readouterr().err)
    assert "0 <= --rank < --world-size" in line
    assert not list(tmp_path.iterdir())


def test_fill_quiet_prints_the_summary_only(tmp_path, capsys):
    assert main(_fill(tmp_path, "--quiet")) == 0
    out = capsys.readouterr().out.splitlines()
    assert out == ["seed 0: 4 chunks of tiny (64 tokens, rank 0/1, 24.25 KiB)"]
    assert len(list((tmp_path / "chunks").rglob("*.chunk"))) == 4


def test_fill_into_a_closed_pipe_stops_quietly(tmp_path):
    # `bsr-io store fill ... | head -1`: the reader goes away after one line.
    cmd = [sys.executable, "-m", "bsr_io.cli", *_fill(tmp_path / "s")]
    cmd[-1] = "16000"  # 1000 paths, ~140 KB: more than a pipe holds once head is gone
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=env)
    assert proc.stdout is not None and proc.stderr is not None
    first = proc.stdout.readline()
    proc.stdout.close()
    err = proc.stderr.read().decode()
    rc = proc.wait(timeout=120)
    assert first.startswith(b"seed 0: 1000 chunks of tiny")
    assert rc == 141, err
    assert err == ""  # no traceback, no "Broken pipe", no "Exception ignored"
    # Every record was written before the listing began.
    assert len(list((tmp_path / "s" / "chunks").rglob("*.chunk"))) == 1000
