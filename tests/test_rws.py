"""Process peak memory during a restore: BSR stays within its window, whole-plan does not.

Each restore runs in a fresh process (bsr_io.testing.ranks.launch with one rank), so other
tests cannot disturb its VmHWM. The destination KV cache is allocated and touched
before the baseline is read; the engine (the staging ring) is created after it, so
the growth includes the ring itself.
"""

from __future__ import annotations

from bsr_io.testing.ranks import launch

MiB = 1 << 20
KW = {
    "layout": "deepseek-v4-flash",
    "layout_kw": {"chunk_tokens": 64, "block_tokens": 16},
    "tokens": 64 * 64,  # 64 chunks of ~4 MiB: a 250 MiB state, 32x the window
    "window": 2,
    "check_data": False,
}


def test_vmhwm_growth_bounded_by_window(tmp_path):
    (bsr,) = launch(1, "bsr_io.testing.scenarios:restore_on_rank", {"root": str(tmp_path), **KW})
    assert bsr["outcome"] == "complete", bsr
    state = bsr["l1_required_bytes"]
    assert state >= 16 * bsr["rws_peak_bytes"]
    assert bsr["rws_peak_bytes"] == 2 * bsr["slot_bytes"]
    assert bsr["vmhwm_growth_bytes"] <= bsr["rws_peak_bytes"] + 64 * MiB, bsr

    # Control: the whole-plan baseline on the same state grows by at least the state,
    # so this measurement can tell the two apart.
    (wp,) = launch(
        1,
        "bsr_io.testing.scenarios:restore_on_rank",
        {"root": str(tmp_path), **KW, "fill": False, "mode": "whole_plan"},
    )
    assert wp["outcome"] == "complete", wp
    assert wp["vmhwm_growth_bytes"] >= state, wp
