"""`bsr-lab bench ceiling` (restore vs the engine alone from a RAM-backed O_DIRECT
source) at a tiny size, and `bsr-lab bench paper`'s refusal when the disk is too small."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from bsr_lab.cli import main

KEYS = (
    "source",
    "engine_raw_gib_s",
    "restore_gib_s",
    "ratio",
    "restore_cpu_s_per_gib",
    "rws_peak_bytes",
    "outcome",
    "engine_cores_busy",
    "restore_cores_busy",
)


@pytest.mark.skipif(not Path("/dev/shm").is_dir(), reason="no /dev/shm tmpfs")
def test_ceiling_json_at_a_tiny_size(tmp_path, capsys):
    out = tmp_path / "ceiling.json"
    argv = ["bench", "ceiling", "--tokens", "1024", "--window", "2", "--rounds", "1"]
    assert main([*argv, "--quiet", "--json", str(out)]) == 0
    doc = json.loads(out.read_text())
    for k in KEYS:
        assert k in doc, k
    assert doc["source"].startswith("tmpfs") and doc["outcome"] == "complete"
    # Every path measured in every counted round; the warm-up round is not counted.
    assert {m: len(v) for m, v in doc["per_round"].items()} == dict.fromkeys(doc["per_round"], 1)
    assert set(doc["per_round"]) == {
        "engine",
        "restore",
        "restore_slots",
        "restore_unfused",
        "hash",
    }
    assert doc["restore_cpu_s_per_gib"] > 0 and doc["restore_unfused_gib_s"] > 0
    # What the restore adds to the read is restore minus engine, its floor the hash alone.
    own = doc["restore_cpu_s_per_gib"] - doc["engine_cpu_s_per_gib"]
    assert doc["restore_own_cpu_s_per_gib"] == pytest.approx(own)
    assert doc["hash_cpu_s_per_gib"] > 0
    # The restore read every chunk into the cache in place; the slot paths did not.
    assert doc["restore_direct_chunks"] == [doc["chunks"]]
    # Four 16 MiB chunks through two slots: the staging peak is the window, not the state.
    assert doc["rws_peak_bytes"] == 2 * doc["chunk_bytes"] < doc["state_bytes"]
    assert "ratio restore/engine" in capsys.readouterr().out
    assert not list(Path("/dev/shm").glob("bsr-io-ceiling-*"))  # the source is removed


def test_ceiling_refuses_a_source_on_disk(tmp_path, capsys):
    assert main(["bench", "ceiling", "--tokens", "1024", "--dir", str(tmp_path)]) == 2
    assert "RAM-backed" in capsys.readouterr().err


def test_paper_refuses_with_the_space_needed(tmp_path, capsys):
    rc = main(["bench", "paper", "--tokens", str(1 << 34), "--dir", str(tmp_path), "--quiet"])
    assert rc == 2
    err = capsys.readouterr().err
    assert "need" in err and "short" in err and "free" in err
    assert not list(tmp_path.iterdir())  # nothing written
