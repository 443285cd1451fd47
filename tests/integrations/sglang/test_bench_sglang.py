"""`bsr-lab bench sglang` on a tiny size, both layouts: every way (bsr, SGLang's
HiCacheFile, fio) reads the same pages, and the bench itself checks every pool's bytes.

fio runs on plain pages here (`--fio-buffers plain`): the huge-page reservation is
serialised across benches by a lock, which another bench on the machine may hold for
its whole run.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from bsr_io.cli.fio import fio_available
from bsr_lab.cli import main

TINY = ["--size", "1MiB", "--layers", "2", "--kv-heads", "2", "--head-dim", "64"]
TINY += ["--page-tokens", "16", "--window", "4", "--rounds", "1", "--fio-buffers", "plain"]
SIDECARS = ["deepseek_v4_c4", "deepseek_v4_c4_indexer", "deepseek_v4_c128"]


@pytest.mark.parametrize("layout", ["mha", "hybrid"])
def test_bench_sglang_tiny(tmp_path: Path, layout: str) -> None:
    out = tmp_path / "sglang.json"
    argv = ["bench", "sglang", *TINY, "--layout", layout, "--dir", str(tmp_path)]
    assert main([*argv, "--json", str(out)]) == 0
    rep = json.loads(out.read_text())
    assert rep["pools"] == layout
    pools = ["kv", *SIDECARS] if layout == "hybrid" else ["kv"]
    assert sorted(rep["pool_page_bytes"]) == sorted(pools)
    assert rep["page_bytes"] == sum(rep["pool_page_bytes"].values())
    # bsr read every pool's page of every round (the v2 reads are counted per pool).
    assert rep["bsr_backend_stats"]["get_ok"] == rep["pages"] * len(pools)
    assert rep["bsr_backend_stats"]["get_failed"] == 0
    for way in ("bsr", "file"):
        assert rep["summary"][way]["gib_s"] > 0
    if fio_available():
        assert rep["summary"]["fio"]["gib_s"] > 0
        # A hybrid set is read by fio two ways (pools at once, in turn); the ratio is
        # against the faster.
        ways = ["fio", "fio_in_turn"] if layout == "hybrid" else ["fio"]
        assert [w for w in ("fio", "fio_in_turn") if w in rep["summary"]] == ways
        best = max(rep["summary"][w]["gib_s"] for w in ways)
        assert rep["summary"]["bsr_over_fio"]["ratio"] == rep["summary"]["bsr"]["gib_s"] / best
        # fio read the KV's files and every sidecar's with a whole 4 KiB block.
        assert len(rep["fio_payload_bytes"]) == 1 + sum(
            1 for n in SIDECARS if rep["pool_page_bytes"].get(n, 0) >= 4096
        )
