"""Process peak memory during a restore: BSR stays within its window, whole-plan does not.

Each restore runs in a fresh process (bsr_io.cli.ranks.launch with one rank), so other
tests cannot disturb its VmHWM. The destination KV cache is allocated and touched
before the baseline is read; the engine (the staging ring) is created after it, so
the growth includes the ring itself.
"""

from __future__ import annotations

from bsr_io.cli.ranks import launch

MiB = 1 << 20
KW = {
    "layout": "deepseek-v4-flash",
    "layout_kw": {"chunk_tokens": 64, "block_tokens": 16},
    "tokens": 64 * 64,  # 64 chunks of ~4 MiB: a 250 MiB state, 32x the window
    "window": 2,
    "check_data": False,
    "direct_reads": False,  # the staging bound is what this measures: through the slots
}


def test_vmhwm_growth_bounded_by_window(tmp_path):
    (bsr,) = launch(1, "bsr_lab.scenarios:restore_on_rank", {"root": str(tmp_path), **KW})
    assert bsr["outcome"] == "complete", bsr
    state = bsr["l1_required_bytes"]
    assert state >= 16 * bsr["rws_peak_bytes"]
    assert bsr["rws_peak_bytes"] == 2 * bsr["slot_bytes"]
    assert bsr["vmhwm_growth_bytes"] <= bsr["rws_peak_bytes"] + 64 * MiB, bsr

    # Control: the whole-plan baseline on the same state grows by at least the state,
    # so this measurement can tell the two apart.
    (wp,) = launch(
        1,
        "bsr_lab.scenarios:restore_on_rank",
        {"root": str(tmp_path), **KW, "fill": False, "mode": "whole_plan"},
    )
    assert wp["outcome"] == "complete", wp
    assert wp["vmhwm_growth_bytes"] >= state, wp


def test_direct_reads_stage_nothing(tmp_path):
    # Read straight into the cache's blocks: no slot is leased, and the ring of 8 slots
    # (31 MiB) is never made resident: the process grows by a few MiB at most (it grew by
    # the whole ring when the arena was populated at the engine's start). The bytes are
    # checked.
    kw = {"root": str(tmp_path), **KW, "window": 8, "direct_reads": True, "check_data": True}
    (bsr,) = launch(1, "bsr_lab.scenarios:restore_on_rank", kw)
    assert bsr["outcome"] == "complete" and bsr["data_ok"], bsr
    assert bsr["rws_peak_bytes"] == 0 and bsr["timings"]["direct_chunks"] == 64
    assert 8 * bsr["slot_bytes"] > 16 * MiB
    assert bsr["vmhwm_growth_bytes"] <= 4 * MiB, bsr
