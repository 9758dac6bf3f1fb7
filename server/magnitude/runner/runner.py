"""ModelRunner: executes a scheduler StepPlan on the real model in one forward pass.

Per step: swap copies (plan.swap_out, then plan.swap_in), per-request validation (a bad request
fails alone), then every scheduled token of every sequence — prefill chunks and decodes — goes
through transformers' own model class as one flattened row with per-sequence positions; the
registered paged attention reads/writes our KV pool by the plan's block tables. The LM head runs
only on the rows that sample; a row the sampler cannot sample fails its request alone too. Recompute needs nothing here: the scheduler simply re-prefills.

Speculative decoding hook: a `DraftProposer` (none by default) fills a decode's `num_lookahead`
slots with draft tokens (prompt lookup: runner/spec_decode.py; a draft model: runner/draft_model.py,
whose own KV pool shares the step's swaps and whose forwards run for the whole step before the
target's); the step computes them together.
Greedy verification keeps the drafts matching the argmax plus one model token; random sampling
verifies by rejection sampling (`Sampler.verify`), so the output distribution is the target's.
Grammars and penalties draft too: each verification position is masked and penalised as a plain
step would be had the drafts before it been kept (`Sampler.verify_row`, constraints.py).
"""

from __future__ import annotations

import dataclasses
import logging
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Protocol

import numpy as np
import torch

from magnitude.engine.output import RunnerOutput, SampledToken, ScheduledSeq, StepPlan
from magnitude.engine.quantization import QuantizationRecord
from magnitude.engine.sampling import SamplingParams
from magnitude.runner import lowbit, quant_eval
from magnitude.runner.attention import ATTN_IMPLEMENTATION, SeqSlice, build_paged_batch
from magnitude.runner.constraints import advance_constraint, advance_through_drafts, can_draft, settle_drafts
from magnitude.runner.defaults import choose_kv_cache_dtype
from magnitude.runner.draft_model import DraftModelProposer, kv_shape, load_draft
from magnitude.runner.file_pages import (page_out_gpu_libraries, page_out_shared_libraries, released_after_use,
                                         trim_heap)
from magnitude.runner.kv_pool import KVShape, PagedKVPool, default_num_blocks
from magnitude.runner.loading import DEFAULT_SOURCE, load_model, pick_device
from magnitude.runner.paged_decoder import paged_decoder
from magnitude.runner.quantize import CALIBRATION_TEXT, PROMPT_ROW_METHODS, check_quantization, quantize_linears
from magnitude.runner.sampling import History, Sampler

log = logging.getLogger("magnitude.runner")

class DraftProposer(Protocol):
    """Proposes up to `k` draft tokens to follow `seq`'s last token (e.g. n-gram or a draft model)."""

    def propose(self, seq: ScheduledSeq, k: int) -> list[int]: ...


@dataclass(slots=True)
class StepTiming:
    """What the last execute() did and where its time went (for stats and `magnitude profile`)."""

    num_seqs: int = 0
    num_tokens: int = 0
    num_decode: int = 0
    num_prefill_tokens: int = 0
    prepare_s: float = 0.0
    forward_s: float = 0.0
    sample_s: float = 0.0
    swap_s: float = 0.0
    total_s: float = 0.0


@dataclass(slots=True)
class _Work:
    seq: ScheduledSeq
    drafts: list[int] = field(default_factory=list)
    offset: int = 0
    bitmask: torch.Tensor | None = None  # a constrained row's grammar mask per draft position

    @property
    def tokens(self) -> list[int]:
        return self.seq.token_ids + self.drafts


_GREEDY = SamplingParams(max_tokens=1, temperature=0.0)


class ModelRunner:
    """The only object that touches torch for serving: model, paged KV pool, sampler."""

    supports_constraints = True  # the sampler applies grammar masks (structured outputs, forced tool calls)

    def __init__(
        self,
        source: str = DEFAULT_SOURCE,
        device: str | None = None,
        dtype: str | None = None,
        block_size: int = 16,
        num_blocks: int | None = None,
        num_swap_blocks: int = 0,
        progress: Callable[[str, float], None] | None = None,
        draft_proposer: DraftProposer | None = None,
        warmup: bool = True,
        seed: int | None = None,
        num_threads: int | None = None,
        quantization: str | None = None,
        record_cache: Path | None = None,
        evaluate_quantization: bool = True,
        memory_fraction: float = 0.9,
        draft_source: str | None = None,
        draft_quantization: str = "none",
        kv_cache_dtype: str = "auto",
        page_out_libraries: bool = False,
    ) -> None:
        """`record_cache`: where quantization evaluation records are kept across restarts (None:
        measure on every load). `evaluate_quantization=False` skips the evaluation (tests of the
        runner's numerics); `quantization_record` is then None. `memory_fraction`
        (`kvCache.memoryFraction`) sizes the KV pool when `num_blocks` is None (kv_pool.py).
        `draft_source`: a draft model (`self:N` or any model source; runner/draft_model.py) proposes
        the drafts, with a KV pool of its own under the same block ids: a block then costs the
        target's bytes plus the draft's, and memoryFraction sizes the pool from their sum;
        `draft_quantization` (w8a16, w8a8) quantizes a loaded draft's linears. `kv_cache_dtype`
        (`kvCache.dtype`): the KV pool's, `auto` resolved by runner/defaults.py from the device and
        the quantization. `page_out_libraries` (`magnitude serve` on the CPU): once the weights are
        loaded and quantized, and before the warm-up, ask back the pages of the shared libraries'
        code that start-up ran (file_pages.page_out_shared_libraries); the warm-up maps back what a
        step runs. Off by default: a runner inside a test or another program leaves its host's pages
        alone."""
        if draft_source is not None and draft_proposer is not None:
            raise ValueError("give a draft_source or a draft_proposer, not both")
        if block_size < 1:
            raise ValueError(f"block_size must be >= 1, got {block_size}")
        if num_threads:
            # Process-wide. On a shared host one thread per core actually free beats spinning
            # OpenMP threads that fight other processes for the same cores.
            torch.set_num_threads(num_threads)
        report = progress or (lambda phase, fraction, detail=None: None)
        if quantization not in (None, "none") and device in (None, "", "auto"):
            device = "cpu"  # the int8 kernels are CPU-only: choose the CPU rather than fail on a GPU host
        self.quantization = check_quantization(quantization, pick_device(device))  # before a long load
        if pick_device(device).type == "cpu":
            page_out_gpu_libraries()  # torch's CUDA wheel: ~150 MiB resident that this process never runs
        loaded = load_model(source, device, dtype, attn_implementation=ATTN_IMPLEMENTATION, progress=report)
        self.model = loaded.model
        # A model to be quantized runs unfused until then (paged_decoder): it is the evaluation's reference.
        self._decoder = paged_decoder(self.model.model, fused=self.quantization == "none")
        self.tokenizer = loaded.tokenizer
        self.device = loaded.device
        self.dtype = loaded.dtype
        self.load_time_s = loaded.load_time_s
        self.cache_hit = loaded.cache_hit
        self.model_name = loaded.source.name
        self.model_source = loaded.source  # reported in /v1/models and /readyz (source, pinned revision)
        cfg = self.model.config
        self.vocab_size = int(cfg.vocab_size)
        self.max_model_len = int(cfg.max_position_embeddings)
        self.eos_token_ids = self._eos_ids()
        self.block_size = block_size
        self.kv_cache_dtype, self.kv_cache_dtype_reason = choose_kv_cache_dtype(
            kv_cache_dtype, self.device.type, self.quantization, str(self.dtype).removeprefix("torch."))
        shape = KVShape(
            num_layers=int(cfg.num_hidden_layers),
            num_kv_heads=int(cfg.num_key_value_heads),
            head_dim=int(getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads),
            block_size=block_size,
            dtype=getattr(torch, self.kv_cache_dtype),
        )
        draft = None
        if draft_source is not None:
            report("loading_draft", 0.0)
            draft = load_draft(draft_source, self.model, self.tokenizer, str(self.device), self.dtype,
                               quantization=draft_quantization)
            report("loading_draft", 1.0)
        draft_block_bytes = kv_shape(draft.config, block_size, shape.dtype).bytes_per_block if draft else 0
        if num_blocks is None:
            # Buffers too: int8 weights are buffers, not parameters.
            weight_bytes = sum(t.numel() * t.element_size()
                               for t in (*self.model.parameters(), *self.model.buffers()))
            num_blocks = default_num_blocks(shape, self.device, weight_bytes + (draft.weight_bytes if draft else 0),
                                            memory_fraction, extra_bytes_per_block=draft_block_bytes)
        self.kv = PagedKVPool(shape, num_blocks, num_swap_blocks, self.device)
        if draft is not None:
            draft_proposer = DraftModelProposer(draft, self.vocab_size, block_size, num_blocks, num_swap_blocks,
                                                self.device, shape.dtype, seed)
        self.num_blocks = num_blocks
        self.num_swap_blocks = num_swap_blocks
        self.sampler = Sampler(self.device, seed)
        self.draft_proposer = draft_proposer
        self.last_step = StepTiming()
        self.quantization_record = self._quantize(loaded.source, record_cache if evaluate_quantization else None,
                                                  report, evaluate_quantization)
        drafter = self._draft_model()
        if drafter is not None:
            drafter.follow_target()
        if page_out_libraries and self.device.type == "cpu":
            page_out_shared_libraries()
        if warmup:
            self._warmup(report)
        self.release_kv_pages()
        trim_heap()  # what loading and converting the weights freed

    def _eos_ids(self) -> list[int]:
        ids: list[int] = []
        gen_eos = getattr(self.model.generation_config, "eos_token_id", None)
        for v in (gen_eos if isinstance(gen_eos, list) else [gen_eos]) + [self.tokenizer.eos_token_id]:
            if v is not None and int(v) not in ids:
                ids.append(int(v))
        return ids

    @property
    def fused_steps(self) -> bool:
        """Whether steps may run the fused native forward (paged_decoder, fused_decode.py)."""
        return bool(getattr(self._decoder, "fused", False))

    def _quantize(self, source: Any, record_cache: Path | None, report: Callable[[str, float], None],
                  evaluate: bool) -> QuantizationRecord | None:
        """Quantize the loaded model in place and return its evaluation record: from the cache, or
        measured now against this same model before quantizing, over an fp32 KV pool (quant_eval.py). On the CPU the KV
        pool is sized without the weights, so building it first changes nothing."""
        if self.quantization == "none":
            return None
        key = quant_eval.record_key(source.name, source.revision, self.quantization, self.dtype, self.kv.shape.dtype)
        record = quant_eval.load_cached(record_cache, key)
        started = time.perf_counter()
        reference = None
        if record is None and evaluate:
            report("evaluating_quantization", 0.0)
            reference = self._measure_reference()
            report("evaluating_quantization", 0.5)
        quantize_linears(self.model, self.quantization, self.device, self.tokenizer(CALIBRATION_TEXT)["input_ids"])
        trim_heap()  # the unquantized weights' temporaries, before the quantized model is measured
        # Built again over the quantized modules: a w4a16/w4a8 model's decode steps may now run fused.
        self._decoder = paged_decoder(self.model.model)
        if reference is not None:
            record = quant_eval.make_record(self, reference, quant_eval.measure(self), self.quantization, started)
            quant_eval.save_cached(record_cache, key, record)
            report("evaluating_quantization", 1.0)
        return record

    def _measure_reference(self) -> "quant_eval.Measurement":
        """The evaluation's reference: this unquantized model over an fp32 KV pool, so that a record
        also judges a float16 pool served beside the quantized weights (`kvCache.dtype`). Its linears
        give their mapped weight pages back after each call (file_pages.released_after_use): the
        whole checkpoint resident at once was a first start's peak."""
        served = self.kv
        if served.shape.dtype != torch.float32:
            # Only the blocks the measurement writes: one as large as the served pool (sized from
            # memoryFraction for the narrower dtype) could be more address space than the host allows.
            blocks = min(served.num_blocks, quant_eval.blocks_needed(self.tokenizer, self.block_size))
            self.kv = PagedKVPool(dataclasses.replace(served.shape, dtype=torch.float32), blocks, 0, served.device)
        try:
            with released_after_use(self.model.model):
                return quant_eval.measure(self)
        finally:
            self.kv = served

    def _warmup(self, report: Callable[[str, float], None]) -> None:
        """Run a prefill and a decode through block 0 so first-request latency excludes lazy init.
        The garbage K/V left in block 0 is harmless: a sequence writes each slot before reading it."""
        report("warming_up", 0.0)
        n = min(8, self.block_size * self.num_blocks - 1)
        self.execute(StepPlan(-1, [ScheduledSeq("warmup", [1] * n, 0, [0], True, _GREEDY)]))
        self.execute(StepPlan(-2, [ScheduledSeq("warmup", [1], n, [0], True, _GREEDY)]))
        report("warming_up", 1.0)

    # -- validation -------------------------------------------------------------------------------

    def _validate(self, s: ScheduledSeq) -> str | None:
        if not s.token_ids:
            return "no tokens scheduled"
        if s.start_position < 0:
            return f"negative start_position {s.start_position}"
        end = s.start_position + len(s.token_ids) + s.num_lookahead
        if end > self.max_model_len:
            return f"sequence length {end} exceeds the model's maximum {self.max_model_len}"
        if min(s.token_ids) < 0 or max(s.token_ids) >= self.vocab_size:
            return f"token id out of range 0..{self.vocab_size - 1}"
        if len(s.block_table) * self.block_size < end:
            return f"block table of {len(s.block_table)} blocks cannot hold {end} positions"
        if s.block_table and (min(s.block_table) < 0 or max(s.block_table) >= self.kv.num_blocks):
            return f"block id out of range 0..{self.kv.num_blocks - 1}"
        return None

    def _drafts(self, s: ScheduledSeq) -> list[int]:
        # Penalties and grammars do not stop drafting: verification sees each position's logits as
        # a plain step would (`Sampler.verify_row`). Only a grammar that cannot roll back does.
        if not (s.sample and s.num_lookahead > 0 and self.draft_proposer is not None) or not can_draft(s.sampling):
            return []
        try:
            proposed = list(self.draft_proposer.propose(s, s.num_lookahead))[: s.num_lookahead]
        except Exception as exc:  # noqa: BLE001 - a failing proposer costs the speedup, not the request
            log.warning("draft proposer failed for %s (decoding without drafts): %s", s.request_id, exc)
            return []
        drafts: list[int] = []
        for t in proposed:
            if not 0 <= t < self.vocab_size:
                break  # a bad draft ends the proposal; later ones would sit at wrong positions
            drafts.append(int(t))
        return drafts

    # -- the step ---------------------------------------------------------------------------------

    @torch.inference_mode()
    def execute(self, plan: StepPlan) -> RunnerOutput:
        t0 = time.perf_counter()
        out = RunnerOutput()
        self.kv.swap_out(plan.swap_out)
        self.kv.swap_in(plan.swap_in)
        drafter = self._draft_model()
        if drafter is not None:  # its pool swaps the same blocks; its forwards draft for the whole step
            drafter.begin_step(plan)
            drafter.prepare([s for s in plan.seqs if self._validate(s) is None])
        t_swap = time.perf_counter()

        work: list[_Work] = []
        offset = 0
        for s in plan.seqs:
            err = self._validate(s)
            if err is not None:
                out.failed[s.request_id] = err
                continue
            w = _Work(s, self._drafts(s), offset)
            if w.drafts and s.sampling.constraint is not None:
                # The matcher walks the drafts now, one mask per verification position.
                w.drafts, w.bitmask = advance_through_drafts(s.sampling, w.drafts, self.vocab_size)
            offset += len(w.tokens)
            work.append(w)
        timing = StepTiming(num_seqs=len(work), num_tokens=offset, swap_s=t_swap - t0)
        if work:
            self._run(work, out, timing)
        timing.total_s = out.duration_s = time.perf_counter() - t0
        self.last_step = timing
        return out

    def _prepare(self, work: list[_Work], num_tokens: int) -> tuple[torch.Tensor, torch.Tensor, Any]:
        ids = np.fromiter((t for w in work for t in w.tokens), dtype=np.int64, count=num_tokens)
        pos = np.concatenate([np.arange(w.seq.start_position, w.seq.start_position + len(w.tokens)) for w in work])
        slices = [SeqSlice(w.offset, len(w.tokens), w.seq.start_position, w.seq.block_table) for w in work]
        batch = build_paged_batch(slices, self.block_size, self.kv.k_layers, self.kv.v_layers, self.device)
        return torch.from_numpy(ids).to(self.device)[None], torch.from_numpy(pos).to(self.device)[None], batch

    def _hidden(self, input_ids: torch.Tensor, position_ids: torch.Tensor, batch: Any,
                work: list[_Work]) -> torch.Tensor:
        """The decoder's last hidden state for every row of the flattened step ([T, hidden])."""
        if self.quantization not in PROMPT_ROW_METHODS:
            return self._decoder(input_ids, position_ids, batch)
        # Prompt rows: a sequence scheduled with more than one token (as StepTiming counts prefill),
        # so a decode, with or without drafts to verify, stays exact.
        rows = np.zeros(input_ids.shape[-1], dtype=np.uint8)
        for w in work:
            if len(w.seq.token_ids) > 1:
                rows[w.offset : w.offset + len(w.seq.token_ids)] = 1
        if not rows.any():  # a decode-only step: nothing to mark
            return self._decoder(input_ids, position_ids, batch)
        with lowbit.prompt_rows(rows):
            return self._decoder(input_ids, position_ids, batch)

    def _lm_head(self, hidden: torch.Tensor) -> torch.Tensor:
        """Logits of the given rows, with the model's final soft-capping (Gemma 2) when it has one:
        the runner calls the head itself, so the model's forward cannot apply it."""
        logits = self.model.lm_head(hidden)
        cap = getattr(self.model.config, "final_logit_softcapping", None)
        return torch.tanh(logits / cap) * cap if cap else logits

    def _run(self, work: list[_Work], out: RunnerOutput, timing: StepTiming) -> None:
        t0 = time.perf_counter()
        input_ids, position_ids, batch = self._prepare(work, timing.num_tokens)
        timing.num_decode = sum(1 for w in work if len(w.seq.token_ids) == 1)
        timing.num_prefill_tokens = sum(len(w.seq.token_ids) for w in work if len(w.seq.token_ids) > 1)
        t1 = time.perf_counter()

        hidden = self._hidden(input_ids, position_ids, batch, work)
        # Rows that produce a token: the last real token, plus one per draft for verification.
        samplers = [w for w in work if w.seq.sample]
        rows: list[int] = []
        for w in samplers:
            last = w.offset + len(w.seq.token_ids) - 1
            rows.extend(range(last, last + len(w.drafts) + 1))
        logits = self._lm_head(hidden[torch.tensor(rows, device=self.device)]) if rows else None
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        t2 = time.perf_counter()

        if logits is not None:
            self._sample(samplers, logits, out)
            drafter = self._draft_model()
            for w in samplers:
                if drafter is not None and w.drafts and w.seq.request_id in out.sampled:
                    drafter.end_step(w.seq, len(w.drafts), len(out.sampled[w.seq.request_id]))
        t3 = time.perf_counter()
        timing.prepare_s, timing.forward_s, timing.sample_s = t1 - t0, t2 - t1, t3 - t2

    def _sample(self, samplers: list[_Work], logits: torch.Tensor, out: RunnerOutput) -> None:
        first_rows, r = [], 0
        for w in samplers:
            first_rows.append(r)
            r += len(w.drafts) + 1
        # Rows without drafts are sampled together; a drafted row is verified on its own block (a
        # constrained one's matcher already stands after its drafts: it cannot share the batch's mask).
        plain = [w for w in samplers if not w.drafts]
        if plain:
            rows = [first_rows[i] for i, w in enumerate(samplers) if not w.drafts]
            params = [w.seq.sampling for w in plain]
            steps = [w.seq.num_output_tokens for w in plain]
            histories = [(w.seq.prompt_token_ids, w.seq.output_token_ids) for w in plain]
            block = logits if len(rows) == logits.shape[0] else logits[rows]  # no drafts: every row, in order
            first = self._sample_rows(block, params, steps, histories, plain, out)
            for w, token in zip(plain, first):
                if token is None:
                    continue  # failed alone, in out.failed
                try:
                    advance_constraint(w.seq.sampling, token.token_id)
                except ValueError as exc:  # this request's grammar is broken, not the step
                    out.failed[w.seq.request_id] = f"sampling failed: {exc}"
                    continue
                out.sampled[w.seq.request_id] = [token]
        for i, w in enumerate(samplers):
            if not w.drafts:
                continue
            out.num_drafts[w.seq.request_id] = len(w.drafts)
            block = logits[first_rows[i] : first_rows[i] + len(w.drafts) + 1]
            try:
                tokens = self.sampler.verify_row(block, w.seq.sampling, w.seq.num_output_tokens, w.drafts,
                                                 (w.seq.prompt_token_ids, w.seq.output_token_ids), w.bitmask,
                                                 q=self._draft_q(w))
                settle_drafts(w.seq.sampling, len(w.drafts), [t.token_id for t in tokens])
            except ValueError as exc:  # NaN/inf logits in a draft row, a broken grammar: this request fails alone
                out.failed[w.seq.request_id] = f"sampling failed: {exc}"
                continue
            out.sampled[w.seq.request_id] = tokens

    def _sample_rows(self, logits: torch.Tensor, params: list[SamplingParams], steps: list[int],
                     histories: list[History], samplers: list[_Work], out: RunnerOutput) -> list[SampledToken | None]:
        """The batched sample; if it raises, each row again alone, so that a row that cannot be
        sampled fails its own request (in `out.failed`) instead of the whole step."""
        try:
            return list(self.sampler.sample(logits, params, steps, histories))
        except Exception:  # noqa: BLE001 - isolated below, row by row
            pass
        tokens: list[SampledToken | None] = []
        for i, w in enumerate(samplers):
            try:
                tokens.append(self.sampler.sample(logits[i : i + 1], params[i : i + 1], steps[i : i + 1],
                                                  histories[i : i + 1])[0])
            except Exception as exc:  # noqa: BLE001 - this row's request fails, not the step
                log.warning("sampling failed for %s: %s", w.seq.request_id, exc)
                out.failed[w.seq.request_id] = f"sampling failed: {exc}"
                tokens.append(None)
        return tokens

    # -- the quantization evaluation's passes over the pool, before serving --------------------

    def _blocks_for(self, n: int) -> list[int]:
        need = -(-n // self.block_size)
        if need > self.kv.num_blocks:  # the pool in use: the evaluation's reference has its own
            raise ValueError(f"{n} tokens need {need} KV blocks; the pool has {self.kv.num_blocks}")
        return list(range(need))

    @torch.inference_mode()
    def score_tokens(self, ids: list[int], chunk: int) -> torch.Tensor:
        """Log-probabilities [len(ids), vocab] (float32, CPU) at every position, computed as the
        serving path computes a prompt: prefill chunks of `chunk` tokens that attend to the earlier
        ones through the KV pool. Uses the pool's first blocks: call only while nothing is served."""
        table = self._blocks_for(len(ids))
        rows = []
        for start in range(0, len(ids), chunk):
            seq = ScheduledSeq("score", ids[start : start + chunk], start, table, False, _GREEDY)
            work = [_Work(seq)]
            hidden = self._hidden(*self._prepare(work, len(seq.token_ids)), work)
            rows.append(torch.log_softmax(self._lm_head(hidden).float(), -1).cpu())
        return torch.cat(rows)

    @torch.inference_mode()
    def greedy_tokens(self, prompts: list[list[int]], max_new: int) -> list[list[int]]:
        """Greedy continuations of `prompts`, served together through `execute` (one prefill step,
        then decode steps), each stopping at an EOS. Uses the pool's first blocks: call only while
        nothing is served."""
        tables, first = [], 0
        for ids in prompts:
            n = len(self._blocks_for(len(ids) + max_new))
            tables.append(list(range(first, first + n)))
            first += n
        self._blocks_for(first * self.block_size)  # the whole batch must fit the pool
        outs: list[list[int]] = [[] for _ in prompts]
        seqs = {str(i): ScheduledSeq(str(i), list(ids), 0, tables[i], True, _GREEDY) for i, ids in enumerate(prompts)}
        while seqs:
            result = self.execute(StepPlan(-3, list(seqs.values())))
            if result.failed:
                raise RuntimeError(f"greedy generation failed: {result.failed}")
            for rid, seq in list(seqs.items()):
                i, tok = int(rid), result.sampled[rid][0].token_id
                outs[i].append(tok)
                if tok in self.eos_token_ids or len(outs[i]) >= max_new:
                    del seqs[rid]
                else:
                    seqs[rid] = ScheduledSeq(rid, [tok], len(prompts[i]) + len(outs[i]) - 1, tables[i], True, _GREEDY,
                                             num_output_tokens=len(outs[i]))
        return outs

    # -- conveniences -----------------------------------------------------------------------------

    def _draft_model(self) -> DraftModelProposer | None:
        p = self.draft_proposer
        return p if isinstance(p, DraftModelProposer) else None

    def _draft_q(self, w: _Work) -> torch.Tensor | None:
        """The draft model's q rows for a sampling request's drafts (None: point-mass drafts)."""
        drafter = self._draft_model()
        return None if drafter is None else drafter.draft_probs(w.seq.request_id, len(w.drafts))

    def materialize_kv_blocks(self, n: int) -> None:
        """Make blocks 0..n-1 resident (kv_pool.PagedKVPool.materialize_blocks; the draft model's
        too) before a measurement reads them: the calibration's steps read contexts no request wrote."""
        self.kv.materialize_blocks(n)
        drafter = self._draft_model()
        if drafter is not None:
            drafter.pool.materialize_blocks(n)

    def release_kv_pages(self) -> None:
        """Give back the KV pool's pages once the start-up measurements (warm-up, the quantization
        evaluation, calibration) are done with it: only while no request is in flight, as the
        engine has not started yet. On the CPU the pool then costs memory again only for blocks
        requests write, instead of every block a measurement touched."""
        self.kv.release_pages()
        drafter = self._draft_model()
        if drafter is not None:
            drafter.release_pages()

    def kv_bytes_per_block(self) -> int:
        """What one block id costs: the target's K/V plus, with a draft model, the draft's."""
        drafter = self._draft_model()
        return self.kv.shape.bytes_per_block + (drafter.bytes_per_block if drafter is not None else 0)


__all__ = ["ModelRunner", "DraftProposer", "StepTiming", "SampledToken"]
