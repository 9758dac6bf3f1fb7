"""Converting a GGUF checkpoint into a plain Hugging Face directory one tensor at a time.

transformers' own conversion (`from_pretrained(gguf_file=...)`) builds the whole de-quantized
state dict and a model to load it into, so a start that converts holds the model twice in fp32:
SmolLM2-135M's start peaked at 1,340 MiB that way against 925 MiB for a start that finds the
conversion cached (bench/results/runner_llama.md S51). `stream_convert` writes the same tensors
(transformers' own name map and tensor processors, so the loaded model is equal to theirs, which
tests/runner/test_gguf_convert.py checks) into safetensors shards of at most SHARD_BYTES, holding
one shard and one tensor's bytes and de-quantization at a time (the bytes read, not mapped, so a
checkpoint of many GiB does not stay resident as it is converted). It takes the architectures transformers
converts through its per-tensor path with the Llama or the plain processor (Llama, Mistral,
Qwen2, ...); for the others it returns False, writing nothing, and the caller converts them
transformers' way.
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Callable

import numpy as np
import torch

from magnitude.runner.file_pages import trim_heap

SHARD_BYTES = 64 * 1024 * 1024
DEQUANTIZE_ROWS = 1024
INDEX_NAME = "model.safetensors.index.json"


def _processor_class(architecture: str) -> type | None:
    """transformers' tensor processor for a GGUF `general.architecture`, where the streaming
    conversion reproduces its whole effect (it reads only the tensor in hand); None otherwise."""
    from transformers.integrations.gguf.utils import is_gguf_arch_supported
    from transformers.modeling_gguf_pytorch_utils import (TENSOR_PROCESSORS, LlamaTensorProcessor,
                                                          TensorProcessor)

    if is_gguf_arch_supported(architecture):  # transformers' packed-weights path, not the per-tensor one
        return None
    cls = TENSOR_PROCESSORS.get(architecture, TensorProcessor)
    return cls if cls in (TensorProcessor, LlamaTensorProcessor) else None


def _parse(path: Path) -> tuple[str, list[Any]]:
    """The GGUF's `general.architecture` and its tensors' descriptions, from one parse of its
    metadata. The reader itself, which holds every field parsed (the tokenizer's 49,152 tokens and
    merges, each an array of its own), is dropped and its heap pages given back: the conversion
    needs neither."""
    from gguf import GGUFReader
    from transformers.modeling_gguf_pytorch_utils import read_field

    reader = GGUFReader(str(path))
    architecture, tensors = str(read_field(reader, "general.architecture")[0]), list(reader.tensors)
    del reader
    trim_heap()
    return architecture, tensors


def stream_convert(path: Path, dtype: torch.dtype, out: Path, name: str) -> bool:
    """Write config.json, generation_config.json and the weights of the GGUF at `path` into the
    (existing, empty) folder `out`, as `from_pretrained(gguf_file=...)` followed by `save_pretrained`
    would, in `dtype`. `name`: the config's name_or_path. Returns False, writing nothing, for an
    architecture not converted tensor by tensor (`_processor_class`)."""
    from gguf import dequantize
    from transformers import AutoConfig, AutoModelForCausalLM, GenerationConfig
    from transformers.modeling_gguf_pytorch_utils import get_gguf_hf_weights_map, load_gguf_checkpoint

    architecture, tensors = _parse(path)
    processor_class = _processor_class(architecture)
    if processor_class is None:
        return False
    config = AutoConfig.from_pretrained(path.parent, gguf_file=path.name)
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    with torch.device("meta"):  # names and shapes only: no memory for the weights
        skeleton = AutoModelForCausalLM.from_config(config)
    processor = processor_class(config=load_gguf_checkpoint(str(path), return_tensors=False)["config"])
    names = get_gguf_hf_weights_map(skeleton, processor)
    config.architectures = [type(skeleton).__name__]
    config.dtype = dtype
    config.name_or_path = name
    generation = GenerationConfig.from_model_config(config)
    del skeleton
    trim_heap()  # transformers' parses of the metadata, given back before the weights

    writer = _ShardWriter(out)
    with path.open("rb") as file:
        for tensor in tensors:
            _convert_tensor(tensor, _read(file, tensor), dequantize, processor, names, dtype, writer)
    writer.close()
    config.save_pretrained(out)
    generation.save_pretrained(out)
    return True


def _read(file: Any, tensor: Any) -> np.ndarray:
    """The tensor's bytes read from the open file, shaped as the reader's view of them: read, not
    mapped, so they leave the process when converted (the reader's mapping would keep every page it
    touched resident until it is closed: the whole file by the last tensor)."""
    file.seek(tensor.data_offset)
    raw = np.fromfile(file, dtype=np.uint8, count=tensor.n_bytes)
    if raw.size != tensor.n_bytes:
        raise ValueError(f"{tensor.name}: the file ends before its {tensor.n_bytes} bytes")
    return raw.view(tensor.data.dtype).reshape(tensor.data.shape)


def _convert_tensor(tensor: Any, data: np.ndarray, dequantize: Callable[[np.ndarray, Any], np.ndarray],
                    processor: Any, names: dict[str, str], dtype: torch.dtype, writer: _ShardWriter) -> None:
    """De-quantize one tensor, apply transformers' processor and name map, and hand it to `writer`."""
    result = processor.process(weights=_dequantized(data, tensor.tensor_type, dequantize), name=tensor.name)
    if result.name not in names:  # e.g. rope_freqs: transformers drops them too
        return
    # a view of the bytes read (an F32 tensor) is copied, an array of our own is taken as it is
    weights = np.require(result.weights, requirements=["C_CONTIGUOUS", "WRITEABLE", "OWNDATA"])
    writer.add(names[result.name], torch.from_numpy(weights).to(dtype))


def _dequantized(data: np.ndarray, kind: Any, dequantize: Callable[[np.ndarray, Any], np.ndarray]) -> np.ndarray:
    """gguf's `dequantize` of a tensor's `data` (of GGML type `kind`), DEQUANTIZE_ROWS rows at a
    time into one array: the whole tensor at once holds several float copies of it (SmolLM2's Q8_0
    embeddings, 108 MiB in fp32, took 140 MiB more than their result)."""
    if data.ndim < 2 or data.shape[0] <= DEQUANTIZE_ROWS:
        return dequantize(data, kind)
    first = dequantize(data[:DEQUANTIZE_ROWS], kind)
    out = np.empty((data.shape[0], *first.shape[1:]), dtype=first.dtype)
    out[:DEQUANTIZE_ROWS] = first
    for start in range(DEQUANTIZE_ROWS, data.shape[0], DEQUANTIZE_ROWS):
        out[start:start + DEQUANTIZE_ROWS] = dequantize(data[start:start + DEQUANTIZE_ROWS], kind)
    return out


class _ShardWriter:
    """Tensors into safetensors shards of at most SHARD_BYTES each (a bigger tensor alone), named
    as transformers names its shards, with their index; a single shard is model.safetensors."""

    def __init__(self, out: Path) -> None:
        self.out = out
        self.pending: dict[str, torch.Tensor] = {}
        self.pending_bytes = 0
        self.files: list[tuple[Path, list[str]]] = []
        self.total = 0

    def add(self, name: str, tensor: torch.Tensor) -> None:
        size = tensor.numel() * tensor.element_size()
        if self.pending and self.pending_bytes + size > SHARD_BYTES:
            self._flush()
        self.pending[name] = tensor.contiguous()
        self.pending_bytes += size
        self.total += size

    def _flush(self) -> None:
        from safetensors.torch import save_file

        part = self.out / f".part-{len(self.files):05d}.safetensors"
        save_file(self.pending, str(part), metadata={"format": "pt"})
        self.files.append((part, list(self.pending)))
        self.pending, self.pending_bytes = {}, 0

    def close(self) -> None:
        if self.pending:
            self._flush()
        if len(self.files) == 1:
            self.files[0][0].rename(self.out / "model.safetensors")
            return
        weight_map: dict[str, Any] = {}
        for i, (part, tensors) in enumerate(self.files, start=1):
            final = f"model-{i:05d}-of-{len(self.files):05d}.safetensors"
            part.rename(self.out / final)
            weight_map.update((t, final) for t in tensors)
        index = {"metadata": {"total_size": self.total}, "weight_map": dict(sorted(weight_map.items()))}
        (self.out / INDEX_NAME).write_text(json.dumps(index, indent=2) + "\n")
