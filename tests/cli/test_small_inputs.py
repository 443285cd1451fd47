"""Every command on the small inputs its `--help` offers (the tiny layout, a state of a
few chunks): it runs and reports figures that hold, or refuses up front in one line
that names the argument and what is allowed (exit status 2)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from cli_errors import one_line

from bsr_io.cli import main
from bsr_io.cli.demo.report import print_report
from bsr_io.cli.fio import fio_available
from bsr_io.model.layout import preset
from bsr_lab.cli import main as lab_main

TINY = preset("tiny")


# -- bench store ------------------------------------------------------------------------
def test_bench_store_tiny_layout_runs(tmp_path, capsys):
    # 40 chunks of 2,112 B (not whole 4 KiB blocks) through W=4 writers: each writer owns
    # its slot, and the raw file puts every chunk on a block boundary.
    out = tmp_path / "r.json"
    argv = ["bench", "store", "--layout", "tiny", "--size", str(40 * TINY.chunk_bytes)]
    argv += ["--window", "4", "--rounds", "1", "--dir", str(tmp_path), "--json", str(out)]
    assert main(argv) == 0, capsys.readouterr().err
    rep = json.loads(out.read_text())
    assert rep["layout"] == "tiny" and rep["chunks"] == 40
    assert rep["size_bytes"] == 40 * TINY.chunk_bytes
    assert rep["verified_reads"] == 40  # every record written and read back verified
    assert rep["raw_stride_bytes"] == 4096
    for name in ("store", "raw"):
        assert rep["read_gib_s"][name] > 0 and rep["write_gib_s"][name] > 0
    assert list(tmp_path.iterdir()) == [out]


def test_bench_store_one_tiny_chunk_more_slots_than_chunks(tmp_path, capsys):
    out = tmp_path / "r.json"
    argv = ["bench", "store", "--layout", "tiny", "--size", "4KiB", "--window", "8"]
    argv += ["--rounds", "1", "--dir", str(tmp_path), "--json", str(out)]
    assert main(argv) == 0, capsys.readouterr().err
    rep = json.loads(out.read_text())
    assert rep["chunks"] == 1 and rep["verified_reads"] == 1


def test_bench_store_size_under_a_chunk_is_refused(tmp_path, capsys):
    argv = ["bench", "store", "--layout", "tiny", "--size", "1KiB", "--dir", str(tmp_path)]
    assert main(argv) == 2
    assert "--size >= one chunk (2112 bytes)" in one_line(capsys.readouterr().err)


# -- bench ssd --------------------------------------------------------------------------
@pytest.mark.parametrize("size", ["64KiB", "5000"])
def test_bench_ssd_file_under_fios_request_refused_in_one_line(tmp_path, capsys, size):
    assert lab_main(["bench", "ssd", "--size", size, "--rounds", "1", "--dir", str(tmp_path)]) == 2
    line = one_line(capsys.readouterr().err)
    assert "must be at least 1.00 MiB (fio's request)" in line and line.count("--size") == 1
    assert not list(tmp_path.iterdir())  # refused before the test file was written


# -- bench stripe -----------------------------------------------------------------------
def test_bench_stripe_tiny_layout_refused_in_one_clear_line(tmp_path, capsys):
    dirs = [str(tmp_path / "a"), str(tmp_path / "b")]
    assert lab_main(["bench", "stripe", "--layout", "tiny", "--dirs", *dirs, "--quiet"]) == 2
    line = one_line(capsys.readouterr().err)
    assert line.startswith("bsr-io: error: --layout tiny: its 2112-byte chunk")
    assert "deepseek-v4-flash, llama-3.1-8b" in line
    assert "its chunk is not" not in line
    assert not (tmp_path / "a").exists()  # refused before anything was made


# -- demo -------------------------------------------------------------------------------
def test_demo_state_under_two_windows_refused_up_front(tmp_path, capsys):
    # 128 MiB is 8 chunks of deepseek-v4-flash: under 2 x W = 64, the half state would not
    # fill the window and whole-plan at W chunks of L1 would stage the whole state.
    assert main(["demo", "--state", "128MiB", "--dir", str(tmp_path), "--quiet"]) == 2
    line = one_line(capsys.readouterr().err)
    assert "--state 128.00 MiB holds 8 chunk(s)" in line
    assert "--window 32" in line and "at least 2 x W = 64" in line
    assert "--window <= 4" in line
    assert not list(tmp_path.iterdir())  # no store was made


def _run(outcome: str, state: int, **kw: object) -> dict[str, object]:
    run: dict[str, object] = {
        "outcome": outcome,
        "state_bytes": state,
        "rws_peak_bytes": kw.get("rws", state),
        "l1_peak_bytes": kw.get("l1_peak", state),
        "l1_bytes": kw.get("l1", state),
        "l1_required_bytes": state,
        "gib_s": 1.0,
        "time_to_commit_s": 0.1,
        "vmhwm_growth_bytes": 0,
        "committed_tokens": 64 if outcome == "complete" else 0,
        "sources": {},
        "reason": "" if outcome == "complete" else "no room",
    }
    return run


def _doc(small_outcome: str) -> dict[str, object]:
    chunk, w, state = 4096, 4, 4 * 4096
    return {
        "layout": "tiny",
        "ranks": 2,
        "window": w,
        "chunk_bytes": chunk,
        "slot_bytes": chunk,
        "backend": "pread",
        "chunks": 4,
        "tokens": 64,
        "state_bytes": state,
        "half_state_bytes": state // 2,
        "save_s": [0.1, 0.1],
        "save_staging_peak_bytes": [chunk, chunk],
        "runs": {
            "bsr": [_run("complete", state)] * 2,
            "bsr_half": [_run("complete", state // 2)] * 2,
            "whole_plan_same_l1": [_run(small_outcome, state, l1=w * chunk)] * 2,
            "whole_plan_big_l1": [_run("complete", state)] * 2,
            "fault_no_l3_copy": [_run("zero", state)] * 2,
            "fault_l3_copy": [_run("complete", state)] * 2,
        },
        "fault": {"chunk": 2, "rank": 1},
        "checks": {"all_ok": True},
        "store_kept": False,
        "store_dir": None,
        "wall_s": 1.0,
    }


def test_demo_row_of_a_baseline_that_succeeds_does_not_say_it_fails(capsys):
    print_report(_doc("complete"))
    row = next(x for x in capsys.readouterr().out.splitlines() if "whole-plan, L1 = 16" in x)
    assert "complete/complete" in row and "fails cleanly" not in row


def test_demo_row_of_a_baseline_that_fails_says_so(capsys):
    print_report(_doc("zero"))
    out = capsys.readouterr().out
    assert "zero/zero" in out and "fails cleanly" in out


# -- bench sweep ------------------------------------------------------------------------
def test_bench_sweep_tiny_reference_scales_with_the_state(tmp_path, capsys):
    out = tmp_path / "sweep.json"
    argv = ["bench", "sweep", "--layout", "tiny", "--tokens", "64,256", "--window", "4"]
    argv += ["--dir", str(tmp_path / "s"), "--json", str(out), "--quiet"]
    assert lab_main(argv) == 0, capsys.readouterr().err
    doc = json.loads(out.read_text())
    top = doc["rows"][-1]["state_bytes"]  # 16 chunks of 2,112 B
    assert top == 16 * TINY.chunk_bytes
    # The reference reads the largest state's bytes (in whole 4 KiB slots), not 2 GiB.
    assert doc["reference"]["size_bytes"] == top // 4096 * 4096
    assert doc["reference"]["engine_gib_s"] > 0


def test_bench_sweep_refuses_tokens_under_a_chunk_and_unknown_layouts(tmp_path, capsys):
    argv = ["bench", "sweep", "--layout", "tiny", "--tokens", "8,64", "--dir", str(tmp_path)]
    assert lab_main(argv) == 2
    line = one_line(capsys.readouterr().err)
    assert "--tokens 8 is less than one chunk (16 tokens of tiny)" in line
    with pytest.raises(SystemExit) as exc:
        lab_main(["bench", "sweep", "--layout", "nope", "--dir", str(tmp_path)])
    assert exc.value.code == 2
    assert "argument --layout: invalid choice: 'nope'" in capsys.readouterr().err
    assert not list(Path(tmp_path).iterdir())


# -- bench ttft and bench ceiling: targets on small inputs --------------------------------
@pytest.mark.skipif(not fio_available(), reason="fio is not installed")
def test_bench_ttft_small_input_says_target_not_applicable(tmp_path, capsys):
    out = tmp_path / "ttft.json"
    argv = ["bench", "ttft", "--layout", "tiny", "--tokens", "64", "--window", "2"]
    argv += ["--rounds", "1", "--dir", str(tmp_path), "--quiet", "--json", str(out)]
    assert lab_main(argv) == 0
    text = capsys.readouterr().out
    doc = json.loads(out.read_text())
    assert "chunks are under 1.00 MiB" in doc["target_not_applicable"]
    assert doc["fast_within_target"] is None and doc["fast_cpu_within_target"] is None
    assert doc["fast_over_fio_hugemem_within_target"] is None
    assert "target not applicable: tiny's 2.06 KiB chunks" in text
    assert "NOT met" not in text


@pytest.mark.skipif(not Path("/dev/shm").is_dir(), reason="no /dev/shm tmpfs")
def test_bench_ceiling_small_input_says_target_not_applicable(tmp_path, capsys):
    out = tmp_path / "ceiling.json"
    argv = ["bench", "ceiling", "--tokens", "1024", "--window", "2", "--rounds", "1"]
    assert lab_main([*argv, "--quiet", "--json", str(out)]) == 0
    text = capsys.readouterr().out
    doc = json.loads(out.read_text())
    # 4 chunks of deepseek-v4-flash: 62.59 MiB, far from a steady state.
    assert doc["goal_not_applicable"].startswith("4 chunk(s) (62.59 MiB) are too few")
    assert "--tokens >= 16896" in doc["goal_not_applicable"]
    assert doc["goal_met"] is None and doc["goal_cpu_met"] is None
    assert doc["goal_own_cpu_met"] is None
    assert "(goal >= 0.85: target not applicable: 4 chunk(s)" in text
    assert "NOT met" not in text


def test_targets_apply_to_a_steady_state_only():
    from bsr_lab.targets import not_applicable, verdict

    ds = preset("deepseek-v4-flash")
    assert not_applicable(ds, 128, 32) is None  # 2 GiB, the window refilled 4 times
    assert "too few" in (not_applicable(ds, 65, 32) or "")  # 1 GiB, fewer than 4 x W
    assert "too few" in (not_applicable(ds, 40, 2) or "")  # under 1 GiB
    assert "chunks are under" in (not_applicable(TINY, 10**6, 2) or "")
    assert verdict(True, None) == "met" and verdict(False, None) == "NOT met"
    assert verdict(False, "small") == "target not applicable: small"
    assert verdict(None, "small", again=True) == "target not applicable, as above"
