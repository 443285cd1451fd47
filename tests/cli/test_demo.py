"""`bsr-io demo` end to end at a small size: two real rank processes, real files."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from bsr_io.cli import main
from bsr_io.cli.progress import ProgressWatcher, RankProgress


def test_demo_small_end_to_end(tmp_path, capsys):
    out = tmp_path / "demo.json"
    # 4 chunks of deepseek-v4-flash per rank, W=2: the half state still fills the window.
    rc = main(
        [
            "demo",
            "--state",
            "64MiB",
            "--window",
            "2",
            "--quiet",
            "--dir",
            str(tmp_path),
            "--json",
            str(out),
        ]
    )
    text = capsys.readouterr().out
    assert rc == 0, text
    doc = json.loads(out.read_text())
    assert doc["ranks"] == 2 and doc["chunks"] == 4 and doc["chunk_bytes"] == 16_408_576
    assert doc["checks"]["all_ok"], doc["checks"]
    runs = doc["runs"]
    slot = doc["slot_bytes"]
    # RWS is the window for both state sizes, on both ranks.
    rws = {x["rws_peak_bytes"] for x in runs["bsr"] + runs["bsr_half"]}
    assert rws == {2 * slot}
    # Measured peak RSS: the whole-plan restore (its L1 pool of the state) grew the
    # process by the state; BSR's by far less.
    for wp, bsr in zip(runs["whole_plan_big_l1"], runs["bsr"], strict=True):
        assert wp["vmhwm_growth_bytes"] >= doc["state_bytes"] * 3 // 4
        assert bsr["vmhwm_growth_bytes"] < doc["state_bytes"] // 2
    assert doc["half_state_bytes"] * 2 == doc["state_bytes"]
    assert all(x["data_ok"] for x in runs["bsr"])
    # Whole-plan at BSR's budget fails cleanly and names the L1 it needed.
    for x in runs["whole_plan_same_l1"]:
        assert x["outcome"] == "zero" and x["l1_required_bytes"] == doc["state_bytes"]
    for x in runs["whole_plan_big_l1"]:
        assert x["outcome"] == "complete" and x["l1_peak_bytes"] == doc["state_bytes"]
        assert x["data_ok"]
    # Fault round: zero on both ranks, then complete with the chunk served from L3.
    assert [x["outcome"] for x in runs["fault_no_l3_copy"]] == ["zero", "zero"]
    assert all(x["committed_tokens"] == 0 for x in runs["fault_no_l3_copy"])
    assert [x["outcome"] for x in runs["fault_l3_copy"]] == ["complete", "complete"]
    assert runs["fault_l3_copy"][1]["sources"].get("L3") == 1
    assert "L3" not in runs["fault_l3_copy"][0]["sources"]
    # Output names the figures; the temp store is gone.
    assert "whole-plan" in text and "the same" in text
    assert not list(tmp_path.glob("bsr-io-demo-*"))


def test_demo_bad_input(tmp_path, capsys):
    assert main(["demo", "--state", "1MiB", "--dir", str(tmp_path), "--quiet"]) == 2
    assert "at least 2" in capsys.readouterr().err
    assert main(["demo", "--window", "0", "--dir", str(tmp_path), "--quiet"]) == 2
    with pytest.raises(SystemExit):
        main(["demo", "--state", "lots"])


@pytest.mark.skipif(not os.path.isdir("/dev/shm"), reason="no /dev/shm tmpfs")
def test_demo_refuses_memory_dirs(capsys):
    # 4 chunks with W=2: an input the demo takes, so the refusal is the directory's.
    argv = ["demo", "--state", "64MiB", "--window", "2", "--dir", "/dev/shm", "--quiet"]
    assert main(argv) == 2
    assert "in memory" in capsys.readouterr().err
    assert not list(Path("/dev/shm").glob("bsr-io-demo-*"))


def test_rank_progress_files_and_watcher(tmp_path):
    a, b = RankProgress(tmp_path, 0), RankProgress(tmp_path, 1)
    a.phase("save", 100)
    b.phase("save", 100)
    a.advance(60)
    b.advance(100)
    w = ProgressWatcher(tmp_path, 2)
    w._read()
    w._draw()
    assert (1, "save") not in w._finished  # rank 0 is not done yet
    a.phase("restore", 50)  # moving on finishes the earlier phase
    w._read()
    w._draw()
    assert (1, "save") in w._finished
    assert set(a.durations) == {"save"} and a.durations["save"] >= 0
    RankProgress(None, 0).phase("nothing", 1)  # no directory: does nothing
    with ProgressWatcher(tmp_path / "quiet", 2, quiet=True) as q:
        assert q._thread is None
