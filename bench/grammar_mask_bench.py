"""Per-step cost of a JSON-schema token mask at batch 1, 8 and 32: xgrammar against llguidance.

The basis for choosing the structured-output library (issue 13): for each library, the time to
fill one bitmask row per request (the matcher's work) and to apply the batch's bitmask to the
step's logits (one tensor op), stepping through a schema-valid JSON text token by token. Needs
`pip install xgrammar llguidance` (neither is a project dependency until one is wired in); a
missing library is reported and skipped.

    .venv/bin/python bench/grammar_mask_bench.py [--tokenizer DIR]   # default: the bundled SmolLM2's
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import time
from typing import Any

import torch
from transformers import AutoTokenizer

SCHEMA = json.dumps({
    "type": "object",
    "properties": {"name": {"type": "string"}, "age": {"type": "integer"}, "tags": {"type": "array", "items": {"type": "string"}}},
    "required": ["name", "age", "tags"], "additionalProperties": False,
})
TEXT = '{"name": "Alice Smith", "age": 42, "tags": ["a", "bb", "ccc"]}'
BATCHES = (1, 8, 32)


def default_tokenizer_dir() -> str:
    root = os.environ.get("MAGNITUDE_CACHE", os.path.expanduser("~/.cache/magnitude"))
    found = sorted(glob.glob(os.path.join(root, "models", "SmolLM2-*", "tokenizer.json")))
    if not found:
        raise SystemExit("no cached SmolLM2 tokenizer: run `make run` once or pass --tokenizer DIR")
    return os.path.dirname(found[0])


def run(name: str, new_matchers: Any, fill: Any, apply: Any, accept: Any, alloc: Any, ids: list[int], vocab: int) -> None:
    for batch in BATCHES:
        matchers = new_matchers(batch)
        mask = alloc(batch)
        logits = torch.randn(batch, vocab)
        fill_s = apply_s = 0.0
        apply(logits, mask)  # first call: any one-time kernel set-up is not a step's cost
        for token in ids:
            t0 = time.perf_counter()
            for row, m in enumerate(matchers):
                fill(m, mask, row)
            t1 = time.perf_counter()
            apply(logits, mask)
            t2 = time.perf_counter()
            for m in matchers:
                accept(m, token)
            fill_s, apply_s = fill_s + t1 - t0, apply_s + t2 - t1
        n = len(ids)
        print(f"{name:10s} batch {batch:2d}: fill {1000 * fill_s / n:7.3f} ms/step  apply {1000 * apply_s / n:7.3f} ms/step  "
              f"({n} steps, vocab {vocab}, {torch.get_num_threads()} threads)")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tokenizer", default=None)
    args = ap.parse_args()
    tok = AutoTokenizer.from_pretrained(args.tokenizer or default_tokenizer_dir())
    vocab = len(tok)
    ids = tok.encode(TEXT, add_special_tokens=False)
    try:
        import xgrammar as xgr

        t0 = time.perf_counter()
        compiler = xgr.GrammarCompiler(xgr.TokenizerInfo.from_huggingface(tok, vocab_size=vocab))
        t1 = time.perf_counter()
        grammar = compiler.compile_json_schema(SCHEMA)
        print(f"xgrammar: tokenizer info {t1 - t0:.2f} s, schema compile {1000 * (time.perf_counter() - t1):.1f} ms")
        run("xgrammar", lambda b: [xgr.GrammarMatcher(grammar) for _ in range(b)],
            lambda m, mask, row: m.fill_next_token_bitmask(mask, row), xgr.apply_token_bitmask_inplace,
            lambda m, t: m.accept_token(t), lambda b: xgr.allocate_token_bitmask(b, vocab), ids, vocab)
    except ImportError as exc:
        print(f"xgrammar: not installed ({exc})")
    try:
        import llguidance
        import llguidance.hf
        import llguidance.torch as lt

        t0 = time.perf_counter()
        ltok = llguidance.hf.from_tokenizer(tok, n_vocab=vocab)
        grammar = llguidance.LLMatcher.grammar_from_json_schema(SCHEMA)
        print(f"llguidance: tokenizer + grammar {time.perf_counter() - t0:.2f} s")
        run("llguidance", lambda b: [llguidance.LLMatcher(ltok, grammar) for _ in range(b)],
            lambda m, mask, row: lt.fill_next_token_bitmask(m, mask, row), lt.apply_token_bitmask_inplace,
            lambda m, t: m.consume_token(t), lambda b: lt.allocate_token_bitmask(b, vocab), ids, vocab)
    except ImportError as exc:
        print(f"llguidance: not installed ({exc})")


if __name__ == "__main__":
    main()
