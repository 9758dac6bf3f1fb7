"""How far int8 weights stray from fp32: teacher-forced top-1 agreement and mean KL, per variant.

    .venv/bin/python bench/int8_quality.py [--alphas 0.3,0.5,0.65,0.8]

Runs the bundled model in fp32 over an evaluation text the calibration never saw (the runner
tests' prompts plus two sentences), then each int8 variant over the same tokens: weight-only
(activations stay fp32), W8A8 without smoothing, W8A8 smoothed at each alpha, and what ships
(`quantize_linears`: decoder linears + LM head, alpha SMOOTHING_ALPHA). Prints agreement of the
argmax token with fp32's and the mean KL(fp32 || int8) per position.
"""

from __future__ import annotations

import argparse
import copy
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT / "server"), str(ROOT)]

import torch  # noqa: E402
from torch import nn  # noqa: E402

from magnitude.runner.loading import load_model  # noqa: E402
from magnitude.runner.quantize import (  # noqa: E402
    CALIBRATION_TEXT, Int8Linear, calibrate_input_absmax, quantization_targets, quantize_linears)
from tests.runner.conftest import PROMPTS  # noqa: E402

EVAL_TEXT = " ".join(PROMPTS) + (" The quick brown fox jumps over the lazy dog. Machine learning models are trained"
                                 " on large datasets of text.")


class WeightOnlyInt8(nn.Module):
    """Per-channel int8 weights de-quantized back to fp32; activations untouched."""

    def __init__(self, lin: nn.Linear) -> None:
        super().__init__()
        w = lin.weight.detach()
        scale = w.abs().amax(1, keepdim=True) / 127
        self.weight = torch.round(w / scale) * scale

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x @ self.weight.t()


def decoder_linears(model: nn.Module) -> list[tuple[nn.Module, str, nn.Linear]]:
    """The decoder layers' linears only: the variants below leave the LM head in fp32."""
    return [t for t in quantization_targets(model) if t[1] != "lm_head"]


def compare(ref_logprobs: torch.Tensor, model: nn.Module, ids: torch.Tensor) -> tuple[float, float]:
    with torch.inference_mode():
        got = torch.log_softmax(model(input_ids=ids, use_cache=False).logits[0].float(), -1)
    agreement = (ref_logprobs.argmax(-1) == got.argmax(-1)).float().mean().item()
    kl = (ref_logprobs.exp() * (ref_logprobs - got)).sum(-1).mean().item()
    return agreement, kl


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--alphas", default="0.3,0.5,0.65,0.8")
    args = p.parse_args()
    loaded = load_model(dtype="float32")
    ref, tok = loaded.model, loaded.tokenizer
    ids = torch.tensor([tok(EVAL_TEXT)["input_ids"]])
    calibration = tok(CALIBRATION_TEXT)["input_ids"]
    with torch.inference_mode():
        ref_logprobs = torch.log_softmax(ref(input_ids=ids, use_cache=False).logits[0].float(), -1)
    cpu = torch.device("cpu")
    absmax = calibrate_input_absmax(ref, [c for _, _, c in decoder_linears(ref)], calibration, cpu)

    def variant(make) -> nn.Module:
        model = copy.deepcopy(ref)
        for (parent, name, child), (_, _, original) in zip(decoder_linears(model), decoder_linears(ref)):
            setattr(parent, name, make(child, absmax[id(original)]))
        return model

    rows = [("weight-only int8, fp32 activations", variant(lambda c, a: WeightOnlyInt8(c))),
            ("W8A8, no smoothing", variant(lambda c, a: Int8Linear(c)))]
    for alpha in (float(a) for a in args.alphas.split(",")):
        rows.append((f"W8A8, smoothing alpha {alpha}", variant(lambda c, a, al=alpha: Int8Linear(c, a, al))))
    shipped = copy.deepcopy(ref)
    quantize_linears(shipped, "int8", cpu, calibration)
    rows.append(("what ships: quantize_linears (+ int8 LM head)", shipped))
    print(f"{ids.shape[1]} evaluation tokens; {len(calibration)} calibration tokens")
    print(f"{'variant':48} {'top-1 agreement':>16} {'mean KL':>9}")
    for name, model in rows:
        agreement, kl = compare(ref_logprobs, model, ids)
        print(f"{name:48} {agreement:16.3f} {kl:9.4f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
