"""Tiny random-weight causal LMs built from their configs, saved as Hugging Face folders (safetensors
+ a word-level tokenizer over the vocabulary), for the architecture and hub-source tests."""

from __future__ import annotations

from pathlib import Path

import torch

VOCAB = 320
WINDOW = 8
COMMON = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
              num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
              initializer_range=0.5, bos_token_id=1, eos_token_id=2, pad_token_id=0, tie_word_embeddings=False)


def tiny_config(arch: str):
    import transformers as t

    if arch == "llama":
        return t.LlamaConfig(**COMMON)
    if arch == "qwen2":
        return t.Qwen2Config(**COMMON, use_sliding_window=False)
    if arch == "qwen2-sliding":
        # Qwen2's window applies from layer max_window_layers on: layer 1 slides, layer 0 does not.
        return t.Qwen2Config(**COMMON, use_sliding_window=True, sliding_window=WINDOW, max_window_layers=1)
    if arch == "qwen3":
        return t.Qwen3Config(**COMMON, head_dim=16)
    if arch == "mistral":
        return t.MistralConfig(**COMMON, sliding_window=None)
    if arch == "mistral-sliding":
        return t.MistralConfig(**COMMON, sliding_window=WINDOW)
    if arch == "gemma":
        return t.GemmaConfig(**COMMON, head_dim=16)
    if arch == "gemma2":
        return t.Gemma2Config(**COMMON, head_dim=16, sliding_window=WINDOW, attn_logit_softcapping=5.0,
                              final_logit_softcapping=8.0, layer_types=["sliding_attention", "full_attention"])
    if arch == "gemma3":
        return t.Gemma3TextConfig(**COMMON, head_dim=16, sliding_window=WINDOW,
                                  layer_types=["sliding_attention", "full_attention"])
    if arch == "phi3":
        return t.Phi3Config(**COMMON)
    raise AssertionError(arch)


ARCHS = ["llama", "qwen2", "qwen2-sliding", "qwen3", "mistral", "mistral-sliding", "gemma", "gemma2", "gemma3", "phi3"]


def _tokenizer(path: Path) -> None:
    """A word-level tokenizer over the vocabulary: the runner loads one, the tests feed token ids."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    # Special tokens named apart from the words: an added token "t1" would also match inside "t100".
    vocab = {"<pad>": 0, "<s>": 1, "</s>": 2, "<unk>": 3, **{f"t{i}": i for i in range(4, VOCAB)}}
    word_level = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    word_level.pre_tokenizer = pre_tokenizers.WhitespaceSplit()  # "t5 t6" -> [5, 6]
    tok = PreTrainedTokenizerFast(tokenizer_object=word_level,
                                  bos_token="<s>", eos_token="</s>", pad_token="<pad>", unk_token="<unk>")
    tok.save_pretrained(path)


def build_tiny_model(arch: str, path: Path, config=None, seed: int = 0) -> Path:
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config or tiny_config(arch), dtype=torch.float32)
    model.generation_config.eos_token_id = 2
    model.save_pretrained(path)
    _tokenizer(path)
    return path
