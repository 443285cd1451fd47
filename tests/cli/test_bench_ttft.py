"""`bsr-lab bench ttft` at a tiny size: real files, real engine, fio, cold cache."""

from __future__ import annotations

import json

import pytest

from bsr_io.cli.fio import fio_available
from bsr_lab.cli import main

KEYS = ("naive_s", "fast_s", "fio_s", "speedup", "fast_vs_fio", "rws_naive_bytes", "rws_fast_bytes")


@pytest.mark.skipif(not fio_available(), reason="fio is not installed")
def test_ttft_tiny_json_and_plot(tmp_path, capsys):
    out, png = tmp_path / "ttft.json", tmp_path / "ttft.png"
    # 8 chunks of the tiny layout (2,112 B each, not a multiple of 4096), W=3.
    argv = ["bench", "ttft", "--layout", "tiny", "--tokens", "128", "--window", "3"]
    argv += ["--dir", str(tmp_path), "--quiet", "--json", str(out), "--plot", str(png)]
    rc = main(argv)
    assert rc == 0
    doc = json.loads(out.read_text())
    for k in KEYS:
        assert k in doc, k
        assert doc[k] > 0
    assert doc["chunks"] == 8 and doc["data_ok"] and doc["fast_vs_fio_paired"] > 0
    # Measured staging (peak-RSS growth): present for both paths; at 8 tiny chunks it is
    # too small to compare (bench ttft at a real size does).
    assert all(isinstance(doc[f"staging_vmhwm_{p}_bytes"], int) for p in ("naive", "fast"))
    # The naive path stages the whole state; the fast path fills its W slots, no more.
    assert doc["rws_naive_bytes"] == doc["state_bytes"]
    assert doc["rws_fast_bytes"] == 3 * 4096
    assert png.read_bytes()[:4] == b"\x89PNG"
    assert "speedup naive/fast" in capsys.readouterr().out
    assert not list(tmp_path.glob("bsr-io-ttft-*"))  # cleaned up


def test_ttft_refuses_when_disk_is_too_small(tmp_path, capsys):
    rc = main(["bench", "ttft", "--tokens", str(1 << 40), "--dir", str(tmp_path), "--quiet"])
    assert rc == 2
    assert "not enough free space" in capsys.readouterr().err


def test_ttft_bad_arguments(tmp_path, capsys):
    assert main(["bench", "ttft", "--tokens", "10", "--dir", str(tmp_path)]) == 2
    assert "less than one chunk" in capsys.readouterr().err
    assert main(["bench", "ttft", "--window", "0", "--dir", str(tmp_path)]) == 2
    assert main(["bench", "ttft", "--rounds", "0", "--dir", str(tmp_path)]) == 2


@pytest.mark.skipif(not fio_available(), reason="fio is not installed")
def test_ttft_skip_naive(tmp_path, capsys):
    out = tmp_path / "ttft.json"
    argv = ["bench", "ttft", "--layout", "tiny", "--tokens", "64", "--window", "2", "--quiet"]
    argv += ["--dir", str(tmp_path), "--skip-naive", "--json", str(out)]
    assert main(argv) == 0
    doc = json.loads(out.read_text())
    assert doc["naive_s"] is None and doc["speedup"] is None and not doc["naive_measured"]
    assert doc["fast_s"] > 0 and doc["fio_s"] > 0
    assert doc["rws_naive_bytes"] == doc["state_bytes"]  # the L1 it would need
    assert "skipped" in capsys.readouterr().out
