"""The draft-model proposer for speculative decoding: a second, smaller model that writes drafts.

Owns the draft's half of speculation: loading it (`load_draft`: any source the engine loads, or
`self:N`, the target's own first N decoder layers + its final norm + its LM head, sharing the
target's weights, no copy), the tokenizer check against the target (same token->id map and special
tokens; a larger, padded vocabulary only if its extra ids are masked so they are never drafted),
the draft's own paged KV pool, and the draft forwards of each step.

KV: the draft's pool (`kv_pool.PagedKVPool`, the draft's layer count and head shape) has exactly
the target pool's block ids: a block the scheduler gives a request holds the target's K/V in the
target pool and the draft's in this one, so one block costs both (the runner sizes the pool from
their sum) and swap copies both. Per request the proposer knows how many leading positions of its
draft KV are valid (`_fed`). While speculation is on, the draft writes every position the target
writes, in the same step; it lags only where every draft of a step was accepted (the last draft's
position was never fed to the draft) and while the scheduler has speculation off (`StepPlan.speculating`,
the `auto` policy's decision): then the draft runs no forward at all, so an "off" step costs what
a step without a draft model costs — which is what `auto` measures it against. The next drafting
step feeds each sequence the positions it lags (from its prompt and output tokens) first. A
request first seen with a prefix-cache hit trusts the cached blocks' draft KV only while no step
has ever skipped the draft; after one, its prefix is fed again (same tokens, same K/V).

Per step (`prepare`): one batched draft forward over every scheduled token of the step plus what
each sequence lags (prefill chunks catch up as the target computes them; a decode's token), whose
last row per drafting sequence gives draft 1, then one batched forward per further lookahead
position for the sequences still drafting: k forwards for k drafts. A greedy request drafts the argmax; a
sampling one draws from q (the draft's distribution under the request's temperature / top-k /
top-p), kept for verification's min(1, p/q) rule (`Sampler.verify`). A failing draft forward
disables the proposer (`failed`), logged once: the target keeps serving without drafts.
"""

from __future__ import annotations

import copy
import logging
from dataclasses import dataclass
from typing import Any, Callable

import numpy as np
import torch

from magnitude.engine.output import ScheduledSeq, StepPlan
from magnitude.engine.sampling import SamplingParams
from magnitude.runner.attention import SeqSlice, build_paged_batch
from magnitude.runner.kv_pool import KVShape, PagedKVPool
from magnitude.runner.paged_decoder import paged_decoder
from magnitude.runner.sampling import draw, filter_logits, row_argmax, seeded_uniforms

log = logging.getLogger("magnitude.runner.draft")

SELF_PREFIX = "self:"
# A sampled draft's uniform in a seeded request's per-position stream (0 and 1 are verification's).
DRAFT_UNIFORM = 2


class DraftModelError(ValueError):
    """The draft model cannot serve as this target's draft (cannot load, or tokenizers differ)."""


@dataclass(slots=True)
class DraftParts:
    """What a draft is made of: a decoder returning hidden states, a head, and their shapes."""

    name: str
    decoder: torch.nn.Module  # called like the runner's model.model: (input_ids, position_ids, magnitude_batch)
    head: Callable[[], torch.nn.Module]  # the LM head, looked up per call (quantization may replace it)
    config: Any
    weight_bytes: int  # memory the draft adds (0 for a self-draft: it shares the target's weights)
    # A self-draft's target decoder: its modules besides the layers (embeddings, final norm, rotary) are
    # the draft's too, re-read after quantizing the target replaced some (ModelRunner calls follow_target).
    target_decoder: torch.nn.Module | None = None


def kv_shape(config: Any, block_size: int, dtype: torch.dtype) -> KVShape:
    return KVShape(
        num_layers=int(config.num_hidden_layers),
        num_kv_heads=int(config.num_key_value_heads),
        head_dim=int(getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads),
        block_size=block_size,
        dtype=dtype,
    )


def self_draft(model: torch.nn.Module, spec: str) -> DraftParts:
    """`self:N`: the target's first N decoder layers, final norm and LM head, sharing its weights."""
    text = spec.removeprefix(SELF_PREFIX)
    total = len(model.model.layers)
    if not text.isdigit() or not 1 <= int(text) < total:
        raise DraftModelError(f"draft model {spec!r}: self:N needs 1 <= N < {total} (the target's decoder layers)")
    n = int(text)
    inner = model.model
    shallow = copy.copy(inner)  # a new module object; its submodules are the target's own
    shallow._modules = dict(inner._modules)
    shallow._modules["layers"] = torch.nn.ModuleList(list(inner.layers)[:n])
    config = copy.copy(inner.config)
    config.num_hidden_layers = n
    if getattr(config, "layer_types", None):
        config.layer_types = list(config.layer_types)[:n]
    shallow.config = config
    return DraftParts(spec, shallow, lambda: model.lm_head, config, 0, inner)


def loaded_draft(model: torch.nn.Module, name: str) -> DraftParts:
    weight_bytes = sum(t.numel() * t.element_size() for t in (*model.parameters(), *model.buffers()))
    return DraftParts(name, model.model, lambda: model.lm_head, model.config, weight_bytes)


def check_tokenizers(target_tok: Any, draft_tok: Any, target_vocab: int, draft_config: Any, target_config: Any,
                     name: str) -> None:
    """Refuse, naming the difference, a draft whose tokens would not mean the target's tokens."""
    tv, dv = target_tok.get_vocab(), draft_tok.get_vocab()
    if tv != dv:
        only_t = sorted(set(tv) - set(dv))[:3]
        only_d = sorted(set(dv) - set(tv))[:3]
        moved = sorted(t for t in set(tv) & set(dv) if tv[t] != dv[t])[:3]
        raise DraftModelError(
            f"draft model {name}: its tokenizer differs from the target's ({len(dv)} vs {len(tv)} tokens; "
            f"only the target's: {only_t}, only the draft's: {only_d}, other ids: {moved})")
    for attr in ("eos_token_id", "bos_token_id"):
        if getattr(target_tok, attr, None) != getattr(draft_tok, attr, None):
            raise DraftModelError(f"draft model {name}: {attr} {getattr(draft_tok, attr, None)} differs from the "
                                  f"target's {getattr(target_tok, attr, None)}")
    draft_vocab = int(draft_config.vocab_size)
    if draft_vocab < target_vocab:
        raise DraftModelError(f"draft model {name}: vocabulary of {draft_vocab} ids is smaller than the target's "
                              f"{target_vocab}")
    t_len, d_len = int(target_config.max_position_embeddings), int(draft_config.max_position_embeddings)
    if d_len < t_len:
        raise DraftModelError(f"draft model {name}: context of {d_len} positions is shorter than the target's {t_len}")


def load_draft(spec: str, target: torch.nn.Module, target_tokenizer: Any, device: str, dtype: torch.dtype,
               progress: Callable[..., None] | None = None, quantization: str = "none") -> DraftParts:
    """The draft named by `spec` (`self:N`, or any model source `load_model` takes), checked
    against the target, its linears quantized (`quantization`: w8a16 or w8a8, CPU only, no
    evaluation: a draft's numerics change acceptance, never the output); DraftModelError names the
    reason when it cannot serve as the draft."""
    if spec.startswith(SELF_PREFIX):
        if quantization != "none":
            raise DraftModelError(f"draft model {spec}: shares the target's weights, so it cannot be quantized "
                                  "apart from them (draftModel.quantization)")
        return self_draft(target, spec)
    from magnitude.runner.attention import ATTN_IMPLEMENTATION
    from magnitude.runner.loading import ModelSourceError, load_model, pick_device
    from magnitude.runner.quantize import CALIBRATION_TEXT, check_quantization, quantize_linears

    try:
        method = check_quantization(quantization, pick_device(device))
    except ValueError as exc:
        raise DraftModelError(f"draft model {spec}: draftModel.quantization: {exc}") from exc
    try:
        loaded = load_model(spec, device, str(dtype).removeprefix("torch."), attn_implementation=ATTN_IMPLEMENTATION,
                            progress=progress)
    except (ModelSourceError, OSError, ValueError) as exc:
        raise DraftModelError(f"draft model {spec}: cannot load: {exc}") from exc
    check_tokenizers(target_tokenizer, loaded.tokenizer, int(target.config.vocab_size), loaded.model.config,
                     target.config, spec)
    if method != "none":
        quantize_linears(loaded.model, method, loaded.device, target_tokenizer(CALIBRATION_TEXT)["input_ids"])
    return loaded_draft(loaded.model, spec)


class DraftModelProposer:
    """Implements runner.DraftProposer with a draft model; `prepare` runs the step's draft forwards."""

    method = "draft"

    def __init__(self, parts: DraftParts, vocab_size: int, block_size: int, num_blocks: int, num_swap_blocks: int,
                 device: torch.device, kv_dtype: torch.dtype, seed: int | None = None) -> None:
        self.parts = parts
        self._decoder_for: tuple[torch.nn.Module, Any] | None = None  # (parts.decoder, its paged forward)
        self.name = parts.name
        self.vocab_size = vocab_size  # the target's: draft ids at or above it are never drafted
        self.block_size = block_size
        self.device = device
        self.pool = PagedKVPool(kv_shape(parts.config, block_size, kv_dtype), num_blocks, num_swap_blocks, device)
        self.failed: str | None = None  # why drafting stopped for good (a draft forward raised)
        self._rng = torch.Generator(device=device)
        if seed is not None:
            self._rng.manual_seed(seed)
        else:
            self._rng.seed()
        self._fed: dict[str, int] = {}  # request -> leading positions whose draft K/V is valid
        self._skipped = False  # a step ran without the draft: cached blocks may lack its K/V
        self._speculating = True  # this step's StepPlan.speculating
        self._drafts: dict[str, list[int]] = {}
        self._q: dict[str, torch.Tensor] = {}
        self._last_fed: dict[str, int] = {}  # request -> last position the draft was fed this step

    @property
    def bytes_per_block(self) -> int:
        return self.pool.shape.bytes_per_block

    def follow_target(self) -> None:
        """A self-draft takes the target's current embeddings, final norm and rotary module: the
        draft is built before the target is quantized, and quantizing may replace them (w4a16's
        tied embeddings), which the draft must share rather than keep the replaced ones of."""
        inner = self.parts.target_decoder
        if inner is None:
            return
        for name, module in inner._modules.items():
            if name != "layers":
                self.parts.decoder._modules[name] = module
        self._decoder_for = None

    def release_pages(self) -> None:
        """Empty the draft's pool (ModelRunner.release_kv_pages): no request's draft K/V is valid after."""
        self._fed.clear()
        self._last_fed.clear()
        self.pool.release_pages()

    # -- the runner's hooks ------------------------------------------------------------------------

    def begin_step(self, plan: StepPlan) -> None:
        """The plan's swaps on the draft's pool (same block ids as the target's); forget released requests."""
        self.pool.swap_out(plan.swap_out)
        self.pool.swap_in(plan.swap_in)
        for rid in plan.released:
            self._fed.pop(rid, None)
        self._speculating = plan.speculating
        self._drafts.clear()
        self._q.clear()
        self._last_fed.clear()

    def prepare(self, seqs: list[ScheduledSeq]) -> None:
        """Feed the step's tokens to the draft and draft for every sequence with a lookahead."""
        if self.failed is not None or not seqs:
            return
        if not self._speculating:  # skip the draft; it catches up when drafting resumes
            for s in seqs:
                self._remember(s.request_id, self._valid_prefix(s))
            self._skipped = True
            return
        try:
            self._draft(seqs)
        except Exception as exc:  # noqa: BLE001 - a broken draft costs the speedup, never a request
            self.failed = f"{type(exc).__name__}: {exc}"
            self._drafts.clear()
            self._q.clear()
            log.error("draft model %s failed (%s): serving without speculation from now on", self.name, self.failed)

    def propose(self, seq: ScheduledSeq, k: int) -> list[int]:
        return self._drafts.get(seq.request_id, [])[:k]

    def draft_probs(self, request_id: str, n: int) -> torch.Tensor | None:
        """q of the first `n` drafts of a sampling request ([n, vocab]); None for greedy rows."""
        q = self._q.get(request_id)
        return None if q is None else q[:n]

    def end_step(self, seq: ScheduledSeq, num_drafts: int, num_kept: int) -> None:
        """After verification: `num_kept` tokens were emitted (num_kept - 1 drafts accepted). The
        draft's K/V stays valid through the accepted drafts it was fed (not a rejected one's, nor the
        last draft's, which no forward fed): the next step feeds it from there."""
        last_fed = self._last_fed.get(seq.request_id)
        if last_fed is None or num_drafts == 0:
            return
        accepted = min(num_kept - 1, num_drafts)
        end = seq.start_position + len(seq.token_ids)  # the first draft's position
        self._remember(seq.request_id, end + min(accepted, last_fed - end + 1))

    def _remember(self, request_id: str, fed: int) -> None:
        """Record what a request's draft K/V holds, most recent last. A release the runner never
        sees (a plan left empty is not executed) must not grow the map: beyond the requests that
        can hold blocks, the least recently scheduled go (at worst a live one's draft K/V is fed
        again: drafts change acceptance, never the output)."""
        self._fed.pop(request_id, None)
        self._fed[request_id] = fed
        while len(self._fed) > self.pool.num_blocks + self.pool.num_swap_blocks:
            del self._fed[next(iter(self._fed))]

    def _valid_prefix(self, s: ScheduledSeq) -> int:
        """Leading positions of `s` whose draft K/V is valid before this step writes from its start:
        what was fed, cut at the step's start (a recompute after preemption rewrites from 0); a
        request first seen here trusts its cached prefix only if no step ever skipped the draft."""
        fed = self._fed.get(s.request_id)
        if fed is None:
            return 0 if self._skipped else s.start_position
        return min(fed, s.start_position)

    # -- the forwards ------------------------------------------------------------------------------

    def _forward(self, slices: list[SeqSlice], ids: list[int], positions: list[int]) -> torch.Tensor:
        batch = build_paged_batch(slices, self.block_size, self.pool.k_layers, self.pool.v_layers, self.device)
        input_ids = torch.tensor([ids], dtype=torch.long, device=self.device)
        position_ids = torch.tensor([positions], dtype=torch.long, device=self.device)
        return self._paged_decoder()(input_ids, position_ids, batch)

    def _paged_decoder(self) -> Any:
        """The forward for `parts.decoder` as it is now: `parts` stays the one description of the
        draft, so replacing its decoder (a test breaking the draft mid-serving) takes effect."""
        if self._decoder_for is None or self._decoder_for[0] is not self.parts.decoder:
            self._decoder_for = (self.parts.decoder, paged_decoder(self.parts.decoder))
        return self._decoder_for[1]

    def _logits(self, hidden: torch.Tensor) -> torch.Tensor:
        logits = self.parts.head()(hidden)
        cap = getattr(self.parts.config, "final_logit_softcapping", None)
        if cap:
            logits = torch.tanh(logits / cap) * cap
        return logits[:, : self.vocab_size].float()  # a padded vocabulary's extra ids are never drafted

    def _choose(self, logits: torch.Tensor, seqs: list[ScheduledSeq], j: int) -> list[int]:
        """Draft j (0-based) of each row: the argmax for greedy requests, a draw from q otherwise."""
        tokens = row_argmax(logits)
        rows = [i for i, s in enumerate(seqs) if not s.sampling.greedy]
        if rows:
            params: list[SamplingParams] = [seqs[i].sampling for i in rows]
            q = torch.softmax(filter_logits(logits[rows], params), dim=-1)
            uniforms = torch.rand(len(rows), generator=self._rng, device=logits.device)
            for r, i in enumerate(rows):
                s = seqs[i]
                if s.sampling.seed is not None:
                    uniforms[r] = seeded_uniforms(s.sampling.seed, s.num_output_tokens + j, DRAFT_UNIFORM + 1,
                                                  logits.device)[DRAFT_UNIFORM]
            for r, (i, token) in enumerate(zip(rows, draw(q, uniforms))):
                tokens[i] = token
                rid = seqs[i].request_id
                prev = self._q.get(rid)
                self._q[rid] = q[r : r + 1] if prev is None else torch.cat([prev, q[r : r + 1]])
        return tokens

    @torch.inference_mode()
    def _draft(self, seqs: list[ScheduledSeq]) -> None:
        slices, ids, positions = [], [], []
        offset = 0
        for s in seqs:
            start = self._valid_prefix(s)
            toks = [*_context(s, start, s.start_position), *s.token_ids]
            self._remember(s.request_id, s.start_position + len(s.token_ids))
            slices.append(SeqSlice(offset, len(toks), start, s.block_table))
            ids.extend(toks)
            positions.extend(range(start, start + len(toks)))
            offset += len(toks)
        hidden = self._forward(slices, ids, positions)
        drafting = [i for i, s in enumerate(seqs) if s.sample and s.num_lookahead > 0]
        if not drafting:
            return
        ends = np.cumsum([sl.n for sl in slices]) - 1
        active = [seqs[i] for i in drafting]
        rows = torch.tensor([int(ends[i]) for i in drafting], device=self.device)
        for s in active:
            self._drafts[s.request_id] = []
            self._last_fed[s.request_id] = s.start_position + len(s.token_ids) - 1
        tokens = self._choose(self._logits(hidden[rows]), active, 0)
        for j in range(1, max(s.num_lookahead for s in active) + 1):
            for s, t in zip(active, tokens):
                self._drafts[s.request_id].append(t)
            active_tokens = [(s, t) for s, t in zip(active, tokens) if s.num_lookahead > j]
            if not active_tokens:
                return
            active = [s for s, _ in active_tokens]
            pos = [s.start_position + len(s.token_ids) - 1 + j for s in active]
            slices = [SeqSlice(i, 1, p, s.block_table) for i, (s, p) in enumerate(zip(active, pos))]
            hidden = self._forward(slices, [t for _, t in active_tokens], pos)
            for s, p in zip(active, pos):
                self._last_fed[s.request_id] = p
            tokens = self._choose(self._logits(hidden), active, j)


def _context(s: ScheduledSeq, lo: int, hi: int) -> list[int]:
    """The request's tokens at positions lo..hi-1 (its prompt, then its output)."""
    prompt, output = s.prompt_token_ids, s.output_token_ids
    n = len(prompt)
    tokens = [*prompt[lo:hi], *output[max(lo - n, 0) : max(hi - n, 0)]]
    if len(tokens) != hi - lo:  # a plan without its request's tokens: drafting stops (prepare), serving goes on
        raise ValueError(f"{s.request_id}: positions {lo}..{hi - 1} are not in its prompt and output tokens")
    return tokens


__all__ = ["DraftModelError", "DraftModelProposer", "DraftParts", "SELF_PREFIX", "check_tokenizers", "load_draft",
           "self_draft"]
