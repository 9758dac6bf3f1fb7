"""Speculative decoding with a draft model (runner/draft_model.py), real scheduler + real runner.

Drafts come from a second model with its own paged KV under the scheduler's block ids: a shallow
self-draft (the target's first layers, sharing its weights) and a tiny random-weight Qwen2 that
shares SmolLM2's tokenizer (another architecture; nearly every draft rejected, which exercises the
rejection path). Greedy output must equal non-speculative decoding (HF `generate` references)
under chunking, preemption by recompute and by swap, cancellation and prefix caching; every block
must be free at the end. The tokenizer check refuses a draft whose vocabulary differs; a padded
vocabulary's extra ids are never drafted; a draft that fails at run time costs the drafts only.
"""

from __future__ import annotations

import contextlib

import pytest

from magnitude.engine.sampling import SamplingParams

from .conftest import BLOCK_SIZE, MAX_NEW, drive_scheduler, without_eos

torch = pytest.importorskip("torch")

from magnitude.runner.draft_model import (  # noqa: E402
    DraftModelError, DraftModelProposer, load_draft, self_draft,
)

from .tiny_models import build_tiny_model, tiny_config  # noqa: E402

pytestmark = pytest.mark.model

SPEC = ("draftModel.method=ngram", "draftModel.mode=on", "draftModel.numSpeculativeTokens=3")
TIGHT = ("scheduler.prefillChunkSize=16", "scheduler.tokenBudget=64", "kvCache.numBlocks=12",
         "kvCache.enablePrefixCaching=false")
SELF_LAYERS = 24  # of SmolLM2-135M's 30: enough that some drafts are accepted


def _greedy() -> SamplingParams:
    return SamplingParams(max_tokens=MAX_NEW, temperature=0.0)


def _proposer(runner, parts) -> DraftModelProposer:
    return DraftModelProposer(parts, runner.vocab_size, BLOCK_SIZE, runner.num_blocks, runner.num_swap_blocks,
                              runner.device, runner.kv.shape.dtype, seed=0)


@contextlib.contextmanager
def _attached(runner, proposer: DraftModelProposer):
    runner.draft_proposer = proposer
    try:
        yield proposer
    finally:
        runner.draft_proposer = None


@pytest.fixture(scope="module")
def self_drafter(runner) -> DraftModelProposer:
    return _proposer(runner, self_draft(runner.model, f"self:{SELF_LAYERS}"))


def _tiny_qwen(runner, path, vocab: int):
    """A random-weight Qwen2 with SmolLM2's tokenizer (saved beside it) and `vocab` embedding rows."""
    config = tiny_config("qwen2")
    config.vocab_size = vocab
    config.max_position_embeddings = runner.max_model_len
    config.bos_token_id, config.eos_token_id = runner.tokenizer.bos_token_id, runner.tokenizer.eos_token_id
    build_tiny_model("qwen2", path, config=config)
    runner.tokenizer.save_pretrained(path)  # replaces the tiny word-level tokenizer
    return path


@pytest.fixture(scope="module")
def tiny_drafter(runner, tmp_path_factory) -> DraftModelProposer:
    path = _tiny_qwen(runner, tmp_path_factory.mktemp("qwen2-draft"), runner.vocab_size)
    return _proposer(runner, load_draft(str(path), runner.model, runner.tokenizer, "cpu", runner.dtype))


def _expected(runner, hf_reference) -> dict[str, list[int]]:
    return {f"r{i}": without_eos(ref, runner.eos_token_ids) for i, ref in enumerate(hf_reference)}


@pytest.mark.parametrize("mode", ["recompute", "swap"])
def test_self_draft_greedy_equals_plain_decoding_under_chunking_and_preemption(runner, prompt_ids, hf_reference,
                                                                               self_drafter, mode):
    with _attached(runner, self_drafter):
        run = drive_scheduler(runner, prompt_ids, _greedy(), *SPEC, *TIGHT, f"scheduler.preemptionMode={mode}",
                              f"kvCache.swapBlocks={runner.num_swap_blocks}")
    assert run.outputs == _expected(runner, hf_reference)
    assert sum(n for (m, _), n in run.sched.stats().preemptions.items() if m == mode) > 0
    proposed = sum(r.spec_proposed for r in run.reqs.values())
    accepted = sum(r.spec_accepted for r in run.reqs.values())
    assert proposed > 0 and 0 < accepted < proposed, (accepted, proposed)
    assert self_drafter.failed is None
    assert not self_drafter._fed, "a finished request's draft state was kept"


@pytest.mark.parametrize("mode", ["recompute", "swap"])
def test_speculation_off_runs_no_draft_forward_and_drafting_catches_up(runner, prompt_ids, hf_reference,
                                                                      self_drafter, mode):
    # `auto` turning speculation off must make a step cost what it costs without a draft model (the
    # policy measures "off" on such steps): no draft forward at all; when drafting resumes, the
    # draft is fed what it missed, so it drafts what a draft that never paused drafts at the same
    # position. Off for three steps in every seven, under preemption, with the prefix cache on and a
    # prompt repeated (its cached blocks then lack the draft's K/V).
    forwards = {"on": 0, "off": 0}
    state = {"on": True}
    drafts: dict[tuple[str, int], list[int]] = {}
    inner_forward, inner_propose = self_drafter._forward, self_drafter.propose

    def counted(*args):
        forwards["on" if state["on"] else "off"] += 1
        return inner_forward(*args)

    def recorded(seq, k):
        out = inner_propose(seq, k)
        drafts[seq.request_id, seq.start_position] = list(out)
        return out

    def speculating(step: int) -> bool:
        state["on"] = step % 7 < 4
        return state["on"]

    prompts = [*prompt_ids, prompt_ids[2]]
    sets = (*SPEC, *TIGHT[:3], "kvCache.enablePrefixCaching=true", f"scheduler.preemptionMode={mode}",
            f"kvCache.swapBlocks={runner.num_swap_blocks}")
    self_drafter._forward, self_drafter.propose = counted, recorded
    try:
        with _attached(runner, self_drafter):
            drive_scheduler(runner, prompts, _greedy(), *sets, stagger=2)
            always = dict(drafts)
            drafts.clear()
            run = drive_scheduler(runner, prompts, _greedy(), *sets, speculating=speculating, stagger=2)
    finally:
        del self_drafter._forward, self_drafter.propose
    expected = _expected(runner, hf_reference)
    assert run.outputs == {**expected, f"r{len(prompt_ids)}": expected["r2"]}
    assert sum(n for (m, _), n in run.sched.stats().preemptions.items() if m == mode) > 0
    assert forwards["off"] == 0 and forwards["on"] > 0, forwards
    both = [key for key in drafts if key in always]
    same = sum(drafts[key] == always[key] for key in both)
    # a stale or missing catch-up drafts from holes in the draft's K/V: most proposals then differ
    assert len(both) >= 20 and same >= 0.9 * len(both), (same, len(both))
    assert self_drafter.failed is None and not self_drafter._fed


def test_another_architecture_drafting_is_verified_exactly_under_swap(runner, prompt_ids, hf_reference,
                                                                      tiny_drafter):
    with _attached(runner, tiny_drafter):
        run = drive_scheduler(runner, prompt_ids, _greedy(), *SPEC, *TIGHT, "scheduler.preemptionMode=swap",
                              f"kvCache.swapBlocks={runner.num_swap_blocks}")
    assert run.outputs == _expected(runner, hf_reference)
    assert sum(r.spec_proposed for r in run.reqs.values()) > 0
    assert tiny_drafter.failed is None


def test_cancellation_and_prefix_caching_with_a_draft_model(runner, prompt_ids, hf_reference, self_drafter):
    # The same prompt twice: the second request's prompt blocks come from the prefix cache, whose
    # draft K/V the first request's draft wrote.
    prompts = [*prompt_ids, prompt_ids[5]]
    with _attached(runner, self_drafter):
        run = drive_scheduler(runner, prompts, _greedy(), *SPEC, "scheduler.prefillChunkSize=32",
                              "kvCache.enablePrefixCaching=true", cancel=("r2", 14), stagger=6)
    expected = _expected(runner, hf_reference)
    assert run.reqs["r2"].status.name == "CANCELLED"
    assert run.outputs["r2"] == expected["r2"][: len(run.outputs["r2"])]
    for rid in ("r0", "r1", "r3", "r4", "r5"):
        assert run.outputs[rid] == expected[rid], rid
    assert run.outputs["r6"] == expected["r5"]
    assert run.reqs["r6"].num_cached_tokens > 0
    assert not self_drafter._fed


def test_seeded_sampling_with_draft_q_is_reproducible(runner, prompt_ids, self_drafter):
    sampling = SamplingParams(max_tokens=MAX_NEW, temperature=0.8, top_p=0.95, seed=77)
    with _attached(runner, self_drafter):
        first = drive_scheduler(runner, [prompt_ids[1], prompt_ids[1]], sampling, *SPEC)
        again = drive_scheduler(runner, [prompt_ids[1]], sampling, *SPEC)
    assert first.outputs["r0"] == first.outputs["r1"] == again.outputs["r0"]
    assert sum(r.spec_proposed for r in first.reqs.values()) > 0


def test_padded_vocabulary_ids_are_never_drafted(runner, prompt_ids, hf_reference, tmp_path):
    path = _tiny_qwen(runner, tmp_path / "padded", runner.vocab_size + 64)
    parts = load_draft(str(path), runner.model, runner.tokenizer, "cpu", runner.dtype)
    head = parts.head()
    with torch.no_grad():  # the padding rows would win every argmax if they were not masked
        head.weight[runner.vocab_size:] = head.weight[: 64].abs() * 1e3
    drafter = _proposer(runner, parts)
    with _attached(runner, drafter):
        run = drive_scheduler(runner, prompt_ids[:2], _greedy(), *SPEC)
    assert run.outputs == {k: v for k, v in _expected(runner, hf_reference).items() if k in ("r0", "r1")}
    # The runner drops a proposal at its first out-of-range id: drafts landed only if none was one.
    assert sum(r.spec_proposed for r in run.reqs.values()) > 0


def test_a_draft_with_another_tokenizer_is_refused_by_name(runner, tmp_path):
    path = build_tiny_model("qwen2", tmp_path / "other-tokenizer")  # its own 320-word vocabulary
    with pytest.raises(DraftModelError, match=r"draft model .*other-tokenizer.*tokenizer differs"):
        load_draft(str(path), runner.model, runner.tokenizer, "cpu", runner.dtype)


def test_unloadable_and_malformed_draft_sources_are_refused_by_name(runner, tmp_path):
    with pytest.raises(DraftModelError, match=r"draft model .*nowhere.*cannot load"):
        load_draft(str(tmp_path / "nowhere"), runner.model, runner.tokenizer, "cpu", runner.dtype)
    with pytest.raises(DraftModelError, match=r"self:30.*1 <= N < 30"):
        load_draft("self:30", runner.model, runner.tokenizer, "cpu", runner.dtype)


class _Exploding(torch.nn.Module):
    def forward(self, **kwargs):
        raise RuntimeError("draft kernel crashed")


def test_a_draft_failing_at_run_time_costs_the_drafts_not_the_requests(runner, prompt_ids, hf_reference,
                                                                       self_drafter):
    parts = self_draft(runner.model, "self:2")
    parts.decoder = _Exploding()
    drafter = _proposer(runner, parts)
    with _attached(runner, drafter):
        run = drive_scheduler(runner, prompt_ids[:2], _greedy(), *SPEC)
    assert run.outputs == {k: v for k, v in _expected(runner, hf_reference).items() if k in ("r0", "r1")}
    assert drafter.failed is not None and "draft kernel crashed" in drafter.failed
    assert all(r.spec_proposed == 0 for r in run.reqs.values())


def test_the_runner_loads_a_draft_and_sizes_blocks_for_both_pools(runner, tmp_path):
    from magnitude.runner import ModelRunner

    from .conftest import DEVICE, MODEL

    both = ModelRunner(MODEL, device=DEVICE, dtype="float32", block_size=BLOCK_SIZE, num_blocks=8, warmup=False,
                       evaluate_quantization=False, draft_source=f"self:{SELF_LAYERS}")
    drafter = both.draft_proposer
    assert isinstance(drafter, DraftModelProposer)
    assert drafter.pool.num_blocks == both.num_blocks == 8
    target_bytes = both.kv.shape.bytes_per_block
    assert drafter.bytes_per_block == target_bytes * SELF_LAYERS // 30
    assert both.kv_bytes_per_block() == target_bytes + drafter.bytes_per_block
    with pytest.raises(ValueError, match="draft_source or a draft_proposer"):
        ModelRunner(MODEL, draft_source="self:2", draft_proposer=drafter)


def test_a_self_draft_shares_the_quantized_targets_embeddings(prompt_ids):
    """The self-draft is built before the target is quantized; w4a16 then replaces the tied token
    embeddings by rows read from the int8 LM head's codes, and the draft must use those too, not
    keep the replaced fp32 matrix (108 MiB) alive and resident. Both pools are float16 (w4a16's
    default KV dtype): speculative greedy decoding over them gives plain greedy decoding's tokens
    (the fused step's rows do not depend on the rows verified beside them)."""
    from magnitude.runner import ModelRunner, lowbit
    from magnitude.runner.quantize import Int8GroupEmbedding

    from .conftest import DEVICE, MODEL

    if DEVICE != "cpu" or lowbit.kernels() is None:
        pytest.skip(f"w4a16's grouped head needs Magnitude's CPU kernels: {lowbit.describe()}")
    both = ModelRunner(MODEL, device=DEVICE, quantization="w4a16", block_size=BLOCK_SIZE, num_blocks=48, warmup=False,
                       evaluate_quantization=False, draft_source=f"self:{SELF_LAYERS}")
    drafter = both.draft_proposer
    inner = both.model.model
    assert type(inner.embed_tokens) is Int8GroupEmbedding
    for name in ("embed_tokens", "norm", "rotary_emb"):
        assert getattr(drafter.parts.decoder, name) is getattr(inner, name), name
    assert list(drafter.parts.decoder.layers) == list(inner.layers)[:SELF_LAYERS]
    assert both.kv.k_layers[0].dtype == drafter.pool.k_layers[0].dtype == torch.float16
    plain = drive_scheduler(both, prompt_ids, _greedy())
    spec = drive_scheduler(both, prompt_ids, _greedy(), *SPEC)
    assert spec.outputs == plain.outputs
    proposed = sum(r.spec_proposed for r in spec.reqs.values())
    accepted = sum(r.spec_accepted for r in spec.reqs.values())
    assert proposed > 0 and accepted > 0, (accepted, proposed)


def test_block_budget_counts_the_draft_bytes():
    from magnitude.runner.kv_pool import KVShape, default_num_blocks

    shape = KVShape(num_layers=4, num_kv_heads=2, head_dim=8, block_size=16, dtype=torch.float32)
    per = shape.bytes_per_block
    free = 1000 * per
    plain = default_num_blocks(shape, torch.device("cpu"), 0, 1.0, free_bytes=free)
    with_draft = default_num_blocks(shape, torch.device("cpu"), 0, 1.0, free_bytes=free, extra_bytes_per_block=per)
    assert (plain, with_draft) == (1000, 500)


def test_a_w8a16_copy_drafts_for_the_float32_target(runner, prompt_ids, hf_reference):
    from .conftest import MODEL

    drafter = _proposer(runner, load_draft(MODEL, runner.model, runner.tokenizer, "cpu", runner.dtype,
                                           quantization="w8a16"))
    with _attached(runner, drafter):
        run = drive_scheduler(runner, prompt_ids[:3], _greedy(), *SPEC)
    assert run.outputs == {k: v for k, v in _expected(runner, hf_reference).items() if k in ("r0", "r1", "r2")}
    proposed = sum(r.spec_proposed for r in run.reqs.values())
    accepted = sum(r.spec_accepted for r in run.reqs.values())
    assert proposed > 0 and accepted / proposed > 0.5, (accepted, proposed)  # same model, int8 numerics
    with pytest.raises(DraftModelError, match="self:4: shares the target's weights"):
        load_draft("self:4", runner.model, runner.tokenizer, "cpu", runner.dtype, quantization="w8a16")
