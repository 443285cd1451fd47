"""`bsr-lab bench model` end to end on a tiny model: rows, JSON, exit status."""

import json
import os

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")
pytest.importorskip("transformers")

from bsr_lab.cli import main  # noqa: E402


def test_bench_model_writes_rows(tmp_path, capsys):
    out = tmp_path / "rows.json"
    argv = [
        "bench",
        "model",
        "--prefix-tokens",
        "40,70",
        "--chunk-tokens",
        "16",
        "--window",
        "2",
        "--layers",
        "2",
        "--hidden",
        "64",
        "--heads",
        "4",
        "--kv-heads",
        "2",
        "--vocab",
        "256",
        "--repeat",
        "1",
        "--json",
        str(out),
    ]
    assert main(argv) == 0
    rows = json.loads(out.read_text())["rows"]
    chunk_bytes = 16 * 2 * 2 * 2 * 16 * 4  # tokens x layers x (K, V) x heads x dim x fp32
    assert [r["prefix_tokens"] for r in rows] == [40, 70]
    for r in rows:
        assert r["outcome"] == "complete" and r["bit_identical"] is True
        assert r["restored_tokens"] == r["prefix_tokens"] // 16 * 16
        assert r["rws_peak_bytes"] == 2 * chunk_bytes  # W slots: each hit has at least W chunks
        assert r["restore_ttft_s"] > 0 and r["recompute_ttft_s"] > 0
    assert "bit-identical" in capsys.readouterr().out


def test_bench_model_refuses_a_prefix_shorter_than_a_chunk(capsys):
    assert main(["bench", "model", "--prefix-tokens", "10", "--chunk-tokens", "16"]) == 2
    assert "at least one chunk" in capsys.readouterr().err
