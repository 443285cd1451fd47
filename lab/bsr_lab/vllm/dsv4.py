"""DeepSeek-V4 on vllm-cpu 0.32.0: the tiny model and the workarounds it needs to run.

TEST SUPPORT, not part of the connector. vllm-cpu 0.32.0's DeepSeek-V4 CPU model
(`vllm/models/deepseek_v4/cpu/`) runs only on a CPU with AMX (`amx_tile`), and even
there only with the workarounds in `apply_vllm_cpu_workarounds` (vllm-hybrid.md):

1. Triton without a CPU backend. The model's attention-metadata builders launch
   `@triton.jit` kernels, and PyPI's Triton has no CPU backend, so vLLM disables
   Triton (`vllm/triton_utils/importing.py`: "Triton is installed, but doesn't include
   CPU backend. Disabling Triton.") and the first prefill fails in its placeholder:
   `TypeError: 'function' object is not subscriptable` (`v1/attention/ops/metadata.py`,
   `compute_token_to_req_indices`). Workaround: run the kernels in Triton's interpreter
   (`TRITON_INTERPRET=1`) and register a stand-in "cpu" backend entry so that vLLM sees
   Triton; the interpreter compiles nothing, so the stand-in only answers `is_active`.
   Seeing Triton, vLLM would switch to its V2 model runner (`config/vllm.py`,
   `use_v2_model_runner`: V1 only without Triton), so `VLLM_USE_V2_MODEL_RUNNER=0`
   keeps the V1 runner every other engine test here runs (DeepSeek-V4 without the
   connector gave the same tokens under V2 too).
2. `DeepseekV4CPUSparseSWAMetadataBuilder.build_tile_scheduler`
   (`vllm/models/deepseek_v4/cpu/cpu_mla.py`) returns only the 'swaonly', 'c4a' and
   'c128a' entries, and the shared builder then reads 'c1a' and 'c2a':
   `KeyError: 'c1a'` (`v1/attention/backends/mla/sparse_swa.py`, `build`). Workaround:
   the missing entries as None, which is what the CPU path holds for the others.
3. `load_format="dummy"` fills weights uniformly in +-1e-3: the output then ignores
   the context (two prompts with different prefixes give the same tokens), so no
   comparison could fail. Workaround: `refill_weights` redraws every weight from a
   seeded generator, larger.

Each was checked by leaving it out alone (the errors above are what vllm-cpu 0.32.0
raised here). The workarounds patch this process only: the engine runs in it
(`VLLM_ENABLE_V1_MULTIPROCESSING=0`, TP=1), so call `apply_vllm_cpu_workarounds()`
before vLLM is imported. An in-process engine steps only inside `generate`, so the
run steps it itself while a finished request's save is pending (`saved`, `reset`).
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path
from typing import Any

VLLM_VERSION = "0.32.0"
AMX_SKIP = "vllm-cpu runs DeepSeek-V4 only with AMX; this CPU has none"

BLOCK = 256  # the platform forces it for DeepSeek-V4 (platforms/cpu.py)
VOCAB = 512


def has_amx() -> bool:
    from bsr_io.cli.report import machine

    return bool(machine()["amx"])


def apply_vllm_cpu_workarounds() -> None:
    """Workarounds 1 and 2 of this module's docstring, for vllm-cpu 0.32.0 only."""
    if "vllm" in sys.modules:
        raise RuntimeError("apply_vllm_cpu_workarounds must run before vLLM is imported")
    os.environ["TRITON_INTERPRET"] = "1"
    os.environ["VLLM_USE_V2_MODEL_RUNNER"] = "0"
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    _register_triton_cpu_stand_in()
    from importlib.metadata import version

    got = version("vllm")
    if not got.startswith(VLLM_VERSION):
        raise RuntimeError(f"these workarounds are for vllm-cpu {VLLM_VERSION}; found {got}")
    _patch_tile_scheduler()


def _register_triton_cpu_stand_in() -> None:
    # Triton ships no type information.
    from triton.backends import Backend, backends  # type: ignore[import-untyped]
    from triton.backends.compiler import BaseBackend  # type: ignore[import-untyped]
    from triton.backends.driver import DriverBase  # type: ignore[import-untyped]

    class InterpreterOnlyDriver(DriverBase):  # type: ignore[misc]
        """Answers vLLM's 'is there a CPU backend' check; under TRITON_INTERPRET=1
        nothing is compiled or launched through a driver."""

        @classmethod
        def is_active(cls) -> bool:
            return True

        def map_python_to_cpp_type(self, ty: str) -> str:
            raise NotImplementedError("interpreter only")

        def get_current_target(self) -> Any:
            raise NotImplementedError("interpreter only")

        def get_active_torch_device(self) -> Any:
            import torch

            return torch.device("cpu")

        def get_benchmarker(self) -> Any:
            raise NotImplementedError("interpreter only")

    backends.setdefault("cpu", Backend(BaseBackend, InterpreterOnlyDriver))


def _patch_tile_scheduler() -> None:
    from vllm.models.deepseek_v4.cpu.cpu_mla import DeepseekV4CPUSparseSWAMetadataBuilder
    from vllm.v1.attention.backends.mla import sparse_swa

    cls: Any = DeepseekV4CPUSparseSWAMetadataBuilder
    original = cls.build_tile_scheduler
    every = [getattr(sparse_swa, n) for n in dir(sparse_swa) if n.startswith("_LAYER_TYPE_")]

    def build_tile_scheduler(self: Any, num_decode_tokens: int) -> dict[str, Any]:
        out: dict[str, Any] = original(self, num_decode_tokens)
        return {**dict.fromkeys(every), **out}

    cls.build_tile_scheduler = build_tile_scheduler


def write_tiny_dsv4(path: str | os.PathLike[str], *, layers: int = 4) -> str:
    """A tiny DeepSeek-V4 (config only: the engine loads dummy weights and
    `refill_weights` redraws them). Layers with compression ratios 0 (sliding window
    only), 4 and 128, so vLLM makes every kind of DeepSeek-V4 KV cache group: with 4
    layers, seven groups (a sliding-window cache per layer, the compressed and indexer
    caches, and the compressor states of the ratio-4 and of the ratio-128 layers)."""
    out = Path(path)
    if (out / "config.json").exists():
        return str(out)
    out.mkdir(parents=True, exist_ok=True)
    ratios = ([0, 4, 128] * layers)[:layers]
    cfg = {
        "architectures": ["DeepseekV4ForCausalLM"],
        "model_type": "deepseek_v4",
        "torch_dtype": "bfloat16",
        "vocab_size": VOCAB,
        "bos_token_id": 0,
        "eos_token_id": 1,
        "hidden_size": 256,
        "num_hidden_layers": layers,
        "num_nextn_predict_layers": 0,
        "compress_ratios": ratios,
        "num_attention_heads": 16,
        "num_key_value_heads": 1,
        "head_dim": 512,
        "qk_rope_head_dim": 64,
        "q_lora_rank": 128,
        "o_lora_rank": 128,
        "o_groups": 4,
        "sliding_window": 128,
        "index_n_heads": 64,
        "index_head_dim": 128,
        "index_topk": 512,
        "hc_mult": 4,
        "hc_sinkhorn_iters": 20,
        "hc_eps": 1e-6,
        "rms_norm_eps": 1e-6,
        "hidden_act": "silu",
        "swiglu_limit": 10.0,
        # The CPU expert-routing kernel rejects small expert counts (vllm-hybrid.md).
        "n_routed_experts": 256,
        "num_experts_per_tok": 6,
        "n_shared_experts": 1,
        "moe_intermediate_size": 32,
        "norm_topk_prob": True,
        "routed_scaling_factor": 1.5,
        "scoring_func": "sqrtsoftplus",
        "topk_method": "noaux_tc",
        "num_hash_layers": 0,
        "max_position_embeddings": 8192,
        "rope_theta": 10000.0,
        "compress_rope_theta": 160000.0,
        "rope_scaling": {
            "type": "yarn",
            "factor": 16,
            "original_max_position_embeddings": 512,
            "beta_fast": 32,
            "beta_slow": 1,
        },
    }
    (out / "config.json").write_text(json.dumps(cfg, indent=1))
    return str(out)


def refill_weights(model: Any, seed: int = 0, scale: float = 0.2) -> int:
    """Workaround 3: every floating-point parameter redrawn from N(0, scale) by a
    generator seeded per parameter name (the same weights in every engine), norms
    around 1. Returns the number of parameters refilled."""
    import zlib

    import torch

    n = 0
    with torch.no_grad():
        for name, p in model.named_parameters():
            if not p.is_floating_point():
                continue
            g = torch.Generator().manual_seed(seed ^ zlib.crc32(name.encode()))
            x = torch.randn(p.shape, generator=g, dtype=torch.float32)
            if "norm" in name:
                x = 1.0 + 0.1 * x
            else:
                x = scale * x
            p.copy_(x.to(p.dtype))
            n += 1
    return n


# -- the engine run: one engine with the connector, one without, same threads ----------
CHUNK = 256  # vLLM's hit alignment on DeepSeek-V4 (the lcm of its group block sizes)
STEP = 1024  # max_num_batched_tokens
MAX_LEN = 2048


def prompts() -> dict[str, list[int]]:
    from bsr_lab.vllm.harness import tokens

    a = tokens(61, 2 * CHUNK)
    return {
        "A": a + tokens(62, 17),  # computed and saved: 2 whole chunks
        "A2": a + tokens(63, 17),  # A's prefix under another question: restores 2 chunks
        "A2x": tokens(64, 2 * CHUNK) + tokens(63, 17),  # A2's question after another prefix
        "Z": tokens(65, 2 * CHUNK + 17),  # one group's records zeroed before its restore
    }


def dsv4_engine(model: str, connector: dict[str, Any] | None) -> Any:
    from bsr_lab.vllm.harness import engine

    llm = engine(
        model,
        1,
        connector=connector,
        max_model_len=MAX_LEN,
        block_size=BLOCK,
        max_num_batched_tokens=STEP,
        load_format="dummy",
    )
    llm.apply_model(refill_weights)  # the engine core runs in this process
    return llm


def run_baseline(model: str) -> dict[str, Any]:
    from bsr_lab.vllm.harness import generate

    llm = dsv4_engine(model, None)
    P = prompts()
    return {name: generate(llm, P[name])[0] for name in ("A2", "A2x", "Z")}


def saved(llm: Any, events: Any, rid: str, timeout: float = 120.0) -> list[dict[str, Any]]:
    """The save events of finished request `rid`, stepping the engine until they come.
    In process, vLLM steps only while `generate` runs, and a finished request's save is
    queued at the next step (its scheduler keeps the request until the connector says it
    was sent), so the engine is stepped here as its own core loop would."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        got: list[dict[str, Any]] = events.of(rid, "save")
        if got:
            return got
        llm.llm_engine.step()
        time.sleep(0.02)
    raise TimeoutError(f"no save event for request {rid}")


def reset(llm: Any, timeout: float = 60.0) -> None:
    """Drop vLLM's local prefix cache, stepping the engine until the finished requests'
    blocks are released (see `saved`)."""
    deadline = time.monotonic() + timeout
    while not llm.reset_prefix_cache():
        if time.monotonic() > deadline:
            raise TimeoutError("vLLM's prefix cache could not be reset (blocks still held)")
        llm.llm_engine.step()
        time.sleep(0.02)


def run(model: str, work: str, zero_group: int) -> dict[str, Any]:
    """Save A, restore its prefix under A2; save Z, zero `zero_group`'s records of it
    (a test double: well-formed records, valid checksums), restore Z."""
    from bsr_lab.vllm.harness import FINISH_SAVES, Events, generate, groups_of, plant_foreign_kv

    store = os.path.join(work, "store")
    events = Events(os.path.join(work, "events.jsonl"))
    cfg = {
        **FINISH_SAVES,
        "store_dir": store,
        # Six window groups cut a record each at every chunk boundary, in one step: a
        # window of 8 slots and a step budget that lets the writers free them (the
        # default 0.05 s skips some here, and a skipped record is a later miss).
        "window": 8,
        "step_save_budget_s": 5.0,
        "chunk_tokens": CHUNK,
        "load_timeout_s": 60.0,
        "save_timeout_s": 300.0,
        "events_path": events.path,
    }
    llm = dsv4_engine(model, cfg)
    P = prompts()
    out: dict[str, Any] = {"groups": groups_of(events)}

    def request(name: str, save: bool = False) -> dict[str, Any]:
        toks, cached, rid, dt = generate(llm, P[name])
        if save:
            bad = [e for e in saved(llm, events, rid) if e["outcome"] != "complete"]
            if bad:
                raise RuntimeError(f"the save of {name} failed: {bad}")
        return {"tokens": toks, "cached": cached, "loads": events.of(rid, "load"), "seconds": dt}

    out["A"] = request("A", save=True)
    reset(llm)
    out["A2"] = request("A2")
    request("Z", save=True)
    out["Z_zeroed"] = plant_foreign_kv(
        events, store, 1, model, P["Z"], P["Z"], CHUNK, groups=[zero_group], zero=True
    )
    reset(llm)
    out["Z"] = request("Z")
    out["zero_group"] = zero_group
    return out


def main(argv: list[str] | None = None) -> int:
    import argparse

    ap = argparse.ArgumentParser(prog="python -m bsr_lab.vllm.dsv4")
    ap.add_argument("what", choices=["run", "baseline"])
    ap.add_argument("--work", required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--zero-group", type=int, default=0)
    args = ap.parse_args(argv)
    if not has_amx():
        raise SystemExit(AMX_SKIP)
    apply_vllm_cpu_workarounds()
    os.makedirs(args.work, exist_ok=True)
    model = os.path.abspath(write_tiny_dsv4(os.path.join(args.work, "..", "model-dsv4")))
    if args.what == "baseline":
        result: dict[str, Any] = {"model": model, "outputs": run_baseline(model)}
    else:
        result = {"model": model, **run(model, args.work, args.zero_group)}
    Path(args.out).write_text(json.dumps(result, default=str))
    return 0


if __name__ == "__main__":
    sys.exit(main())
