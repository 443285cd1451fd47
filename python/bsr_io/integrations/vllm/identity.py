"""What, besides token ids, decides a prefix's KV, folded into bsr-io's keys.

The model identity names the weights (model, revision, dtype: or the user's name for
them) and digests everything else in vLLM's configuration that changes the KV those
weights compute: quantization, the KV-cache dtype, `hf_overrides` (rope scaling, ...),
the model's own rope settings, and the weights file when it differs from the model's.
Two engines whose KV could differ never share a namespace.

vLLM's prefix cache never shares blocks across different `cache_salt`s (tenant
isolation), LoRA adapters or multimodal inputs; bsr-io's keys must not either. The
salt and the adapter are digested into the key's model field, so each context gets its
own namespace directory. An adapter is known by a digest of its files' bytes, not by
its name or path: an adapter retrained in place gets new keys, so stale KV is never
reused. A request carrying anything this module cannot capture (multimodal features,
prompt embeddings, an adapter whose files cannot be read) has no identity: it is a
miss and is not saved, never a guess.
"""

from __future__ import annotations

import hashlib
import os
import threading
from typing import Any

from bsr_io.model.identity import DIGEST_BYTES, canonical, digest


def kv_settings(vllm_config: Any) -> dict[str, Any]:
    """The settings besides the weights that change the KV a model computes, in their
    canonical form (`NotCanonical`, naming the setting, for a value that has none)."""
    mc = vllm_config.model_config
    cc = vllm_config.cache_config
    hf = getattr(mc, "hf_text_config", None) or getattr(mc, "hf_config", None)
    settings: dict[str, Any] = canonical(
        {
            "quantization": getattr(mc, "quantization", None),
            "quantization_config": getattr(mc, "quantization_config", None),
            "kv_cache_dtype": str(getattr(cc, "cache_dtype", "auto")),
            "kv_cache_dtype_skip_layers": getattr(cc, "kv_cache_dtype_skip_layers", []),
            "mamba_cache_dtype": str(getattr(cc, "mamba_cache_dtype", "auto")),
            "mamba_ssm_cache_dtype": str(getattr(cc, "mamba_ssm_cache_dtype", "auto")),
            "hf_overrides": getattr(mc, "hf_overrides", None) or {},
            "rope_scaling": getattr(hf, "rope_scaling", None),
            "rope_parameters": getattr(hf, "rope_parameters", None),
            "rope_theta": getattr(hf, "rope_theta", None),
            "model_weights": getattr(mc, "model_weights", "") or "",
            "disable_sliding_window": bool(getattr(mc, "disable_sliding_window", False)),
        }
    )
    return settings


def model_identity(vllm_config: Any, override: str | None = None) -> str:
    """The weights the KV was computed with (the user's name, or model, revision and
    dtype), then a digest of the other settings that change that KV."""
    mc = vllm_config.model_config
    weights = override or f"vllm:{mc.model}@{getattr(mc, 'revision', None) or 'main'}:{mc.dtype}"
    return f"{weights};kv={digest(kv_settings(vllm_config), b'bsr-vllm-kv')}"


class AdapterUnreadable(OSError):
    """A LoRA adapter's files cannot be digested: its requests are misses."""


_ADAPTER_FILES = ("adapter_config.json", "adapter_model.safetensors", "adapter_model.bin")
_memo: dict[str, tuple[tuple[Any, ...], str]] = {}
_memo_lock = threading.Lock()


def adapter_digest(path: str) -> str:
    """A digest of a LoRA adapter's bytes (its config and weights files). Memoized on
    the files' (size, mtime, inode): one stat per file per call, a full read only when
    an adapter is new or changed (retrained in place)."""
    root = os.path.abspath(path)
    stamp: list[Any] = []
    for name in _ADAPTER_FILES:
        try:
            st = os.stat(os.path.join(root, name))
        except FileNotFoundError:
            continue
        except OSError as exc:
            raise AdapterUnreadable(f"cannot stat LoRA adapter file {name} in {root}") from exc
        stamp.append((name, st.st_size, st.st_mtime_ns, st.st_ino))
    if not any(s[0] != "adapter_config.json" for s in stamp):
        raise AdapterUnreadable(f"no LoRA adapter weights in {root}")
    key = tuple(stamp)
    with _memo_lock:
        got = _memo.get(root)
    if got is not None and got[0] == key:
        return got[1]
    h = hashlib.blake2b(digest_size=DIGEST_BYTES, person=b"bsr-vllm-lora")
    for name, size, *_ in stamp:
        h.update(f"{name}\0{size}\0".encode())
        try:
            with open(os.path.join(root, name), "rb") as f:
                while block := f.read(1 << 20):
                    h.update(block)
        except OSError as exc:
            raise AdapterUnreadable(f"cannot read LoRA adapter file {name} in {root}") from exc
    hexed = h.hexdigest()
    with _memo_lock:
        _memo[root] = (key, hexed)
    return hexed


def context_digest(cache_salt: str | None, lora: Any = None) -> str:
    doc: dict[str, Any] = {"salt": cache_salt}
    if lora is not None:
        path = getattr(lora, "lora_path", None) or getattr(lora, "path", None)
        if not path:
            raise AdapterUnreadable(
                f"LoRA adapter {getattr(lora, 'lora_name', lora)!r} has no path to digest"
            )
        doc["lora"] = adapter_digest(str(path))
    return digest(doc, b"bsr-vllm-ctx")


def key_model(model: str, cache_salt: str | None = None, lora: Any = None) -> str:
    """The `ChunkKey.model` of a request's chunks: weights plus context."""
    return f"{model}#{context_digest(cache_salt, lora)}"


def request_key_model(model: str, request: Any) -> str | None:
    """`key_model` for a vLLM request, or None when its identity is not fully captured."""
    if getattr(request, "mm_features", None):
        return None
    if getattr(request, "prompt_embeds", None) is not None:
        return None
    try:
        return key_model(
            model, getattr(request, "cache_salt", None), getattr(request, "lora_request", None)
        )
    except AdapterUnreadable:
        return None
