"""The cost model's swap and attention figures, measured on the real runner: a round trip of real
block copies leaves the device blocks as they were and its figures agree with each other; the
attention figures come from real steps at two contexts."""

from __future__ import annotations

import pytest

from magnitude.runner.swap_bandwidth import block_bytes, measure_swap


def test_measure_swap_times_real_copies_and_leaves_the_device_blocks_unchanged(runner) -> None:
    torch = pytest.importorskip("torch")
    before = runner.kv.device_cache.clone()
    runner.kv.device_cache[:, :, 0].fill_(1.5)  # something a copy that did nothing would not bring back
    marked = runner.kv.device_cache.clone()
    figures = measure_swap(runner, repeats=2, max_blocks=8)
    assert torch.equal(runner.kv.device_cache, marked)
    assert torch.equal(runner.kv.host_cache[:, :, 0], marked[:, :, 0].cpu())  # it really went to the host
    runner.kv.device_cache.copy_(before)
    n = min(runner.num_blocks, runner.num_swap_blocks, 8)
    assert figures.blocks == n and figures.per_swap_token > 0
    # seconds per token and bytes per second describe the same round trip
    seconds = figures.per_swap_token * 2 * n * runner.block_size
    assert figures.bytes_per_s == pytest.approx(2 * n * block_bytes(runner.kv) / seconds)


def test_no_swap_space_measures_nothing() -> None:
    class NoSwap:
        num_blocks, num_swap_blocks = 16, 0

    assert measure_swap(NoSwap()).per_swap_token == 0.0


def test_measure_attention_times_real_steps_at_two_contexts(runner) -> None:
    from magnitude.runner.attention_cost import measure_attention

    figures = measure_attention(runner, context=16, decodes=2, chunk=16, repeats=1)
    assert figures.decode_context == 16
    assert figures.per_decode_context_token >= 0.0 and figures.per_attention_pair >= 0.0
    assert set(figures.to_document()) == {"per_decode_context_token", "per_attention_pair", "decode_context"}


class LinearAttentionRunner:
    """A stand-in whose step time is known: 50 ms, plus A per context token any sequence reads, plus B
    per query-key pair, plus 1 ms per token; every fifth step is 0.5 s late (a burst of other load)."""

    A, B = 2e-5, 1e-6
    block_size, num_blocks, max_model_len = 16, 4096, 8192

    def __init__(self) -> None:
        self.calls = 0

    def execute(self, plan):
        from magnitude.engine.output import RunnerOutput

        self.calls += 1
        load = plan.attention_load()
        late = 0.5 if self.calls % 5 == 0 else 0.0
        return RunnerOutput(duration_s=0.05 + self.A * load.contexts + self.B * load.pairs + 0.001 * plan.num_tokens + late)


def test_measure_attention_recovers_known_slopes_through_a_burst() -> None:
    from magnitude.runner.attention_cost import FAR_FACTOR, measure_attention

    runner = LinearAttentionRunner()
    figures = measure_attention(runner, context=256, decodes=8, chunk=128, repeats=5)
    assert figures.per_decode_context_token == pytest.approx(runner.A)
    # a deep chunk's reading of its earlier positions is charged at the decode slope: the pair slope is B alone
    assert figures.per_attention_pair == pytest.approx(runner.B)
    assert figures.decode_context == 256 and FAR_FACTOR * 256 <= runner.max_model_len
