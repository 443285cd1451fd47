"""Two TP ranks in real processes: one rank's record is corrupt, so that rank reports
fewer leading hits, and the group's minimum (SGLang's agreement) excludes the page."""

from __future__ import annotations

import json
import socket
import subprocess
import sys
from pathlib import Path

WORKER = Path(__file__).parent / "rank_worker.py"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def test_a_corrupt_record_on_one_rank_shortens_that_rank_and_the_minimum(tmp_path: Path) -> None:
    store = tmp_path / "store"
    store.mkdir()
    port, bad = _free_port(), 3
    outs = [tmp_path / f"rank{r}.json" for r in range(2)]
    procs = [
        subprocess.Popen(
            [
                sys.executable,
                str(WORKER),
                str(r),
                "2",
                str(store),
                str(port),
                str(bad),
                str(outs[r]),
            ]
        )
        for r in range(2)
    ]
    for p in procs:
        assert p.wait(timeout=180) == 0
    r0, r1 = (json.loads(o.read_text()) for o in outs)
    assert r0["exists"] == r1["exists"] == 6  # both catalogs list every page
    assert r0["got"] == [True] * 6
    assert r1["got"] == [True] * bad + [False] * (6 - bad)
    assert r0["agreed"] == r1["agreed"] == bad
    assert r0["same"] and r1["same"]
