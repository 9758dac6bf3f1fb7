"""`--runner simulated`: the real server, scheduler, admission and metrics, with the simulator's
cost model standing in for the forward pass (as llm-d tests with its vLLM simulator).

`SimulatedRunner.execute(plan)` sleeps the modelled step time and returns deterministic tokens:
the bytes of a fixed text, starting at an offset chosen by the request's seed, so the same
request always produces the same output. It never emits EOS, so every request runs to
`max_tokens`. Text goes through `ByteTokenizer`, a built-in byte-level tokenizer (one token per
UTF-8 byte plus ChatML specials) that stands in for the model's tokenizer: token counts
therefore differ from the real model's.
"""

from __future__ import annotations

import re
import time
from typing import Any, Callable

from magnitude.engine.output import RunnerOutput, SampledToken, StepPlan
from magnitude.policy.schema import EngineConfig

SIM_TEXT = (
    " The quick brown fox jumps over the lazy dog while the scheduler keeps every stream moving."
    " Paris is the capital of France."
).encode()
DEFAULT_NUM_BLOCKS = 4096
DEFAULT_MAX_MODEL_LEN = 8192


class ByteTokenizer:
    """Byte-level tokenizer named as such: ids 0..255 are bytes, then ChatML specials."""

    SPECIALS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")
    name = "byte-level"

    def __init__(self) -> None:
        self.special_ids = {s: 256 + i for i, s in enumerate(self.SPECIALS)}
        self.eos_token_id = self.special_ids["<|im_end|>"]
        self._split = re.compile("(" + "|".join(re.escape(s) for s in self.SPECIALS) + ")")

    def __len__(self) -> int:
        return 256 + len(self.SPECIALS)

    def get_vocab(self) -> dict[str, int]:
        return {**{bytes([i]).decode("latin-1"): i for i in range(256)}, **self.special_ids}

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        ids: list[int] = []
        for part in self._split.split(text):
            if part in self.special_ids:
                ids.append(self.special_ids[part])
            elif part:
                ids.extend(part.encode("utf-8"))
        return ids

    def decode(self, ids: list[int], skip_special_tokens: bool = False) -> str:
        out = bytearray()
        for i in ids:
            if i < 256:
                out.append(i)
            elif not skip_special_tokens:
                out.extend(self.SPECIALS[i - 256].encode())
        return out.decode("utf-8", errors="replace")

    def convert_ids_to_tokens(self, ids: list[int]) -> list[str]:
        return [self.decode([i]) for i in ids]

    def apply_chat_template(self, messages: list[dict[str, str]], tokenize: bool = False, add_generation_prompt: bool = True) -> Any:
        text = "".join(f"<|im_start|>{m['role']}\n{m['content']}<|im_end|>\n" for m in messages)
        if add_generation_prompt:
            text += "<|im_start|>assistant\n"
        return self.encode(text, add_special_tokens=False) if tokenize else text


def cost_function(spec: str = "linear", block_size: int = 16) -> Callable[[StepPlan], float]:
    """Step time in seconds for a plan, from the simulator's cost models (`unit`, `linear`, FILE.json)."""
    from magnitude.sim.cost import load_cost_model

    return load_cost_model(spec, block_size).step_seconds


class SimulatedRunner:
    def __init__(
        self,
        config: EngineConfig,
        cost: Callable[[StepPlan], float],
        *,
        model_name: str = "simulated",
        max_model_len: int | None = None,
        time_scale: float = 1.0,
        sleep: Callable[[float], None] = time.sleep,
    ) -> None:
        self.tokenizer = ByteTokenizer()
        self.eos_token_ids = [self.tokenizer.eos_token_id]
        self.model_name = model_name
        self.max_model_len = max_model_len or config.admission.max_model_len or DEFAULT_MAX_MODEL_LEN
        self.num_blocks = config.kv_cache.num_blocks or DEFAULT_NUM_BLOCKS
        self.num_swap_blocks = config.kv_cache.swap_blocks
        self.block_size = config.kv_cache.block_size
        self._cost = cost
        self._time_scale = time_scale
        self._sleep = sleep

    def execute(self, plan: StepPlan) -> RunnerOutput:
        start = time.monotonic()
        duration = max(0.0, self._cost(plan)) * self._time_scale
        sampled: dict[str, list[SampledToken]] = {}
        for seq in plan.seqs:
            if not seq.sample:
                continue
            offset = (seq.sampling.seed or 0) % len(SIM_TEXT)
            token = SampledToken(SIM_TEXT[(offset + seq.num_output_tokens) % len(SIM_TEXT)], logprob=0.0)
            if seq.sampling.logprobs:
                token.top_logprobs = [(token.token_id, 0.0)]
            sampled[seq.request_id] = [token]
        remaining = duration - (time.monotonic() - start)
        if remaining > 0:
            self._sleep(remaining)
        return RunnerOutput(sampled=sampled, duration_s=time.monotonic() - start)
