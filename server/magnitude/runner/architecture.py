"""Which Hugging Face checkpoints the paged runner can serve, decided from the config before loading.

The runner serves transformers' own `*ForCausalLM` classes whose attention goes through the
attention interface (`_supports_attention_backend`), with one K/V head size per layer and only
full or sliding-window attention layers (sliding windows and Gemma 2's soft-capping are handled
by `attention.py`, final-logit soft-capping by the runner). Anything else is refused here with
the reason, before any weight is read, rather than served wrongly: custom code
(`trust_remote_code`), hybrid/recurrent layers, chunked attention, latent (MLA) attention,
pre-quantized checkpoints, multimodal wrappers, pickle weights.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

SUPPORTED_LAYER_TYPES = frozenset({"full_attention", "sliding_attention"})
PICKLE_SUFFIXES = (".bin", ".pt", ".pth", ".pkl", ".ckpt")


def unsupported_reason(config: Any) -> str | None:
    """Why the runner cannot serve this config, or None. `config` is a transformers PretrainedConfig."""
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING

    model_type = getattr(config, "model_type", "?")
    if getattr(config, "auto_map", None):
        return (f"model_type {model_type!r} needs trust_remote_code (its config names custom code: "
                f"{sorted(config.auto_map)}); Magnitude runs only transformers' own model classes")
    if getattr(config, "quantization_config", None):
        method = dict(config.quantization_config).get("quant_method", "?") if hasattr(
            config.quantization_config, "keys") else getattr(config.quantization_config, "quant_method", "?")
        return (f"pre-quantized checkpoint (quantization_config, method {method!r}) is not supported; "
                "serve the full-precision weights, with --quantization for int8")
    try:
        cls = MODEL_FOR_CAUSAL_LM_MAPPING[type(config)]
    except KeyError:
        return f"model_type {model_type!r} has no causal language model class in transformers"
    if not cls.__name__.endswith("ForCausalLM"):
        return f"model_type {model_type!r} loads as {cls.__name__}, not a text-only *ForCausalLM"
    layer_types = set(getattr(config, "layer_types", None) or [])
    if layer_types - SUPPORTED_LAYER_TYPES:
        return (f"{cls.__name__} has layer types {sorted(layer_types - SUPPORTED_LAYER_TYPES)}; "
                f"the runner serves only {sorted(SUPPORTED_LAYER_TYPES)}")
    if not getattr(cls, "_supports_attention_backend", False):
        return (f"{cls.__name__}'s attention does not go through transformers' attention interface, "
                "so the paged KV cache cannot be plugged in")
    if getattr(config, "attention_chunk_size", None):
        return f"{cls.__name__} uses chunked attention (attention_chunk_size), which the runner does not implement"
    if getattr(config, "kv_lora_rank", None) or getattr(config, "v_head_dim", None):
        return f"{cls.__name__} uses latent attention (different key and value head sizes), which the KV pool does not hold"
    for field in ("num_hidden_layers", "num_attention_heads", "num_key_value_heads", "max_position_embeddings"):
        if getattr(config, field, None) is None:
            return f"{cls.__name__}'s config has no {field}, which the runner needs to size the KV cache"
    return None


def weights_reason(model_dir: Path) -> str | None:
    """Why this directory's weights cannot be loaded, or None: only safetensors are read, because
    pickle files (`.bin`, `.pt`) can run code when loaded."""
    if any(model_dir.glob("*.safetensors")):
        return None
    pickles = sorted(p.name for p in model_dir.iterdir() if p.name.endswith(PICKLE_SUFFIXES))
    if pickles:
        return f"weights are pickle files ({', '.join(pickles[:3])}); only .safetensors weights are loaded"
    return "no .safetensors weights"


def model_reason(model: Any) -> str | None:
    """Checks that need the built model: the runner calls `model.model` (the decoder) and
    `model.lm_head`, and finds each layer's K/V by the attention module's `layer_idx`."""
    if not hasattr(model, "model") or not hasattr(model, "lm_head"):
        return f"{type(model).__name__} has no .model decoder and .lm_head"
    n = int(model.config.num_hidden_layers)
    idx = sorted(getattr(m, "layer_idx") for name, m in model.named_modules()
                 if name.endswith("self_attn") and hasattr(m, "layer_idx"))
    if idx != list(range(n)):
        return f"{type(model).__name__}'s attention layers are numbered {idx[:8]}..., expected 0..{n - 1}"
    return None
