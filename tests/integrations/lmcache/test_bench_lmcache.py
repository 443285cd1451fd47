"""`bsr-lab bench lmcache` end to end at a tiny size: the JSON rows the issue asks for."""

from __future__ import annotations

import json

import pytest

pytest.importorskip("lmcache")

from bsr_lab.cli import main  # noqa: E402


def test_bench_lmcache_json(tmp_path, capsys):
    out = tmp_path / "lmcache.json"
    argv = [
        "bench",
        "lmcache",
        "--json",
        str(out),
        "--states",
        "1MiB",
        "--ladder",
        "512KiB,1MiB,2MiB",
        "--bsr-l1",
        "512KiB",
        "--window",
        "2",
        "--timeout",
        "4",
        "--dir",
        str(tmp_path / "scratch"),
    ]
    assert main(argv) == 0
    report = json.loads(out.read_text())
    chunk = report["shape"]["chunk_bytes"]
    stock = [(r["l1_bytes"], r["result"]) for r in report["stock"]]
    assert stock == [(512 << 10, "hang"), (1 << 20, "ok")]  # stops at the first full reuse
    ok = report["stock"][1]
    assert ok["l1_peak_bytes"] == 1 << 20 and ok["data_ok"] is True  # stock stages it all
    (bsr,) = report["bsr"]
    assert {k: bsr[k] for k in ("state_bytes", "l1_bytes", "result", "data_ok")} == {
        "state_bytes": 1 << 20,
        "l1_bytes": 512 << 10,
        "result": "ok",
        "data_ok": True,
    }
    assert bsr["staging_peak_bytes"] == 2 * chunk
    assert "| 1.00 MiB |" in capsys.readouterr().out
