"""The sweep and fault benchmarks end to end, at sizes CI can afford."""

from __future__ import annotations

import json

from bsr_lab.cli import main


def test_bench_sweep_rws_constant(tmp_path):
    out = tmp_path / "sweep.json"
    rc = main(
        [
            "bench",
            "sweep",
            "--layout",
            "tiny",
            "--tokens",
            "64,256,1024",
            "--window",
            "4",
            "--dir",
            str(tmp_path / "s"),
            "--ref-size",
            "8MiB",
            "--json",
            str(out),
            "--quiet",
        ]
    )
    assert rc == 0
    doc = json.loads(out.read_text())
    assert doc["layout"] == "tiny" and doc["window"] == 4
    rows = doc["rows"]
    assert [r["tokens"] for r in rows] == [64, 256, 1024]
    slot = rows[0]["rws_peak_bytes"] // 4
    # min(W, chunks) slots: 4 chunks -> 4 slots; 16 and 64 chunks -> still 4 slots.
    assert [r["rws_peak_bytes"] for r in rows] == [4 * slot] * 3
    for r in rows:
        assert r["outcome"] == "complete" and r["data_ok"] is True
        assert r["whole_plan_l1_peak_bytes"] == r["state_bytes"]
        assert r["whole_plan_at_budget"] == ("complete" if r["chunks"] <= 4 else "zero")
    assert doc["reference"]["engine_gib_s"] > 0


def test_bench_sweep_reports_the_slot_and_the_direct_path_side_by_side(tmp_path):
    """On records O_DIRECT can read in place: the slot path (forced, as a GPU destination
    takes it) holds exactly min(W, chunks) slots; the direct path, in the same run, uses
    none and its process grows by a few MiB (no ring made resident)."""
    out = tmp_path / "sweep.json"
    argv = ["bench", "sweep", "--layout", "deepseek-v4-flash", "--tokens", "256,1024"]
    argv += ["--window", "2", "--dir", str(tmp_path / "s"), "--ref-size", "8MiB"]
    rc = main([*argv, "--whole-plan-max", "0", "--json", str(out), "--quiet"])
    assert rc == 0
    doc = json.loads(out.read_text())
    slot = -(-doc["chunk_bytes"] // 4096) * 4096
    assert doc["machine_load"]["cpus"] >= 1
    for r in doc["rows"]:
        assert r["outcome"] == "complete" and r["data_ok"] is True and r["path"] == "slots"
        assert r["rws_peak_bytes"] == min(2, r["chunks"]) * slot
        assert r["vmhwm_growth_bytes"] >= r["rws_peak_bytes"], r
        d = r["direct"]
        assert d["outcome"] == "complete" and d["data_ok"] is True, d
        assert d["rws_peak_bytes"] == 0 and d["direct_chunks"] == r["chunks"], d
        assert d["vmhwm_growth_bytes"] <= 4 << 20, d


def test_bench_faults_subset(tmp_path):
    out = tmp_path / "faults.json"
    rc = main(
        [
            "bench",
            "faults",
            "--only",
            "clean,corruption-one-rank",
            "--json",
            str(out),
            "--dir",
            str(tmp_path / "f"),
        ]
    )
    assert rc == 0
    doc = json.loads(out.read_text())
    got = {s["name"]: (s["expected"], s["outcome"], s["data_ok"]) for s in doc["scenarios"]}
    assert got == {
        "clean": ("complete", "complete", True),
        "corruption-one-rank": ("zero", "zero", True),
    }


def test_a_scenario_fault_names_the_layouts_own_window_group():
    """The fault matrix runs on every layout: its window-group fault resolves to that
    layout's window group, and a group a layout lacks is refused rather than never
    firing (a scenario that could not fail)."""
    import pytest

    from bsr_io.model.layout import preset
    from bsr_lab.scenarios import WINDOW_GROUP, _groups_of

    fault = {"kind": "group_missing", "groups": [WINDOW_GROUP]}
    assert _groups_of(preset("tiny"), fault)["groups"] == ["window"]
    assert _groups_of(preset("deepseek-v4-flash"), fault)["groups"] == ["window_kv"]
    with pytest.raises(ValueError, match="lacks"):
        _groups_of(preset("deepseek-v4-flash"), {"kind": "group_missing", "groups": ["window"]})
