"""The figures of `bsr-lab bench serve-pool` and the checks of `bsr-lab bench soak`, on
rounds and samples written here (the servers themselves run in the benches).

serve-pool: its pooled ratio is the one `bench serve` computes for one run, and its
interval holds a real difference out and takes noise in. soak: the stability check
flags a leak of fds, threads or memory, against a server that holds steady.
"""

from __future__ import annotations

import json
from types import SimpleNamespace
from typing import Any

import numpy as np

from bsr_io.cli.report import trace_path
from bsr_lab.bench.serve import steady_rate
from bsr_lab.bench.serve_pool import compare, round_figures, split_trace
from bsr_lab.bench.serve_pool import run as pool_run
from bsr_lab.bench.soak import cycle_jobs, stability

MAX_TOKENS = 16


def phase(rate: float, n: int = 12, jitter: float = 0.0, seed: int = 0) -> dict[str, Any]:
    """A saturated phase whose requests end one every MAX_TOKENS / rate seconds."""
    rng = np.random.default_rng(seed)
    step = MAX_TOKENS / rate
    ends = [step * (i + 1) * (1 + jitter * rng.standard_normal()) for i in range(n)]
    return {
        "wall_s": max(ends),
        "requests": [
            {"end_s": e, "ttft_s": 0.5 * step, "kind": "miss", "tokens": [0] * MAX_TOKENS}
            for e in ends
        ],
    }


def rounds(rate: float, n: int, jitter: float, seed: int) -> list[dict[str, Any]]:
    return [{"saturated": phase(rate, jitter=jitter, seed=seed + r)} for r in range(n)]


def test_the_pooled_rate_is_bench_serves_steady_rate():
    rds = rounds(40.0, 6, 0.05, 1)
    figs = [round_figures(rd, "saturated", 4, MAX_TOKENS) for rd in rds]
    pooled = sum(f["tokens"] for f in figs) / sum(f["span"] for f in figs)
    assert pooled == steady_rate([rd["saturated"] for rd in rds], 4)


def test_the_interval_holds_a_real_difference_out_and_noise_in():
    rng = np.random.default_rng(0)
    base = [round_figures(rd, "saturated", 4, MAX_TOKENS) for rd in rounds(40.0, 24, 0.03, 10)]
    slow = [round_figures(rd, "saturated", 4, MAX_TOKENS) for rd in rounds(36.0, 24, 0.03, 50)]
    same = [round_figures(rd, "saturated", 4, MAX_TOKENS) for rd in rounds(40.0, 24, 0.03, 90)]
    worse = compare([slow], [base], rng, 1000)
    lo, hi = worse["steady_throughput_ratio_95"]
    assert hi < 1.0 and lo < 0.9 < hi  # 10% slower: the interval says so, around 0.9
    aa = compare([same], [base], rng, 1000)
    lo, hi = aa["steady_throughput_ratio_95"]
    assert lo < 1.0 < hi  # the same server: the interval takes 1 in
    # Against both references, the mean of their rates.
    both = compare([slow], [base, same], rng, 1000)
    assert both["steady_throughput_ratio"] < worse["steady_throughput_ratio"] + 0.05


def test_grouped_rounds_take_the_spread_between_servers_into_the_interval():
    """Four epochs of six rounds, each epoch on servers started anew: the two references
    (the same server) differ by a speed of their own in each epoch, drawn as a server's
    start draws it, on top of little round noise. Rounds resampled alone read the four
    draws' mean as a difference (an interval that leaves 1 out); resampled by epoch,
    the interval takes 1 in. Control: a real 10% difference stays out."""
    offsets = [1.04, 1.03, 0.97, 1.02]
    base, same, slow = [], [], []
    for e, off in enumerate(offsets):
        base += [
            round_figures(rd, "saturated", 4, MAX_TOKENS) for rd in rounds(40.0, 6, 0.005, 10 * e)
        ]
        same += [
            round_figures(rd, "saturated", 4, MAX_TOKENS)
            for rd in rounds(40.0 * off, 6, 0.005, 10 * e + 100)
        ]
        slow += [
            round_figures(rd, "saturated", 4, MAX_TOKENS)
            for rd in rounds(36.0 * off, 6, 0.005, 10 * e + 200)
        ]
    groups = [e for e in range(len(offsets)) for _ in range(6)]
    rng = np.random.default_rng(0)
    lo, hi = compare([same], [base], rng, 2000)["steady_throughput_ratio_95"]
    assert lo > 1.0, "rounds alone: the draws read as a difference"
    grouped = compare([same], [base], rng, 2000, groups)
    lo, hi = grouped["steady_throughput_ratio_95"]
    assert lo < 1.0 < hi
    assert grouped["groups"] == 4
    lo, hi = compare([slow], [base], rng, 2000, groups)["steady_throughput_ratio_95"]
    assert hi < 0.97
    # Where the spread is: between the epochs here (the servers' own speeds), ...
    split = grouped["steady_throughput_spread"]
    assert split["epoch_sd"] > 3 * split["within_epoch_sd"]
    # ... and within them when the servers start alike and the rounds are noisy.
    noisy = [round_figures(rd, "saturated", 4, MAX_TOKENS) for rd in rounds(40.0, 24, 0.03, 300)]
    split = compare([noisy], [base], rng, 10, groups)["steady_throughput_spread"]
    assert split["within_epoch_sd"] > split["epoch_sd"] > 0
    assert split["round_sd"] > 0.01


def test_serve_pool_refuses_runs_of_other_configurations(tmp_path, capsys):
    doc = {
        "args": {
            "saturated": 12,
            "misses": 4,
            "concurrency": 4,
            "max_tokens": MAX_TOKENS,
            "save_in_steps": True,
            "hidden": 768,
        },
        "rounds": {s: rounds(40.0, 2, 0.0, 0) for s in ("baseline", "bsr_io", "control")},
        "device": "cpu",
        "commit": "x",
    }
    for rd in doc["rounds"].values():
        for r in rd:
            for q in r["saturated"]["requests"]:
                del q["tokens"]  # as committed: `strip` drops them
    a, b = tmp_path / "a.json", tmp_path / "b.json"
    a.write_text(json.dumps(doc))
    doc["args"]["save_in_steps"] = False
    b.write_text(json.dumps(doc))
    args = SimpleNamespace(
        runs=[str(a), str(b)], phase="saturated", seed=0, resamples=100, json=None
    )
    assert pool_run(args) == 2
    assert "differ in their configuration" in capsys.readouterr().err
    args.runs = [str(a), str(a)]
    assert pool_run(args) == 0  # control: the same configuration twice pools
    # Another dtype is another configuration (a run from before --dtype ran bfloat16).
    doc["args"]["save_in_steps"] = True
    doc["args"]["dtype"] = "float32"
    b.write_text(json.dumps(doc))
    args.runs = [str(a), str(b)]
    assert pool_run(args) == 2
    doc["args"]["dtype"] = "bfloat16"
    b.write_text(json.dumps(doc))
    assert pool_run(args) == 0
    # Another machine type is refused too.
    doc["machine"] = {"cpu": "AMD EPYC", "cpus": 2, "amx": False}
    b.write_text(json.dumps(doc))
    assert pool_run(args) == 2
    assert "different machines" in capsys.readouterr().err


def _run_doc(rate: float, seed: int) -> dict[str, Any]:
    args = {"saturated": 12, "misses": 4, "concurrency": 4, "max_tokens": MAX_TOKENS}
    args |= {"save_in_steps": True, "hidden": 768, "dtype": "float32"}
    doc: dict[str, Any] = {"args": args, "device": "cpu", "commit": "x"}
    doc["rounds"] = {
        s: rounds(rate if s == "bsr_io" else 40.0, 8, 0.01, seed + 10 * i)
        for i, s in enumerate(("baseline", "bsr_io", "control"))
    }
    for side in ("baseline", "bsr_io", "control"):
        doc[side] = {"rss_mib": [[0.0, 100.0], [1.0, 140.0 + len(side)]]}
    return doc


def test_serve_pool_reads_split_runs_and_gives_the_goals_verdict(tmp_path):
    """A committed run keeps its rounds in NAME.trace.json.gz (`split_trace`, which
    `bench serve --json` calls): pooled from there they give the same figures as from
    the JSON that held them, and the pool states the goal's verdict: met for a run as
    fast as its references, not met for one 10% slower. A run whose trace is gone is
    refused by name."""
    whole = tmp_path / "whole.json"
    whole.write_text(json.dumps(_run_doc(40.0, 0)))
    split = tmp_path / "split.json"
    doc = _run_doc(40.0, 0)
    split_trace(doc, split)
    split.write_text(json.dumps(doc))
    assert "rounds" not in doc and doc["rounds_file"] == "split.trace.json.gz"
    assert trace_path(split).exists()
    # Memory: the samples moved out, the peak kept.
    assert doc["bsr_io"] == {"rss_mib_max": 146.0} and doc["control"] == {"rss_mib_max": 147.0}
    outs = []
    for path in (whole, split):
        out = tmp_path / f"pool-{path.stem}.json"
        args = SimpleNamespace(
            runs=[str(path)], phase="saturated", seed=0, resamples=400, json=str(out)
        )
        assert pool_run(args) == 0
        outs.append(json.loads(out.read_text()))
    for key in ("bsr_io_vs_baseline", "control_vs_baseline", "bsr_io_vs_references"):
        assert outs[0][key] == outs[1][key]
    row = outs[1]["verdict"]["bsr_io_vs_references"]["steady_throughput_ratio"]
    assert row["verdict"] == "met", row
    # Control: the same pool over a run 10% slower than its references is not met.
    slow = tmp_path / "slow.json"
    slow.write_text(json.dumps(_run_doc(36.0, 0)))
    out = tmp_path / "pool-slow.json"
    args = SimpleNamespace(
        runs=[str(slow)], phase="saturated", seed=0, resamples=400, json=str(out)
    )
    assert pool_run(args) == 0
    row = json.loads(out.read_text())["verdict"]["bsr_io_vs_references"]["steady_throughput_ratio"]
    assert row["verdict"] == "not met", row
    # A split run without its trace: refused, the file named.
    trace_path(split).unlink()
    args = SimpleNamespace(runs=[str(split)], phase="saturated", seed=0, resamples=10, json=None)
    assert pool_run(args) == 2


def samples(segment: int, t0: float, n: int, fds: float, grow: float = 0.0) -> list[dict]:
    return [
        {
            "segment": segment,
            "t_s": t0 + i,
            "procs": 4,
            "fds": fds + grow * i,
            "threads": 80 + grow * i,
            "rss_mib": 3000 + 10 * grow * i,
        }
        for i in range(n)
    ]


def test_stability_flags_a_leak_against_a_steady_server():
    warm = {0: 0.0, 1: 100.0}
    steady = samples(0, 0, 60, 180) + samples(1, 100, 60, 181)
    ok = stability(steady, warm)
    assert ok["fds_ok"] and ok["threads_ok"] and ok["rss_ok"] and ok["rss_drift_ok"]
    leaking = samples(0, 0, 60, 180) + samples(1, 100, 60, 180, grow=1.0)
    bad = stability(leaking, warm)
    assert not bad["fds_ok"] and not bad["threads_ok"]
    assert not bad["rss_drift_ok"]  # within the segment: RSS rose through it


def test_samples_of_a_starting_server_are_not_counted():
    """A server starting (before its first cycle) grows from nothing: not a leak."""
    starting = samples(1, 100, 20, 0, grow=9.0)  # 0 to 171 fds while it starts
    warm = {0: 0.0, 1: 120.0}
    st = stability(samples(0, 0, 60, 180) + starting + samples(1, 120, 60, 180), warm)
    assert st["fds_ok"] and st["rss_drift_ok"]


def test_a_cycle_sends_every_prompt_twice_some_closed_early():
    jobs = cycle_jobs(["a", "b", "c", "d"])
    assert sorted(n for n, _ in jobs) == sorted(["a", "b", "c", "d"] * 2)
    ends = [e for _, e in jobs]
    assert ends.count("first") == 2 and ends.count("early") == 1


def _counted(rate: float, duty: float, n: int, seed: int) -> list[dict[str, Any]]:
    """Rounds at `rate` whose forward thread ran `duty` of each phase's wall time."""
    out = rounds(rate, n, 0.01, seed)
    for rd in out:
        ph = rd["saturated"]
        ph["sched"] = {"forward": {"run_s": duty * ph["wall_s"]}}
    return out


def test_throughput_splits_into_the_forwards_duty_and_its_speed():
    """Two ways to lose 10% of the throughput: a forward that runs 10% less of the time
    (its turn taken) and one that runs as long but computes 10% slower. The split tells
    them apart, each against a reference that runs the forward 90% of the time; rounds
    with no forward counters (runs from before them) give no split."""
    rng = np.random.default_rng(0)

    def figs(rds: list[dict[str, Any]]) -> list[dict[str, Any]]:
        return [round_figures(rd, "saturated", 4, MAX_TOKENS) for rd in rds]

    base = figs(_counted(40.0, 0.9, 12, 0))
    taken = figs(_counted(36.0, 0.81, 12, 100))  # same speed per forward second
    slower = figs(_counted(36.0, 0.9, 12, 200))  # same duty, less done per second
    got = compare([taken], [base], rng, 500)
    assert abs(got["forward_duty_ratio"] - 0.9) < 0.01
    assert abs(got["forward_speed_ratio"] - 1.0) < 0.03
    lo, hi = got["forward_duty_ratio_95"]
    assert lo <= got["forward_duty_ratio"] <= hi < 0.95
    got = compare([slower], [base], rng, 500)
    assert abs(got["forward_duty_ratio"] - 1.0) < 0.01
    assert abs(got["forward_speed_ratio"] - 0.9) < 0.03
    assert got["forward_speed_ratio_95"][1] < 0.95
    plain = figs(rounds(40.0, 12, 0.01, 0))
    assert "forward_duty_ratio" not in compare([plain], [base], rng, 50)
