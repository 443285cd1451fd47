"""What a soak of `vllm serve` with bsr-io is made of (issue 31): the server's shape,
its prompts, streaming clients that abort, the closeness rule for greedy outputs under
load, and a sampler of the server's fds, threads and RSS. The bounded soak in the tests
(`tests/integrations/vllm/test_serve_soak.py`) and the long one (`bsr-lab bench soak`)
are built from these.

Equality under load: the reference is each prompt's greedy output computed alone, from
scratch. vLLM itself (no connector) can change a tiny bf16 model's greedy tokens under
batching, chunked prefill and preemption where two tokens are near-tied, so an output
counts as equal when it matches the reference, or where it first differs, its own token
and the reference's token are within GAP of log-probability in its own top-5 (the tiny
model gets a word-level tokenizer so the server can return log-probs).
"""

from __future__ import annotations

import threading
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from bsr_lab.vllm.harness import VOCAB, tokens, write_tiny_llama
from bsr_lab.vllm.server import Server, default_args

CHUNK = 64
DOC_CHUNKS = 8
MAX_TOKENS = 40  # decode crosses block boundaries: running requests need blocks
CLIENTS = 8
# A near tie, in nats: the tiny model's bf16 logits (magnitude 8-16) come in steps of
# 1/16, and two candidates one or two steps apart swap under batching (seen: 0.0625).
GAP = 0.13
TOP = 5
# 1,120 tokens: two requests of 17 blocks fit, then each needs an 18th (preemption).
KV_BLOCKS = 35
STEP_TOKENS = 128  # chunked prefill, a small step

Output = tuple[list[int], list[dict[int, float]]]  # tokens, each one's top-5 log-probs
# (prompt name, how the client ends it): "full", "first" (closed after the first tokens)
# or "early" (closed before any token: during its load or prefill).
Job = tuple[str, str]


def prompts(first: int, docs: int, questions: int) -> dict[str, list[int]]:
    """`questions` prompts over each of `docs` documents of DOC_CHUNKS chunks (shared
    prefixes), seeded by the document's number."""
    out = {}
    for d in range(first, first + docs):
        doc = tokens(500 + d, DOC_CHUNKS * CHUNK)
        for q in range(questions):
            out[f"d{d}q{q}"] = doc + tokens(900 + 10 * d + q, 20)
    return out


def errors(log: str) -> list[str]:
    """Error lines and tracebacks, but for vLLM's warning that it cannot warm up a chat
    template without a tokenizer (a WARNING with its traceback)."""
    return [
        line
        for line in log.splitlines()
        if (" ERROR " in line or "Traceback" in line or "CRITICAL" in line)
        and " WARNING " not in line
    ]


def write_word_tokenizer(model: str) -> None:
    """A word-level tokenizer ("t<id>" for every id) beside the tiny model, so the server
    can return log-probs (it refuses them without a tokenizer)."""
    import transformers
    from tokenizers import Tokenizer, models, pre_tokenizers

    vocab = {f"t{i}": i for i in range(VOCAB)}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="t0"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    fast = transformers.PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="t0")  # type: ignore[no-untyped-call]
    fast.save_pretrained(model)


def soak_model(work: Path) -> str:
    """The tiny Llama with its word tokenizer, under `work`."""
    model = write_tiny_llama(work / "model")
    write_word_tokenizer(model)
    return model


def soak_server(model: str, store: Path, events_path: str, port: int, log: Path) -> Server:
    """One TP=1 server with bsr-io's connector (records in `store`, events to
    `events_path`, metrics on `port`): a KV cache small enough to preempt, chunked
    prefill with a small step, CLIENTS sequences at most."""
    connector = {
        "store_dir": str(store),
        "window": 4,
        "chunk_tokens": CHUNK,
        "load_timeout_s": 30,
        "save_timeout_s": 120,
        "events_path": events_path,
        "metrics_port": port,
    }
    return Server(
        model,
        connector=connector,
        log=log,
        max_model_len=1024,
        base_args=False,
        args=[
            *[a for a in default_args(1024) if a != "--skip-tokenizer-init"],
            "--num-gpu-blocks-override",
            str(KV_BLOCKS),
            "--max-num-batched-tokens",
            str(STEP_TOKENS),
            "--max-num-seqs",
            str(CLIENTS),
        ],  # fmt: skip
        threads_bind="0-1",
        env={"BSR_IO_FAULTS": "[]"},
    )


def stream(srv: Server, prompt: list[int], end: str = "full") -> Output | None:
    """A streamed greedy completion with log-probs, ended as `end` says (None unless
    "full"). An early close is a client timing out before the first token."""
    if end == "early":
        try:
            for _ in srv.stream(prompt, MAX_TOKENS, timeout=0.05, logprobs=TOP):
                break
        except OSError:  # the timeout: the connection is closed
            pass
        return None
    out = srv.streamed(prompt, MAX_TOKENS, end == "first", logprobs=TOP)
    return None if out is None else (out.tokens, out.tops)


def gap(out: Output, ref: list[int]) -> float:
    """0 when `out` equals the reference; else at the first difference, how much more
    log-probability `out` gave its own token than the reference's (inf: not in its top)."""
    toks, top = out
    for i, (a, b) in enumerate(zip(toks, ref, strict=False)):
        if a != b:
            return top[i][a] - top[i][b] if b in top[i] else float("inf")
    return 0.0 if len(toks) == len(ref) else float("inf")


Result = tuple[str, str, Output | None]  # prompt name, its end, its output


def diverged(got: list[Result], ref: dict[str, list[int]]) -> tuple[list[Any], list[float]]:
    """(outputs beyond GAP, the gaps of near-tied ones) of the results run in full."""
    bad, ties = [], []
    for name, end, out in got:
        if end != "full":
            continue
        assert out is not None
        g = gap(out, ref[name])
        if g > GAP:
            bad.append((name, g, out[0], ref[name]))  # gap, output, reference
        elif g > 0:
            ties.append(g)
    return bad, ties


def drive(srv: Server, jobs: list[Job], P: dict[str, list[int]]) -> list[Result]:
    """Run the jobs on CLIENTS concurrent streaming clients."""
    with ThreadPoolExecutor(CLIENTS) as pool:
        futs = [pool.submit(stream, srv, P[name], end) for name, end in jobs]
        return [(name, end, f.result()) for (name, end), f in zip(jobs, futs, strict=True)]


def metric(srv: Server, name: str) -> float:
    """A vLLM counter, summed over its labels."""
    return sum(v for k, v in srv.metrics().items() if k.split("{")[0] == name)


class Sampler:
    """The server tree's fds, threads and RSS every `every` s, on a thread of its own;
    each sample also holds `extra()`'s fields (the soak's segment, its time)."""

    def __init__(self, srv: Server, every: float = 1.0, extra: Any = None) -> None:
        self.samples: list[dict[str, float]] = []
        self._extra = extra or dict
        self._stop = threading.Event()
        self._t = threading.Thread(target=self._run, args=(srv, every), daemon=True)
        self._t.start()

    def _run(self, srv: Server, every: float) -> None:
        while not self._stop.wait(every):
            self.samples.append(srv.usage() | self._extra())

    def stop(self) -> list[dict[str, float]]:
        self._stop.set()
        self._t.join()
        return self.samples
