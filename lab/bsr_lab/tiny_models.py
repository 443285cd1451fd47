"""Small transformers models built from configs with seeded random weights.

Real model implementations (nothing here reimplements attention), small enough
for CPU tests and benchmarks, and nothing is downloaded.
"""

from __future__ import annotations

import torch

# family -> (config class, model class, extra config fields)
FAMILIES: dict[str, tuple[str, str, dict]] = {
    "llama": ("LlamaConfig", "LlamaForCausalLM", {}),
    "qwen3": ("Qwen3Config", "Qwen3ForCausalLM", {}),
    "mistral": ("MistralConfig", "MistralForCausalLM", {"sliding_window": None}),
    # MLA: the cache holds a 32-wide latent and the 8-wide rotary key per token per layer
    # (the rotary embedding reads head_dim, so it is qk_rope_head_dim). Small MoE, all
    # experts in one routing group.
    "deepseek_v3": (
        "DeepseekV3Config",
        "DeepseekV3ForCausalLM",
        dict(
            kv_lora_rank=32,
            q_lora_rank=None,
            qk_rope_head_dim=8,
            qk_nope_head_dim=16,
            v_head_dim=16,
            head_dim=8,
            moe_intermediate_size=32,
            n_routed_experts=4,
            num_experts_per_tok=2,
            n_shared_experts=1,
            first_k_dense_replace=1,
            n_group=1,
            topk_group=1,
        ),
    ),
}


def tiny_model(
    family: str = "llama",
    *,
    layers: int = 2,
    hidden: int = 64,
    heads: int = 4,
    kv_heads: int = 2,
    vocab: int = 256,
    max_tokens: int = 4096,
    dtype: torch.dtype = torch.float32,
    seed: int = 0,
):
    """An eval-mode causal LM of `family` with weights drawn from `seed`."""
    import transformers

    try:
        config_name, model_name, extra = FAMILIES[family]
    except KeyError:
        raise ValueError(f"unknown family {family!r}; choose one of {sorted(FAMILIES)}") from None
    fields = dict(
        vocab_size=vocab,
        hidden_size=hidden,
        intermediate_size=2 * hidden,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        head_dim=hidden // heads,
        max_position_embeddings=max_tokens,
    )
    if "kv_lora_rank" in extra:  # MLA expands the latent to every head: no KV groups
        fields["num_key_value_heads"] = heads
    config = getattr(transformers, config_name)(**{**fields, **extra})
    torch.manual_seed(seed)
    model = getattr(transformers, model_name)(config)
    return model.to(dtype).eval()
