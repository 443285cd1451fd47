"""`bsr-lab bench ttft --sweep`: sizes, the fit, the phase breakdown and the store-size
comparison, at the smallest real size (one and two 16 MiB chunks: the smallest layout
fio can read in place), with real files, the engine, fio on huge pages and a cold cache."""

from __future__ import annotations

import gzip
import json
import os

import pytest

from bsr_io.cli.fio import fio_available
from bsr_io.errors import BsrValueError
from bsr_lab.bench.ttft_fit import fit_line, fit_with_interval, phases
from bsr_lab.bench.ttft_sweep import goal_for, sweep_chunks
from bsr_lab.cli import main

CHUNK = 16408576  # deepseek-v4-flash-tp2
PHASES = ("discovery", "agreement", "setup", "first_read", "stream", "last_chunk", "commit")


@pytest.mark.skipif(not fio_available(), reason="fio is not installed")
@pytest.mark.skipif(os.geteuid() != 0, reason="fio on huge pages needs root")
def test_sweep_smoke_with_compare_and_store_scale(tmp_path, capsys):
    out = tmp_path / "sweep.json"
    argv = ["bench", "ttft", "--sweep", "16MiB:32MiB", "--rounds", "1", "--window", "4"]
    argv += ["--compare-inflight", "0", "--store-records", "1010", "--seed", "3"]
    argv += ["--dir", str(tmp_path), "--quiet", "--json", str(out)]
    assert main(argv) == 0
    doc = json.loads(out.read_text())
    assert [r["chunks"] for r in doc["sizes"]] == [1, 2]
    assert doc["engine"]["inflight_bytes"] == 32 << 20 and doc["compare_inflight_bytes"] == 0
    for r in doc["sizes"]:
        assert r["fast_s"] > 0 and r["fio_hugemem_s"] > 0 and r["fast_compare_s"] > 0
        assert r["fast_over_fio_hugemem"] == r["fast_s"] / r["fio_hugemem_s"]
        assert set(PHASES) <= set(r["fast_phases_ms"])
        assert r["fast_phases_ms"]["drive_busy"] > 0  # from the engine's trace
        # The drive's limit in each round: the faster of fio on the records and on one
        # file of the same bytes (each round's pair, so never above either median).
        assert r["fio_file_s"] > 0
        assert r["drive_s"] <= min(r["fio_hugemem_s"], r["fio_file_s"])
        assert r["fast_over_drive"] == r["fast_s"] / r["drive_s"]
        assert r["target_fast_over_drive"] is None  # below 64 MiB: no goal
        # CPU per GiB, with xxh3 over the same bytes beside it (the restore hashes them
        # all, so its own CPU is the larger of the two but for timer noise).
        assert r["fast_cpu_s_per_gib"] > 0 and r["hash_floor_cpu_s_per_gib"] > 0
        assert r["cpu_within_target"] == (r["fast_cpu_beyond_hash_s_per_gib"] <= 0.01)
    # fio's depth: the fastest of those scanned, each scanned one timed.
    scan = doc["fio_depth_scan_s"]
    assert set(scan) == {"4", "8", "16", "32"} and all(s > 0 for s in scan.values())
    assert scan[str(doc["fio_depth"])] == min(scan.values())
    fit = doc["fit"]["fast"]
    lo, hi = fit["intercept_95_s"]
    assert lo <= fit["intercept_s"] <= hi and doc["fixed_cost_s"] == fit["intercept_s"]
    scale = doc["store_scale"]
    assert scale["records"] == {"small": 1000, "large": 1010}
    assert set(scale["cases"]) == {"state_1", "state_2", "tiny_64"}
    assert all(c["large_over_small_paired"] > 0 for c in scale["cases"].values())
    assert doc["load"]["loadavg_1m_max"] >= 0 and doc["cold_cache"] and "machine" in doc
    text = capsys.readouterr().out
    assert "fixed cost fast:" in text and "store of 1,010 records" in text
    assert not list(tmp_path.glob("bsr-io-ttft-*"))  # cleaned up
    # Every round's record goes beside the summary, compressed.
    assert "per_round" not in doc["sizes"][0] and doc["rounds_file"] == "sweep.trace.json.gz"
    rounds = json.loads(gzip.decompress((tmp_path / doc["rounds_file"]).read_bytes()))
    assert len(rounds["sizes"]["2"]["fast"]) == 1 and set(rounds["store_scale"]) == {
        "state_1",
        "state_2",
        "tiny_64",
    }


def test_sweep_sizes_double_in_whole_chunks():
    assert sweep_chunks("16MiB:8GiB", CHUNK) == [1, 2, 4, 8, 16, 33, 65, 131, 262, 524]
    assert sweep_chunks("1KiB:4KiB", CHUNK) == [1]  # below a chunk: one chunk, once
    for bad in ("16MiB", "8GiB:16MiB", "0:1GiB", "x:1GiB"):
        with pytest.raises(BsrValueError):
            sweep_chunks(bad, CHUNK)


def test_sweep_bad_arguments(tmp_path, capsys):
    assert main(["bench", "ttft", "--sweep", "32MiB:16MiB", "--dir", str(tmp_path)]) == 2
    assert "MIN <= MAX" in capsys.readouterr().err
    assert main(["bench", "ttft", "--compare-inflight", "0", "--dir", str(tmp_path)]) == 2
    assert "go with --sweep" in capsys.readouterr().err


def test_goals_by_size():
    assert goal_for(16 * CHUNK) == 1.03 and goal_for(4 * CHUNK) == 1.10
    assert goal_for(2 * CHUNK) is None


def test_the_fit_finds_a_known_line_and_its_interval_holds_it():
    xs = [float(1 << k) for k in range(20, 30)] * 3
    ys = [0.002 + x * 1e-9 for x in xs]
    a, b = fit_line(xs, ys)
    assert a == pytest.approx(0.002) and b == pytest.approx(1e-9)
    f = fit_with_interval(xs, [y * (1.01 if i % 2 else 0.99) for i, y in enumerate(ys)], 1)
    lo, hi = f["intercept_95_s"]
    assert lo <= f["intercept_s"] <= hi and lo < hi


def test_phases_add_up_to_the_restore():
    marks = {"start": 1.0, "begin": 1.001, "registered": 1.002, "first_submitted": 1.003}
    marks |= {"first_hash": 1.010, "last_hash": 1.020, "end": 1.022, "installed": 1.023}
    marks |= {"committed": 1.024}
    span = {"first_kernel_submit": 1.0031, "last_complete": 1.021}
    p = phases(0.99, {"discover_s": 0.008, "agree_s": 0.001}, marks, span, 1.025)
    total = sum(p[k] for k in (*PHASES, "other"))
    assert total == pytest.approx(35.0)  # ms, probe start to restore end
    assert p["first_read"] == pytest.approx(7.0) and p["last_chunk"] == pytest.approx(2.0)
    assert p["after_drive"] == pytest.approx(1.0) and p["registration"] == pytest.approx(1.0)
