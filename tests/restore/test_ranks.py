"""All-or-nothing commit on real multi-process torch.distributed (gloo) groups.

Each scenario runs every rank as its own process; faults come from bsr_io.faults
(the documented test double) or, for the killed rank, a SIGKILL at a chosen chunk.
"""

from __future__ import annotations

import pytest

from bsr_io.cli.ranks import launch
from bsr_lab.scenarios import FAULT_MATRIX

TARGET = "bsr_lab.scenarios:restore_on_rank"
TOKENS = 12 * 16  # 12 chunks of the tiny layout


def _run(tmp_path, world, kw, **env):
    return launch(
        world,
        TARGET,
        {"root": str(tmp_path), "tokens": TOKENS, "window": 3, **kw},
        timeout_s=120,
        env={"BSR_IO_EXIT_WAIT_S": "5", **env},
    )


@pytest.mark.parametrize("case", FAULT_MATRIX, ids=[c["name"] for c in FAULT_MATRIX])
def test_fault_matrix_two_ranks(tmp_path, case):
    results = _run(tmp_path, 2, case["kw"])
    if case.get("survivors_only"):
        killed = case["kw"]["kill_rank"]
        assert results[killed].get("exit_code") not in (0, None)
        results = [r for i, r in enumerate(results) if i != killed]
    for r in results:
        assert "outcome" in r, f"rank failed: {r}"
        assert r["outcome"] == case["expected"], r
    outcomes = {(r["outcome"], r["committed_tokens"]) for r in results}
    assert len(outcomes) == 1, f"rank-asymmetric result: {results}"
    if case["expected"] == "complete":
        want = case.get("committed_chunks", TOKENS // 16)
        for r in results:
            assert r["committed_chunks"] == want
            assert r["data_ok"] is True
            assert r["rws_peak_bytes"] == 3 * r["slot_bytes"]  # W=3 fills: 12 chunks
    else:
        assert all(r["committed_tokens"] == 0 and r["reason"] for r in results)


def test_fallback_is_reported(tmp_path):
    kw = {"l3": "copy", "faults": [{"kind": "error", "tier": "L2", "chunks": [3], "ranks": [1]}]}
    r0, r1 = _run(tmp_path, 2, kw)
    assert r0["fallbacks"] == 0 and r1["fallbacks"] == 1 and r1["fallback_tiers"] == ["L3"]


def test_four_ranks_clean_and_one_failure(tmp_path):
    results = _run(tmp_path / "a", 4, {})
    assert [r["outcome"] for r in results] == ["complete"] * 4
    assert all(r["data_ok"] for r in results)
    bad = {"faults": [{"kind": "error", "tier": "L2", "chunks": [9], "ranks": [2]}]}
    results = _run(tmp_path / "b", 4, bad)
    assert [r["outcome"] for r in results] == ["zero"] * 4
    assert all("rank 2" in r["reason"] for r in results)


def test_window_peak_is_exact_on_each_rank(tmp_path):
    # RWS is W slots once the state has at least W chunks, min(W, chunks) below that.
    for tokens, want_slots in ((12 * 16, 3), (2 * 16, 2)):
        results = _run(tmp_path / str(tokens), 2, {"tokens": tokens})
        for r in results:
            assert r["outcome"] == "complete"
            assert r["rws_peak_bytes"] == want_slots * r["slot_bytes"]
