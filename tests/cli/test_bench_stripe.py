"""`bsr-lab bench stripe` end to end at a small size: a striped restore against fio
reading the same records on every directory at once."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from bsr_io.cli.fio import fio_available
from bsr_lab.cli import main


@pytest.mark.skipif(not fio_available(), reason="fio not installed")
def test_bench_stripe_small(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    dirs = [tmp_path / "a", tmp_path / "b"]
    out = tmp_path / "stripe.json"
    argv = ["bench", "stripe", "--dirs", *map(str, dirs), "--tokens", "2048", "--window", "2"]
    argv += ["--rounds", "2", "--seed", "1", "--dest-cap", "64MiB", "--quiet", "--json", str(out)]
    assert main(argv) == 0
    doc = json.loads(out.read_text())
    assert doc["outcome"] == "complete" and doc["chunks"] == 8
    assert sum(doc["chunks_per_drive"]) == 8 and len(doc["drives"]) == 2
    assert all(not d["default"] for d in doc["drives"])
    assert doc["restore_gib_s"] > 0 and doc["fio_gib_s"] > 0 and len(doc["ratio_rounds"]) == 2
    assert doc["rws_peak_bytes"] <= doc["rws_bound_bytes"]
    assert len(doc["restore_profile_s"]) == 2 and len(doc["orders"]) == 2
    for d in dirs:  # the scratch directories under each drive are removed
        assert not list(d.iterdir())
    assert "ratio restore/" in capsys.readouterr().out
