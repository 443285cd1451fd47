"""The engine side of `bsr-lab bench vllm-trace`: restored requests traced step by step.

One engine with bsr-io's connector (events on: the connector's restore traces,
bsr_io/integrations/vllm/trace.py). Per restored chunk count n, one prompt of n chunks
and a short question is computed and saved once; then, per round, after vLLM's prefix
cache is reset:

- restored: the prompt again (bsr-io loads its n chunks), traced;
- vLLM's own hit: the same prompt once more at once (vLLM caches the restored blocks),
  so the same forward (the question) follows the same n chunks, vLLM's cache alone;
- recomputed: the prompt under a fresh cache salt (a miss for both caches);
- the drive: the n records' files read back O_DIRECT, `window` at a time, in this
  process (an upper bound on the drive's own time for the bytes the load read).

Every TTFT is the client's (`LLM.generate`, max_tokens 1); the client's monotonic
submit time lines the client up with the connector's marks (one clock per machine).
"""

from __future__ import annotations

import mmap
import os
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import numpy as np

from bsr_lab.vllm.harness import (
    FINISH_SAVES,
    Events,
    engine,
    groups_of,
    record_keys,
    reset,
    tokens,
)
from bsr_lab.vllm.trace_read import phases

QUESTION = 16  # tokens after the chunks: the forward every kind of request computes
# The miss beside the busy restore: a prefill longer than vLLM's 4096-token step budget,
# so that the restore, arriving during its first step, is looked up in its second, whose
# forward computes the rest of the miss (1,040 tokens over 5,136): far longer than the read.
BUSY_CHUNKS = 20


def drive_read_s(paths: list[str], width: int) -> float:
    """Seconds to read `paths` whole, O_DIRECT, `width` files at a time (one pread each)."""
    size = max(os.path.getsize(p) for p in paths)
    size = (size + 4095) // 4096 * 4096
    bufs = [mmap.mmap(-1, size) for _ in range(width)]

    def one(i: int) -> int:
        fd = os.open(paths[i], os.O_RDONLY | os.O_DIRECT)
        try:
            return os.preadv(fd, [bufs[i % width]], 0)
        finally:
            os.close(fd)

    for b in bufs:
        b.write(bytes(size))  # faulted in before the clock starts
    with ThreadPoolExecutor(width) as pool:
        list(pool.map(lambda i: i, range(2 * width)))  # the threads started too
        times = []
        for _ in range(3):  # the fastest of three: the drive, not this process's hiccups
            t0 = time.perf_counter()
            list(pool.map(one, range(len(paths))))
            times.append(time.perf_counter() - t0)
    dt = min(times)
    for b in bufs:
        b.close()
    return dt


def _generate(llm: Any, prompt: list[int], salt: str | None = None) -> dict[str, Any]:
    from vllm import SamplingParams

    p: dict[str, Any] = {"prompt_token_ids": prompt}
    if salt is not None:
        p["cache_salt"] = salt
    mono = time.monotonic()
    t0 = time.perf_counter()
    out = llm.generate([p], SamplingParams(temperature=0, max_tokens=1), use_tqdm=False)[0]
    dt = time.perf_counter() - t0
    return {
        "ttft_s": dt,
        "submit_mono": mono,
        "done_mono": mono + dt,
        "cached": out.num_cached_tokens,
        "request_id": out.request_id,
        "token": out.outputs[0].token_ids[0],
    }


def _trace_of(events: Events, rid: str, tp: int) -> dict[str, Any]:
    """The restored request's segments: its scheduler trace, worker marks and loads."""
    evs = events.wait(rid, "load", tp, timeout=60)
    deadline = time.monotonic() + 30
    while True:
        tr = [e for e in events.of(rid, "trace") if e.get("side") == "scheduler"]
        if tr or time.monotonic() > deadline:
            break
        time.sleep(0.02)
    if not tr:
        raise RuntimeError(f"no scheduler trace for {rid}")
    worker = [e for e in events.of(rid, "trace") if e.get("side") == "worker"]
    return {"trace": tr[0], "phases": phases(tr[0], worker, evs), "loads": evs}


def run_trace(
    model: str,
    tp: int,
    work: str,
    chunk_counts: list[int],
    *,
    rounds: int = 5,
    window: int = 8,
    chunk_tokens: int = 256,
    block_size: int = 128,
) -> dict[str, Any]:
    from bsr_io.tiers.lower import LowerTier

    store = os.path.join(work, "store")
    events = Events(os.path.join(work, "events.jsonl"))
    cfg = {
        **FINISH_SAVES,
        "store_dir": store,
        "window": window,
        "chunk_tokens": chunk_tokens,
        "events_path": events.path,
        "load_timeout_s": 60.0,
    }
    max_len = max(*chunk_counts, BUSY_CHUNKS) * chunk_tokens + QUESTION + 64
    llm = engine(model, tp, connector=cfg, max_model_len=max_len, block_size=block_size)
    tier = LowerTier(store, name="L2")
    rows: list[dict[str, Any]] = []
    for n in chunk_counts:
        prompt = tokens(5000 + n, n * chunk_tokens + QUESTION)
        reset(llm)
        first = _generate(llm, prompt)  # computed and saved (salt None)
        events.wait(first["request_id"], "save", tp, timeout=600)
        paths = [
            str(tier.path_of(k))
            for g in groups_of(events)
            for k in record_keys(g, tp, prompt, model, chunk_tokens=chunk_tokens)[0][:n]
        ]
        per_round = []
        for r in range(rounds):
            print(f"vllm-trace: {n} chunks, round {r + 1} of {rounds}", flush=True)
            reset(llm)
            restored = _generate(llm, prompt)
            traced = _trace_of(events, restored["request_id"], tp)
            hit = _generate(llm, prompt)  # vLLM's own cache now holds the n chunks
            reset(llm)
            miss = _generate(llm, prompt, salt=f"recompute-{n}-{r}")
            events.wait(miss["request_id"], "save", tp, timeout=600)  # not under a restore
            drive = drive_read_s(paths, window)
            ph = traced["phases"]
            sched = traced["trace"]["marks"]
            ph["client_to_lookup"] = round(
                (sched["lookup"]["mono"] - restored["submit_mono"]) * 1e3, 3
            )
            if "sampled" in sched:
                ph["sampled_to_client"] = round(
                    (restored["done_mono"] - sched["sampled"]["mono"]) * 1e3, 3
                )
            per_round.append(
                {
                    "ttft_restored_s": restored["ttft_s"],
                    "ttft_vllm_hit_s": hit["ttft_s"],
                    "ttft_recomputed_s": miss["ttft_s"],
                    "drive_s": drive,
                    "restored_tokens": restored["cached"],
                    "hit_tokens": hit["cached"],
                    "same_token": restored["token"] == hit["token"] == first["token"],
                    "bytes_read": sum(
                        sum(e["bytes_read"].values())
                        if isinstance(e["bytes_read"], dict)
                        else int(e["bytes_read"])
                        for e in traced["loads"]
                    ),
                    "load_timings": [e.get("timings", {}) for e in traced["loads"]],
                    "phases_ms": ph,
                }
            )
        rows.append({"chunks": n, "records": len(paths), "rounds": per_round})
    return {
        "busy": _busy(llm, events, tp, chunk_counts[0], chunk_tokens),
        "tp": tp,
        "window": window,
        "chunk_tokens": chunk_tokens,
        "block_size": block_size,
        "rows": rows,
        "median_ms": {r["chunks"]: _medians(r["rounds"]) for r in rows},
    }


def _busy(llm: Any, events: Events, tp: int, n: int, chunk_tokens: int) -> dict[str, Any]:
    """A restore that arrives with a long miss: the step that sends its load computes the
    miss's prefill (the load reads meanwhile). The restored prompt is the first chunk
    count's, saved already."""
    from vllm import SamplingParams

    reset(llm)
    miss = tokens(9000, BUSY_CHUNKS * chunk_tokens + QUESTION)
    prompts: list[Any] = [
        {"prompt_token_ids": miss, "cache_salt": "busy"},
        {"prompt_token_ids": tokens(5000 + n, n * chunk_tokens + QUESTION)},
    ]
    params = [SamplingParams(temperature=0, max_tokens=k) for k in (8, 1)]
    outs = llm.generate(prompts, params, use_tqdm=False)
    traced = _trace_of(events, outs[1].request_id, tp)
    events.wait(outs[0].request_id, "save", tp, timeout=600)
    return {"trace": traced["trace"], "phases_ms": traced["phases"]}


def _medians(rounds: list[dict[str, Any]]) -> dict[str, Any]:
    def med(xs: list[float]) -> float:
        return round(float(np.median(xs)), 3)

    out: dict[str, Any] = {
        k[:-2] + "_ms": med([r[k] * 1e3 for r in rounds])
        for k in ("ttft_restored_s", "ttft_vllm_hit_s", "ttft_recomputed_s", "drive_s")
    }
    keys = {k for r in rounds for k, v in r["phases_ms"].items() if isinstance(v, float)}
    out["phases"] = {
        k: med([r["phases_ms"][k] for r in rounds if k in r["phases_ms"]]) for k in sorted(keys)
    }
    steps = [r["phases_ms"]["steps"] for r in rounds]
    out["steps"] = {k: sorted({s[k] for s in steps}) for k in steps[0]}
    out["asks"] = sorted({r["phases_ms"]["asks"] for r in rounds})
    return out
