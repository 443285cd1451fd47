"""Two TP ranks of a DeepSeek-V4-shaped model in real processes, agreeing through
SGLang's own MIN-reduces (hybrid_rank_worker.py says what each rank holds and does)."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

WORKER = Path(__file__).parent / "hybrid_rank_worker.py"
N, BAD = 6, 2
SIDECARS = ["deepseek_v4_c4", "deepseek_v4_c4_indexer", "deepseek_v4_c128"]
TRAILING = ["swa", "deepseek_v4_c4_state", "deepseek_v4_c4_indexer_state"]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def test_two_ranks_agree_on_a_prefix_legal_on_both_and_a_damaged_record_cuts_both(
    tmp_path: Path,
) -> None:
    store = tmp_path / "store"
    store.mkdir()
    port = _free_port()
    outs = [tmp_path / f"rank{r}.json" for r in range(2)]
    procs = [
        subprocess.Popen(
            [sys.executable, str(WORKER), str(r), "2", str(store), str(port), str(outs[r])],
            env={**os.environ},
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        for r in range(2)
    ]
    logs = [p.communicate(timeout=300)[0] for p in procs]
    for p, log in zip(procs, logs, strict=True):
        assert p.returncode == 0, log[-4000:]
    r0, r1 = (json.loads(o.read_text()) for o in outs)

    # Each rank lists the lengths its own trailing windows make restorable ...
    assert r0["a6"]["restorable"] == [3, 6]
    assert r1["a6"]["restorable"] == [2, 6]
    # ... and SGLang's intersection picks one legal on both: 6 of 6; of a 5-page
    # request none (the MIN of each rank's longest, 2, is illegal on rank 0).
    assert r0["a6"]["agreed_pages"] == r1["a6"]["agreed_pages"] == 6
    assert (r0["a5"]["restorable"], r1["a5"]["restorable"]) == ([3], [2])
    assert r0["a5"]["agreed_pages"] == r1["a5"]["agreed_pages"] == 0

    # Prefix B: metadata cannot see a flipped byte; both ranks offer every page.
    assert r0["b_before"]["agreed_pages"] == r1["b_before"]["agreed_pages"] == N
    # Rank 1's damaged indexer record ends the prefix at BAD for every pool of its
    # batch, not just the indexer's; rank 0 loads all of it ...
    cut = [True] * BAD + [False] * (N - BAD)
    assert r1["derived"] == dict.fromkeys(SIDECARS, cut)
    assert r0["derived"] == dict.fromkeys(SIDECARS, [True] * N)
    assert (r0["completed"], r1["completed"]) == (N, BAD)
    assert r1["window"] == {}  # a trailing window is never read without the pages it ends
    assert r0["window"] == {"swa": [True] * 2, **dict.fromkeys(TRAILING[1:], [True])}
    # ... and the group agrees on BAD pages for every pool on both ranks.
    for r in (r0, r1):
        assert r["agreed_completed"] == BAD
        assert r["agreed_pool_hits"] == {
            **dict.fromkeys(SIDECARS, BAD),
            **dict.fromkeys(TRAILING, 0),
        }
        assert all(r["same"].values()), r["same"]
    # The damaged page left rank 1's catalog: the next query agrees on BAD at once.
    assert r1["b_after"]["kv_hit_pages"] == BAD
    assert r0["b_after"]["kv_hit_pages"] == N
    assert r0["b_after"]["agreed_pages"] == r1["b_after"]["agreed_pages"] == BAD
