"""What, besides token ids, decides a prefix's KV, folded into bsr-io's keys.

vLLM's prefix cache never shares blocks across different `cache_salt`s (tenant
isolation), LoRA adapters or multimodal inputs; bsr-io's keys must not either. The
salt and adapter are digested into the key's model field, so each context gets its
own namespace directory. A request carrying anything this module cannot capture
(multimodal features, prompt embeddings) has no identity: it is a miss and is not
saved, never a guess.
"""

from __future__ import annotations

import hashlib
import json
from typing import Any


def model_identity(vllm_config: Any, override: str | None = None) -> str:
    """The weights the KV was computed with: the user's name, or model and revision."""
    if override:
        return override
    mc = vllm_config.model_config
    return f"vllm:{mc.model}@{getattr(mc, 'revision', None) or 'main'}:{mc.dtype}"


def context_digest(cache_salt: str | None, lora: Any = None) -> str:
    doc: dict[str, Any] = {"salt": cache_salt}
    if lora is not None:
        doc["lora"] = [
            getattr(lora, "lora_name", None),
            getattr(lora, "lora_int_id", None),
            getattr(lora, "lora_path", None),
        ]
    text = json.dumps(doc, sort_keys=True).encode()
    return hashlib.blake2b(text, digest_size=8, person=b"bsr-vllm-ctx").hexdigest()


def key_model(model: str, cache_salt: str | None = None, lora: Any = None) -> str:
    """The `ChunkKey.model` of a request's chunks: weights plus context."""
    return f"{model}#{context_digest(cache_salt, lora)}"


def request_key_model(model: str, request: Any) -> str | None:
    """`key_model` for a vLLM request, or None when its identity is not fully captured."""
    if getattr(request, "mm_features", None):
        return None
    if getattr(request, "prompt_embeds", None) is not None:
        return None
    return key_model(model, getattr(request, "cache_salt", None),
                     getattr(request, "lora_request", None))  # fmt: skip
