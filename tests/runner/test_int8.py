"""Int8 weights (W8A8 with SmoothQuant calibration, `runner/quantize.py`).

The paged runner must reproduce the model it runs: greedy output equals stock `generate` on a
separately loaded copy quantized by the same function and calibration text (so quantization is
deterministic and the runner adds no error of its own), through batching, chunking, recompute and
swap. A quality check bounds how far int8 strays from fp32, and a unit test shows what the
smoothing is for (an outlier input channel).
"""

from __future__ import annotations

import pytest

from .conftest import BLOCK_SIZE, DEVICE, MAX_NEW, MODEL, NUM_BLOCKS, NUM_SWAP_BLOCKS, PROMPTS, Preempt, ToyDriver, \
    ToySeq, _cut_at_eos, greedy

torch = pytest.importorskip("torch")

from magnitude.runner.quantize import CALIBRATION_TEXT, Int8Linear, QuantizationError, quantize_linears  # noqa: E402

pytestmark = [pytest.mark.model, pytest.mark.skipif(DEVICE != "cpu", reason="int8 weights are CPU-only")]


@pytest.fixture(scope="module")
def int8_runner(runner):
    from magnitude.runner import ModelRunner

    # After `runner`, which sets the tests' thread count for the process.
    return ModelRunner(MODEL, device=DEVICE, dtype="float32", quantization="int8", block_size=BLOCK_SIZE,
                       num_blocks=NUM_BLOCKS, num_swap_blocks=NUM_SWAP_BLOCKS, seed=0)


@pytest.fixture(scope="module")
def int8_reference(int8_runner, prompt_ids) -> list[list[int]]:
    from transformers import AutoModelForCausalLM

    from magnitude.runner.loading import cache_dir_for, resolve_source

    src = resolve_source(MODEL)
    model_dir = cache_dir_for(src, torch.float32) if src.kind == "gguf" else src.path
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32, attn_implementation="sdpa").eval()
    calibration = int8_runner.tokenizer(CALIBRATION_TEXT)["input_ids"]
    assert quantize_linears(model, "int8", torch.device("cpu"), calibration) == 30 * 7 + 1
    eos = int8_runner.eos_token_ids
    with torch.inference_mode():
        return [_cut_at_eos(model.generate(torch.tensor([ids]), max_new_tokens=MAX_NEW, do_sample=False,
                                           eos_token_id=eos, pad_token_id=eos[0])[0, len(ids):].tolist(), eos)
                for ids in prompt_ids]


def _run(int8_runner, prompt_ids, chunk=None, preempt=()) -> list[list[int]]:
    seqs = [ToySeq(f"r{i}", ids, greedy()) for i, ids in enumerate(prompt_ids)]
    driver = ToyDriver(int8_runner, chunk)
    driver.run(seqs, MAX_NEW, list(preempt))
    assert driver.all_free(), "blocks leaked"
    return [s.out for s in seqs]


def test_int8_runner_equals_generate_on_the_same_quantized_model(int8_runner, prompt_ids, int8_reference):
    assert _run(int8_runner, prompt_ids) == int8_reference


def test_int8_runner_equals_generate_under_chunks_recompute_and_swap(int8_runner, prompt_ids, int8_reference):
    preempt = [Preempt(4, "r5", "swap", resume_after=2), Preempt(7, "r4", "recompute")]
    assert _run(int8_runner, prompt_ids, chunk=16, preempt=preempt) == int8_reference


def test_int8_stays_close_to_fp32(runner, int8_runner):
    # Teacher-forced over text the calibration never saw. `bench/int8_quality.py` measures 0.937 /
    # 0.021 on a slightly longer text; without the smoothing KL is about 0.04 and this fails.
    ids = torch.tensor([runner.tokenizer(" ".join(PROMPTS))["input_ids"]])
    with torch.inference_mode():
        ref = torch.log_softmax(runner.model(input_ids=ids, use_cache=False).logits[0].float(), -1)
        got = torch.log_softmax(int8_runner.model(input_ids=ids, use_cache=False).logits[0].float(), -1)
    agreement = (ref.argmax(-1) == got.argmax(-1)).float().mean().item()
    kl = (ref.exp() * (ref - got)).sum(-1).mean().item()
    assert agreement >= 0.90 and kl <= 0.03, (agreement, kl)


def test_int8_linear_smoothing_tames_an_outlier_channel():
    torch.manual_seed(0)
    lin = torch.nn.Linear(64, 32, bias=True)
    x = torch.randn(16, 64)
    x[:, 3] *= 80.0  # one channel carries outliers, as LLM activations do
    exact = lin(x)
    plain, smoothed = Int8Linear(lin), Int8Linear(lin, x.abs().amax(0))

    def rel_error(m):
        return ((m(x) - exact).norm() / exact.norm()).item()

    assert rel_error(smoothed) < 0.5 * rel_error(plain)
    assert rel_error(smoothed) < 0.02
    assert smoothed(x[None]).shape == (1, 16, 32)  # leading dims kept, as transformers passes [1, T, C]


def test_bad_quantization_is_refused_by_name_and_device(int8_runner):
    model = int8_runner.model
    before = {name: b.clone() for name, b in model.named_buffers()}
    with pytest.raises(QuantizationError, match="expected one of none, int8"):
        quantize_linears(model, "int4", torch.device("cpu"))
    with pytest.raises(QuantizationError, match="CPU only"):
        quantize_linears(model, "int8", torch.device("cuda"))
    assert quantize_linears(model, "none", torch.device("cpu")) == 0
    after = dict(model.named_buffers())
    assert before.keys() == after.keys() and all(torch.equal(before[k], after[k]) for k in before)


def test_the_runner_checks_the_quantization_before_loading_anything():
    from magnitude.runner import ModelRunner

    # A source that does not exist: the quantization error must come first, not the load's.
    with pytest.raises(QuantizationError, match="int4"):
        ModelRunner("/nonexistent/model.gguf", quantization="int4")
