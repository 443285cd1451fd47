"""Plots: PNG files from benchmark documents; bad documents are refused clearly."""

from __future__ import annotations

import pytest

from bsr_lab.plots import plot_sweep, plot_ttft

PNG = b"\x89PNG\r\n\x1a\n"
CHUNK = 16_408_576


def _sweep(measured_up_to: int = 65536) -> dict:
    rows = []
    for tokens in (8192, 32768, 65536, 131072):
        state = tokens // 256 * CHUNK
        rws = min(32, tokens // 256) * CHUNK
        rows.append(
            {
                "tokens": tokens,
                "state_bytes": state,
                "chunk_bytes": CHUNK,
                "rws_peak_bytes": rws,
                "vmhwm_growth_bytes": rws + (40 << 20),
                "restore_s": 1.0,
                "gib_s": 1.0,
                "outcome": "complete",
                "whole_plan_l1_peak_bytes": state,
                "whole_plan_measured": tokens <= measured_up_to,
                "whole_plan_vmhwm_growth_bytes": state + (60 << 20)
                if tokens <= measured_up_to
                else None,
            }
        )
    return {
        "layout": "deepseek-v4-flash",
        "window": 32,
        "chunk_bytes": CHUNK,
        "ranks": 2,
        "rows": rows,
    }


def _ttft() -> dict:
    return {
        "layout": "deepseek-v4-flash-tp2",
        "tokens": 8192,
        "window": 32,
        "state_bytes": 32 * CHUNK,
        "naive_s": 1.0,
        "fast_s": 0.5,
        "fio_s": 0.45,
        "rws_naive_bytes": 32 * CHUNK,
        "rws_fast_bytes": 32 * CHUNK,
    }


def test_plot_sweep_writes_png(tmp_path):
    for doc, name in ((_sweep(), "a.png"), (_sweep(0), "sub/b.png")):
        out = plot_sweep(doc, tmp_path / name)
        assert out.read_bytes()[:8] == PNG and out.stat().st_size > 10_000


def test_plot_ttft_writes_png(tmp_path):
    out = plot_ttft(_ttft(), tmp_path / "t.png")
    assert out.read_bytes()[:8] == PNG and out.stat().st_size > 10_000


def test_bad_documents(tmp_path):
    with pytest.raises(ValueError, match="missing rows"):
        plot_sweep({"window": 32, "chunk_bytes": CHUNK}, tmp_path / "x.png")
    with pytest.raises(ValueError, match="no rows"):
        plot_sweep({**_sweep(), "rows": []}, tmp_path / "x.png")
    doc = _ttft()
    del doc["fio_s"]
    with pytest.raises(ValueError, match="fio_s"):
        plot_ttft(doc, tmp_path / "x.png")
    with pytest.raises(ValueError, match="PNG"):
        plot_ttft(_ttft(), tmp_path / "x.svg")


def test_plot_ttft_without_naive(tmp_path):
    doc = {**_ttft(), "naive_s": None}
    out = plot_ttft(doc, tmp_path / "t.png")
    assert out.read_bytes()[:8] == PNG
