"""The goal's verdict from a 95% interval (lab/bsr_lab/bench/verdict.py), and `bsr-lab
bench serve` recording it for every saturated comparison, from rounds written here."""

from __future__ import annotations

import math
from types import SimpleNamespace
from typing import Any

import pytest

from bsr_lab.bench.serve import summarize
from bsr_lab.bench.verdict import MET, NOT_MET, NOT_RESOLVED, SERVE_GOALS, judge, lines, verdict


@pytest.mark.parametrize(
    ("lo", "hi", "goal", "want"),
    [
        (0.98, 1.02, (0.97, None), MET),
        (0.97, 1.02, (0.97, None), MET),  # touching the bound from inside is inside
        (0.96, 1.02, (0.97, None), NOT_RESOLVED),  # the README's 0.968x-1.001x case
        (0.90, 0.97, (0.97, None), NOT_RESOLVED),  # meets the bound at one point
        (0.90, 0.969, (0.97, None), NOT_MET),
        (0.877, 1.140, (0.97, None), NOT_RESOLVED),  # serve-xeon-hold's wide interval
        (0.99, 1.05, (None, 1.05), MET),
        (1.04, 1.06, (None, 1.05), NOT_RESOLVED),
        (1.051, 1.2, (None, 1.05), NOT_MET),
        (0.99, 1.01, (0.97, 1.05), MET),
        (0.9, 1.2, (0.97, 1.05), NOT_RESOLVED),  # wider than the goal on both sides
        (1.0, 1.0, (1.0, 1.0), MET),
        (0.5, 0.5, (None, None), MET),  # no bound: nothing to miss
    ],
)
def test_verdict_reads_the_whole_interval(lo, hi, goal, want):
    assert verdict(lo, hi, *goal) == want


@pytest.mark.parametrize(
    ("args", "why"),
    [
        ((1.1, 1.0, 0.97, None), "low end 1.1 is above its high end 1.0"),
        ((0.9, 1.0, 1.05, 0.97), "goal's low end 1.05 is above its high end 0.97"),
        ((math.nan, 1.0, 0.97, None), "lo must be a number"),
        ((0.9, 1.0, None, math.nan), "goal_hi must be a number"),
    ],
)
def test_verdict_refuses_what_is_not_an_interval(args, why):
    with pytest.raises(ValueError, match=why):
        verdict(*args)


def _req(end: float, ttft: float) -> dict[str, Any]:
    return {
        "end_s": end,
        "kind": "miss",
        "ttft_s": ttft,
        "total_s": end,
        "tokens": [0, 0],
        "prompt_hash": f"p{end}",
        "restored": 0,
        "cached": 0,
    }


def _round(step: float, ttft: float, wobble: float) -> dict[str, Any]:
    """A saturated phase whose 8 requests end one every `step` s (times `wobble` for
    the last ones: the round's own noise), each with TTFT `ttft`."""
    ends = [step * (i + 1) * (wobble if i > 3 else 1.0) for i in range(8)]
    sat = {"requests": [_req(e, ttft) for e in ends], "wall_s": ends[-1]}
    paced = {"requests": [_req(e, ttft) for e in ends], "wall_s": ends[-1]}
    return {"saturated": sat, "paced": paced, "turns": {"requests": [], "wall_s": 0.0}}


def _rounds(step: float, ttft: float) -> list[dict[str, Any]]:
    return [_round(step, ttft, w) for w in (1.0, 1.01, 0.99, 1.02, 0.98, 1.0)]


def _summary(bsr_step: float) -> dict[str, Any]:
    args = SimpleNamespace(concurrency=2, max_tokens=2, chunk=256, func=None, dir=None, restarts=0)
    rounds = {
        "baseline": _rounds(1.0, 0.5),
        "control": _rounds(1.0, 0.5),
        "bsr_io": _rounds(bsr_step, 0.5 * bsr_step),
    }
    rss: dict[str, list[tuple[float, float]]] = {s: [] for s in rounds}
    return summarize(args, rounds, [], 1.0, 2.0, {}, rss)  # type: ignore[arg-type]


def test_bench_serve_records_a_verdict_per_comparison():
    # bsr-io 10% slower than two equal references, in every round: not met, with
    # intervals that exclude the goal; the control's interval beside each.
    doc = _summary(1.1)
    v = doc["verdict"]
    assert v["goal"] == {q: list(g) for q, g in SERVE_GOALS.items()}
    for name in ("bsr_io_vs_references", "bsr_io_vs_control", "bsr_io_vs_baseline"):
        thr = v[name]["steady_throughput_ratio"]
        assert thr["ratio"] == pytest.approx(1 / 1.1)
        assert thr["interval_95"] == doc["saturated_95"][name]["steady_throughput_ratio_95"]
        assert thr["verdict"] == NOT_MET
        assert v[name]["ttft_p50_ratio"]["verdict"] == NOT_MET
        assert thr["control_ratio"] == pytest.approx(1.0)
        noise = doc["saturated_95"]["control_vs_baseline"]["steady_throughput_ratio_95"]
        assert thr["control_interval_95"] == noise
    # The same servers: every comparison is met.
    same = _summary(1.0)["verdict"]
    assert {same[n][q]["verdict"] for n in ("bsr_io_vs_references",) for q in SERVE_GOALS} == {MET}
    printed = lines(doc["verdict"])
    assert len(printed) == 6
    assert printed[0].startswith("steady_throughput_ratio references: 0.909x (95% ")
    assert "goal >= 0.97x: not met; control vs reference 1.000x" in printed[0]


def test_a_straddling_interval_is_printed_as_not_resolved():
    judged = judge(
        {
            "bsr_io_vs_references": {
                "steady_throughput_ratio": 1.001,
                "steady_throughput_ratio_95": [0.877, 1.140],
                "ttft_p50_ratio": 0.996,
                "ttft_p50_ratio_95": [0.9, 1.1],
            }
        }
    )
    row = judged["bsr_io_vs_references"]["steady_throughput_ratio"]
    assert row["verdict"] == NOT_RESOLVED and "control_interval_95" not in row
    assert lines(judged)[0].endswith("goal >= 0.97x: not resolved at this noise floor")
