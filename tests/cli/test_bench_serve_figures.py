"""`bsr-lab bench serve`'s figures from its rounds (the servers themselves run in the
bench; these are its pairing rules, on rounds written here): the miss penalty pairs only
requests that missed on both servers, equal outputs are counted only for equal prompts,
and a restored request is compared with the same request recomputed."""

from __future__ import annotations

import threading
from types import SimpleNamespace
from typing import Any

import pytest

from bsr_lab.bench.serve import (
    CACHED,
    CONTROL,
    ROUND_PHASES,
    SIDES,
    equality,
    penalty,
    restores,
    round_order,
    round_prompts,
    run_round,
    steady_rate,
)


def req(
    kind: str, ttft: float, prompt: str, tokens=(1, 2), restored: int = 0, end: float = 1.0
) -> dict[str, Any]:
    return {
        "end_s": end,
        "kind": kind,
        "ttft_s": ttft,
        "total_s": ttft + 0.1,
        "tokens": list(tokens),
        "prompt_hash": prompt,
        "restored": restored,
        "cached": 0,
    }


def rnd(sat: list[dict[str, Any]], turns: list[dict[str, Any]], wall: float) -> dict[str, Any]:
    return {
        "saturated": {"requests": sat, "wall_s": wall},
        "paced": {"requests": [], "wall_s": 0.0},
        "turns": {"requests": turns, "wall_s": wall},
    }


def test_penalty_pairs_misses_on_both_servers_only():
    base = [rnd([req("miss", 1.0, "a"), req("miss", 1.0, "b"), req("local", 0.1, "c")], [], 2.0)]
    # The third request hit vLLM's own cache on the reference: not a miss pair, however
    # slow it was with bsr-io.
    bsr = [rnd([req("miss", 1.1, "a"), req("miss", 1.1, "b"), req("miss", 9.0, "c")], [], 2.5)]
    p = penalty(base, bsr, "saturated", 1)
    assert p["requests"] == 2
    assert p["ttft_p50_ratio"] == pytest.approx(1.1)
    assert p["throughput_ratio"] == pytest.approx(2.0 / 2.5)


def sat(ends: list[float]) -> dict[str, Any]:
    return rnd([req("miss", 0.1, f"p{i}", end=e) for i, e in enumerate(ends)], [], max(ends))


def test_steady_throughput_leaves_out_the_ramp():
    # The same steady state (a request ends every second once four have) after two
    # ramps: the four first together at 1 s, or one by one from 0.3 s.
    together = sat([1.0, 1.0, 1.0, 1.0, 2.0, 3.0, 4.0])
    staggered = sat([0.3, 0.6, 1.2, 1.5, 2.5, 3.5, 4.5])
    assert steady_rate([together["saturated"]], 4) == pytest.approx(
        2.0
    )  # 3 requests x 2 tokens / 3 s
    assert steady_rate([staggered["saturated"]], 4) == pytest.approx(2.0)
    p = penalty([together], [staggered], "saturated", 4)
    assert p["steady_throughput_ratio"] == pytest.approx(1.0)
    assert p["throughput_ratio"] == pytest.approx(4.0 / 4.5)  # the whole phase: the ramp too
    # A slower steady state is seen: a request every 1.25 s after the same ramp.
    slower = sat([1.0, 1.0, 1.0, 1.0, 2.25, 3.5, 4.75])
    assert penalty([together], [slower], "saturated", 4)["steady_throughput_ratio"] == (
        pytest.approx(0.8)
    )
    assert steady_rate([sat([1.0, 2.0])["saturated"]], 4) is None  # nothing after the ramp


def test_equality_counts_equal_prompts_only():
    base = [rnd([req("miss", 1, "a"), req("miss", 1, "b")], [req("miss", 1, "t1")], 1)]
    bsr = [
        rnd(
            [req("miss", 1, "a"), req("miss", 1, "x", tokens=(9,))],  # another prompt
            [req("restored", 0.1, "t1", tokens=(1, 3), restored=256)],
            1,
        )
    ]
    cached = [rnd([], [req("local", 0.05, "t1", tokens=(1, 3))], 1)]
    eq = equality({"baseline": base, "bsr_io": bsr, CACHED: cached})
    assert eq["misses_both"] == "1/1"
    assert eq["restored_vs_recomputed"] == "0/1"
    assert eq["vllm_hit_vs_recomputed"] == "0/1"
    assert eq["restored_vs_vllm_hit"] == "1/1"


def test_restores_pair_the_same_request_recomputed():
    base = [rnd([], [req("miss", 0.5, "t"), req("local", 0.05, "u")], 1)]
    bsr = [
        rnd(
            [],
            [req("restored", 0.1, "t", restored=512), req("restored", 0.1, "u", restored=256)],
            1,
        )
    ]
    r = restores({"baseline": base, "bsr_io": bsr}, 256)
    assert r["requests"] == 1  # the second was vLLM's own hit on the reference
    assert r["speedup_p50"] == pytest.approx(5.0)
    assert list(r["by_restored_chunks"]) == [2]


def test_the_control_is_named_and_takes_every_place_in_the_order():
    base = [rnd([req("miss", 1.0, "a"), req("miss", 1.0, "b")], [], 2.0)]
    ctl = [rnd([req("miss", 1.2, "a"), req("miss", 1.2, "b")], [], 2.0)]
    p = penalty(base, ctl, "saturated", 1, CONTROL)
    assert "ttft_control_s" in p and "ttft_bsr_io_s" not in p
    assert p["ttft_p50_ratio"] == pytest.approx(1.2)
    servers = dict.fromkeys((*SIDES, CONTROL, CACHED))
    orders = [round_order(r, servers) for r in range(12)]
    assert all(sorted(o) == sorted(servers) for o in orders)
    # Over the rounds the control runs before, between and after the compared pair, and
    # each of the pair goes first as often as the other.
    pair = [[s for s in o if s in SIDES] for o in orders]
    assert sum(p[0] == "baseline" for p in pair) == 6
    places = {tuple(s for s in o if s != CACHED).index(CONTROL) for o in orders}
    assert places == {0, 1, 2}
    assert round_order(0, dict.fromkeys(SIDES)) == list(SIDES)  # --no-control
    assert ROUND_PHASES[CONTROL] == ROUND_PHASES["baseline"]  # run as the reference is


class Echo:
    """A stand-in for `vllm serve`'s streaming API (the bench's own phase logic is under
    test here, not a server): every request answers its last two prompt tokens."""

    def __init__(self) -> None:
        self.prompts: list[int] = []
        self._lock = threading.Lock()

    def stream(self, prompt, max_tokens, ignore_eos):
        with self._lock:
            self.prompts.append(len(prompt))
        yield {"id": "cmpl-x", "choices": [{"token_ids": prompt[-2:]}]}

    def group_pids(self) -> list[int]:
        return []  # no processes: no scheduling counters to read


def test_a_round_runs_the_phases_it_is_given_and_only_those():
    args = SimpleNamespace(
        seed=0, chunk=4, miss_chunks=2, saturated=5, misses=3, users=2, turns=2,
        doc_chunks=2, max_tokens=2, concurrency=2,
    )  # fmt: skip
    prompts = round_prompts(args, 0)
    everything = run_round(Echo(), args, prompts, 100.0)
    assert [len(everything[ph]["requests"]) for ph in ("saturated", "paced", "turns")] == [5, 3, 4]
    assert everything["saturated"]["sched"] == {}  # no vLLM thread to count
    srv = Echo()
    turns = run_round(srv, args, prompts, 100.0, ("turns",))
    assert [len(turns[ph]["requests"]) for ph in ("saturated", "paced")] == [0, 0]
    assert len(turns["turns"]["requests"]) == len(srv.prompts) == 4
    assert turns["saturated"]["wall_s"] == turns["paced"]["wall_s"] == 0.0
