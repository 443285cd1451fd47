"""A hybrid model on a real vLLM engine (tiny Gemma 3: two sliding-window KV
cache groups and one full-attention group) restored under one request-level commit,
at TP=1 and TP=2 (two real CPU workers).

One engine with the connector runs every phase (the harness's `hybrid`), next to one
engine without it on the same threads and the same prefill step size (the baseline).
Controls come from the same run: the baseline's outputs, each rank's event log, and
vLLM's own cached-token count.
"""

from __future__ import annotations

import pytest
from engines import per_rank, run_harness

from bsr_lab.vllm.harness import G_CHUNK, WINDOW

RECORD = 2 * 2 * 32768  # 2 layers x 2 pages of 32 KiB, every group at 256-token chunks


@pytest.fixture(scope="module", params=[1, 2], ids=["tp1", "tp2"])
def hy(request, vllm_root) -> dict:
    tp = request.param
    work = vllm_root / f"hybrid-tp{tp}"
    work.mkdir()
    base = run_harness("hybrid-baseline", tp, work, timeout=900)["outputs"]
    suite = run_harness("hybrid", tp, work, timeout=1800)
    return {"tp": tp, "s": suite, "base": base}


def _loads(phase: dict, tp: int) -> dict[int, dict]:
    return per_rank(phase["loads"], tp)


def _complete(phase: dict, tp: int) -> dict[int, dict]:
    loads = _loads(phase, tp)
    assert all(e["outcome"] == "complete" for e in loads.values()), loads
    return loads


def test_hybrid_allocator_on_with_three_groups(hy):
    for groups in hy["s"]["groups"]:
        assert [(g["index"], g["kind"], g["spec"]) for g in groups] == [
            (0, "window", "SlidingWindowSpec"),
            (1, "window", "SlidingWindowSpec"),
            (2, "full", "FullAttentionSpec"),
        ]
        assert {g["record_bytes"] for g in groups} == {RECORD}


def test_restored_prefix_identical_and_cached(hy):
    s, base, tp = hy["s"], hy["base"], hy["tp"]
    assert s["A"]["cached"] == 0 and s["A"]["tokens"] == base["A"]
    _complete(s["A2"], tp)
    assert s["A2"]["cached"] == 16 * G_CHUNK
    assert s["A2"]["tokens"] == base["A2"]
    # The control: the same question after another prefix gives another output, so
    # the output depends on the prefix (the restored KV), not on the question alone.
    assert base["A2"] != base["A2x"]
    assert s["L16"]["cached"] == 64 * G_CHUNK and s["L16"]["tokens"] == base["L16"]


def test_window_groups_read_the_same_bytes_for_4k_and_16k(hy):
    s, tp = hy["s"], hy["tp"]
    short, long = _complete(s["A2"], tp), _complete(s["L16"], tp)
    for r in range(tp):
        a, b = short[r]["bytes_by_group"], long[r]["bytes_by_group"]
        assert a["0"] == b["0"] == RECORD and a["1"] == b["1"] == RECORD
        assert (a["2"], b["2"]) == (16 * RECORD, 64 * RECORD)  # the full group grows
        # Staging: at most W records of the largest group, whatever the prefix.
        assert 0 < short[r]["rws_peak_bytes"] <= WINDOW * RECORD
        assert 0 < long[r]["rws_peak_bytes"] <= WINDOW * RECORD


@pytest.mark.parametrize("group", [0, 1, 2])
def test_zeroing_one_groups_records_changes_the_output(hy, group):
    """Test double: group `group`'s records of the prompt replaced by zeros (well formed,
    valid checksums): the load completes, and the output differs from the baseline,
    so that group's restored bytes are what vLLM attends to."""
    s, base, tp = hy["s"], hy["base"], hy["tp"]
    assert s[f"Z{group}_zeroed"] > 0
    phase = s[f"Z{group}"]
    _complete(phase, tp)
    assert phase["cached"] == 4 * G_CHUNK
    assert phase["tokens"] != base[f"Z{group}"]


def test_one_group_corrupt_on_one_rank_recomputes_everywhere(hy):
    s, base, tp = hy["s"], hy["base"], hy["tp"]
    loads = _loads(s["F1"], tp)
    bad = loads[tp - 1]
    assert bad["outcome"] == "zero" and "checksum" in bad["reason"], bad
    for r in range(tp - 1):
        assert loads[r]["outcome"] == "complete"  # that rank's own load was fine...
    assert s["F1"]["cached"] == 0  # ...but vLLM recomputed the request on every rank
    assert s["F1"]["tokens"] == base["F1"]
    assert any(f.endswith(".why") and f"w{tp}r{tp - 1}" in f for f in s["quarantine"])
    # The recompute saved the lost record again: the next identical request restores.
    _complete(s["F1_again"], tp)
    assert s["F1_again"]["cached"] == 6 * G_CHUNK and s["F1_again"]["tokens"] == base["F1"]


def test_one_group_missing_on_one_rank_recomputes_everywhere(hy):
    s, base, tp = hy["s"], hy["base"], hy["tp"]
    loads = _loads(s["F2"], tp)
    assert loads[tp - 1]["outcome"] == "zero", loads
    assert s["F2"]["cached"] == 0 and s["F2"]["tokens"] == base["F2"]
    assert s["F2_wall_s"] < 30  # no hang: far below the load timeout


def test_two_turn_chat_restores_the_generated_tokens(hy):
    s, base, tp = hy["s"], hy["base"], hy["tp"]
    assert s["T1"]["tokens"] == base["T1"]
    # Turn 1 computed 5 x 256 + 250 prompt tokens and 15 generated ones: 6 whole chunks,
    # the sixth ending inside the generated tokens.
    _complete(s["T2"], tp)
    assert s["T2"]["cached"] == 6 * G_CHUNK
    assert s["T2"]["tokens"] == base["T2"]


def test_vllm_local_hit_extended_reading_only_what_it_lacks(hy):
    s, base, tp = hy["s"], hy["base"], hy["tp"]
    assert s["P2"]["cached"] == 8 * G_CHUNK and s["P2"]["tokens"] == base["P2"]
    loads = _complete(s["P8b"], tp)
    assert s["P8b"]["cached"] == 32 * G_CHUNK and s["P8b"]["tokens"] == base["P8b"]
    for e in loads.values():
        # vLLM held chunks 0-7 itself: the full group reads chunks 8-31 only, each window
        # group its one record at the restore point.
        assert e["bytes_by_group"] == {"0": RECORD, "1": RECORD, "2": 24 * RECORD}, e


def test_records_saved_in_steps_are_counted_and_logged(hy):
    # A sliding-window model once wrote its records and logged no save. By default every
    # record, window and full, is cut in a step: each one written is a step_save event,
    # no finish save runs, each rank's counters say the same, and each rank says when
    # the request's cuts had all ended (`step_saves_done`, one per rank).
    s, tp = hy["s"], hy["tp"]
    first = s["events"][: s["A_events"]]  # the first request's, on a fresh store
    step = [e for e in first if e["kind"] == "step_save" and e["outcome"] == "complete"]
    assert len(step) == s["A_files"] > 0, (len(step), s)
    assert not [e for e in first if e["kind"] == "save"], first
    ends = [e for e in first if e["kind"] == "step_saves_done"]
    assert sorted(e["rank"] for e in ends) == list(range(tp)), ends
    assert sum(e["written"] for e in ends) == len(step), ends
    for rank in range(tp):
        mine = [e for e in s["events"] if e.get("rank") == rank]  # scheduler traces have no rank
        m = s["save_metrics"][rank]
        steps = [e for e in mine if e["kind"] == "step_save" and e["outcome"] == "complete"]
        assert m['bsr_io_vllm_save_records_total{kind="step",outcome="saved"}'] == len(steps)
        assert m.get('bsr_io_vllm_save_records_total{kind="finish",outcome="saved"}', 0) == 0
        assert len(steps) > 0, m
