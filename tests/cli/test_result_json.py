"""Every result JSON names the commit it measured and the machine it ran on."""

from __future__ import annotations

import json
import os
import re
import subprocess
from pathlib import Path

from bsr_io.cli.report import write_json


def test_result_names_commit_and_machine(tmp_path: Path) -> None:
    out = tmp_path / "nested" / "r.json"
    write_json(out, {"figure": 1.0})
    doc = json.loads(out.read_text())
    assert doc["figure"] == 1.0
    head = subprocess.run(
        ["git", "-C", str(Path(__file__).parent), "rev-parse", "HEAD"],
        capture_output=True,
        text=True,
    ).stdout.strip()
    assert re.fullmatch(r"[0-9a-f]{40}(\+dirty)?", doc["commit"])
    assert doc["commit"].startswith(head)
    # The CPU as the kernel names it, read here by a regular expression of its own.
    cpuinfo = Path("/proc/cpuinfo").read_text()
    model = re.search(r"^model name\s*:\s*(.+)$", cpuinfo, re.M)
    assert doc["machine"]["cpu"] == (model.group(1).strip() if model else "unknown")
    assert doc["machine"]["cpus"] == os.cpu_count()
    assert doc["machine"]["amx"] == bool(re.search(r"\bamx_tile\b", cpuinfo))
    assert doc["machine"]["avx512"] == bool(re.search(r"\bavx512f\b", cpuinfo))


def test_a_result_keeps_what_it_says_of_itself(tmp_path: Path) -> None:
    # A pooled result names the runs' commits itself; a result from another machine
    # (copied in) keeps its own machine.
    out = tmp_path / "r.json"
    write_json(out, {"commit": "abc", "machine": {"cpu": "elsewhere"}})
    doc = json.loads(out.read_text())
    assert doc["commit"] == "abc"
    assert doc["machine"] == {"cpu": "elsewhere"}
