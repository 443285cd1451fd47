"""Restore traces on a real engine (`bsr-lab bench vllm-trace`'s engine side, smallest
setup: one chunk, two rounds, TP=1), and the engine steps a restore costs.

vLLM 0.32 schedules a restored request's forward in the step after the step output that
reports its load. The step that sends the load is the floor: the load is reported at
that step's end. Two cuts get there (connector.py, idle.py), each checked by step
counts from the connector's own trace, never by times:

- an idle step (nothing to compute) waits for the load it submitted, at most
  `IDLE_WAIT_S`, before its `get_finished`: without it, the load was reported a step
  or two later;
- a step with a forward submits its loads when vLLM binds the metadata, before the
  forward, not in `start_load_kv`, which vLLM 0.32 calls after the forward: without it
  the load was polled at once and reported behind the next step's forward.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from engines import threads_env

from bsr_io.integrations.vllm.idle import IDLE_WAIT_S
from bsr_lab.vllm.trace_read import SEGMENTS


@pytest.fixture(scope="module")
def traced(vllm_root: Path) -> dict[str, Any]:
    work = vllm_root / "trace"
    out = vllm_root / "trace.json"
    cmd = [sys.executable, "-m", "bsr_lab.vllm.harness", "trace", "--work", str(work)]
    cmd += ["--out", str(out), "--lengths", "1", "--rounds", "2", "--layers", "2"]
    proc = subprocess.run(cmd, env=threads_env(1), capture_output=True, text=True, timeout=1200)
    assert proc.returncode == 0, proc.stderr[-6000:]
    return dict(json.loads(out.read_text()))


def test_each_restore_is_traced_from_lookup_to_first_token(traced):
    (row,) = traced["rows"]
    for r in row["rounds"]:
        assert r["same_token"], "the restored request's first token differs from the hit's"
        assert r["restored_tokens"] == r["hit_tokens"] == traced["chunk_tokens"]
        ph = r["phases_ms"]
        assert {name for name, *_ in SEGMENTS} <= set(ph), ph
        assert ph["asks"] == 0
        # vLLM's protocol: the forward in the step after the one whose output reports it.
        assert ph["steps"]["learned_to_scheduled"] == 1


def test_an_idle_step_reports_the_load_it_submitted(traced):
    fast = []
    for r in traced["rows"][0]["rounds"]:
        ph = r["phases_ms"]
        assert r["phases_ms"]["steps"]["lookup_to_sent"] == 0
        submitted_to_done = ph["submitted_to_started"] + ph["started_to_read_done"]
        if submitted_to_done < IDLE_WAIT_S * 1e3:
            fast.append(ph["steps"]["sent_to_learned"])
    assert fast, "no load ended within the idle wait: the machine is too loaded to tell"
    assert fast == [0] * len(fast), f"loads reported {fast} steps after the step sent them"


def test_a_load_sent_in_a_step_with_a_forward_reads_during_it(traced):
    busy = traced["busy"]
    assert busy["trace"]["sent_idle"] is False, "the load was not sent beside a forward"
    steps = busy["phases_ms"]["steps"]
    assert steps["sent_to_learned"] == 0, f"reported {steps['sent_to_learned']} steps late"
    assert steps["learned_to_scheduled"] == 1


def test_any_bench_reads_the_segments_from_the_event_log(traced, vllm_root):
    """`bench serve` summarizes its connector's traces the same way (segments_by_chunks)."""
    from bsr_lab.bench.vllm_trace import segments_by_chunks

    lines = (vllm_root / "trace" / "events.jsonl").read_text().splitlines()
    got = segments_by_chunks([json.loads(line) for line in lines if line.strip()])
    rounds = len(traced["rows"][0]["rounds"])
    assert got["1"]["requests"] == rounds + 1  # the rounds' restores and the busy one
    assert got["1"]["sent_to_scheduled"] == [1] * (rounds + 1)
    assert {name for name, *_ in SEGMENTS} <= set(got["1"]["median_ms"])
