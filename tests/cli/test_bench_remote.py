"""`bsr-lab bench remote` end to end at a small size: it starts its own loopback pool,
restores through W slots, measures the client's bulk read in the same run, and stops
the pool again. Four chunks of the paper's layout, one more than the window: the tiny
layout's thousand records per 2 MiB made thousands of loopback transfers, and on a
loaded machine Mooncake's TCP transport dropped one of them (the restore then ended
`zero`, as it should, but a smoke test of the command is not the place for that)."""

from __future__ import annotations

import json
import subprocess
import sys

import mooncake_fixtures as mf
import psutil

mf.require_mooncake()


def test_bench_remote_json(tmp_path):
    out = tmp_path / "remote.json"
    before = {p.pid for p in psutil.process_iter(["name"]) if "mooncake" in (p.info["name"] or "")}
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "bsr_lab.cli",
            "bench",
            "remote",
            "--size",
            "64MiB",
            "--layout",
            "deepseek-v4-flash",
            "--window",
            "3",
            "--rounds",
            "1",
            "--json",
            str(out),
        ],
        capture_output=True,
        text=True,
        timeout=180,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    doc = json.loads(out.read_text())
    for k in ("restore_gib_s", "client_bulk_gib_s", "ratio", "rws_peak_bytes", "state_bytes"):
        assert doc[k] > 0, k
    assert doc["outcome"] == "complete"
    # Through the slots the window stages W chunks, not the state; read straight into the
    # destination it stages nothing.
    assert doc["rws_peak_bytes"] == doc["rws_bound_bytes"] == 3 * doc["slot_bytes"]
    assert doc["state_bytes"] == doc["chunks"] * doc["chunk_bytes"] > doc["rws_peak_bytes"]
    assert doc["direct_chunks"] == doc["chunks"] and doc["rws_peak_bytes_direct"] == 0
    for row in doc["rounds_detail"]:
        assert row["restore_slots_direct_chunks"] == 0
        assert sorted(row["order"]) == ["bulk", "bulk_low", "restore", "restore_slots"]
    after = {p.pid for p in psutil.process_iter(["name"]) if "mooncake" in (p.info["name"] or "")}
    assert after <= before  # the pool it started is gone
