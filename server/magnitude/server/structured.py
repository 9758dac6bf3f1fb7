"""Structured outputs: JSON grammars for constrained decoding, and the output contract check.

A request's *output contract* is what its answer must be: any JSON object (`response_format`
`json_object`), an instance of a JSON schema (`json_schema`, or the arguments of a forced tool
call), or an array of tool calls (`tool_choice: required`). `Grammars` compiles a contract's
schema once with xgrammar (chosen by `bench/grammar_mask_bench.py`: its per-step mask fill and
apply were the cheapest on the SmolLM2 tokenizer), caches compiled grammars by the schema's
SHA-256, and hands each request a fresh matcher, which the runner uses as the request's
`TokenConstraint`. JSON is generated compactly (`any_whitespace=False`): a small model allowed
free whitespace can spend its whole budget on newlines.

`check_output` validates the finished text against the contract with `jsonschema`, independent of
the grammar library, so a grammar bug shows up as `invalid` instead of a client's parse error:
`valid`, `invalid`, or `unverified` when the answer was cut short (`length`, a stop string).
"""

from __future__ import annotations

import hashlib
import json
import re
import threading
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any, Literal

import jsonschema

ContractKind = Literal["json_object", "json_schema", "tool_calls"]
ContractResult = Literal["valid", "invalid", "unverified"]
CONTRACT_RESULTS: tuple[ContractResult, ...] = ("valid", "invalid", "unverified")
MAX_CACHED_GRAMMARS = 256


class SchemaError(ValueError):
    """A schema that is not valid JSON Schema, or that the grammar library cannot compile."""


@dataclass(frozen=True)
class OutputContract:
    """What a response must be: an instance of `schema` (json_object: `{"type": "object"}`)."""

    kind: ContractKind
    schema: dict[str, Any]

    @property
    def schema_text(self) -> str:
        """The schema as compact JSON, keys in the client's order: property order is the order
        the grammar generates them in, so it is part of the cache key too."""
        return json.dumps(self.schema, separators=(",", ":"))


def check_schema(schema: Any) -> None:
    """Raise SchemaError unless `schema` is a JSON Schema (draft 2020-12 metaschema)."""
    if not isinstance(schema, dict):
        raise SchemaError("a JSON schema must be an object")
    try:
        jsonschema.Draft202012Validator.check_schema(schema)
    except jsonschema.SchemaError as exc:
        raise SchemaError(f"invalid JSON schema: {exc.message}") from exc


def check_output(contract: OutputContract, text: str, finish_reason: str) -> ContractResult:
    """Whether `text` honours `contract`; `unverified` when generation did not end by itself."""
    if finish_reason not in ("stop", "tool_calls"):
        return "unverified"
    try:
        value = json.loads(text)
    except ValueError:
        return "invalid"
    try:
        jsonschema.validate(value, contract.schema, cls=jsonschema.Draft202012Validator)
    except jsonschema.ValidationError:
        return "invalid"
    return "valid"


class Grammars:
    """Compiles contracts for one tokenizer and makes per-request matchers. Thread-safe: the
    server compiles off the event loop."""

    def __init__(self, tokenizer: Any, vocab_size: int, stop_token_ids: list[int]) -> None:
        import xgrammar

        self._xgr = xgrammar
        info = xgrammar.TokenizerInfo.from_huggingface(tokenizer, vocab_size=vocab_size, stop_token_ids=stop_token_ids)
        self._compiler = xgrammar.GrammarCompiler(info, max_threads=2, cache_enabled=False)
        self._cache: OrderedDict[str, Any] = OrderedDict()
        self._lock = threading.Lock()
        self.hits = 0
        self.compiles = 0

    def compile(self, contract: OutputContract) -> Any:
        """The compiled grammar of `contract`, from the cache when its schema was seen before."""
        key = hashlib.sha256(f"{contract.kind}\n{contract.schema_text}".encode()).hexdigest()
        with self._lock:
            if key in self._cache:
                self._cache.move_to_end(key)
                self.hits += 1
                return self._cache[key]
        try:
            compiled = self._compiler.compile_json_schema(contract.schema_text, any_whitespace=False, strict_mode=True)
        except Exception as exc:  # noqa: BLE001 - xgrammar raises RuntimeError with its parser's text
            lines = str(exc).strip().splitlines() or [type(exc).__name__]
            reason = re.sub(r"^\[[0-9:]+\] \S+: ", "", lines[0])  # drop xgrammar's "[time] file.cc:line: "
            raise SchemaError(f"the grammar library cannot compile this schema: {reason}") from exc
        with self._lock:
            self.compiles += 1
            self._cache[key] = compiled
            while len(self._cache) > MAX_CACHED_GRAMMARS:
                self._cache.popitem(last=False)
        return compiled

    def constraint(self, contract: OutputContract) -> Any:
        """A fresh matcher for one request (a `TokenConstraint`)."""
        return self._xgr.GrammarMatcher(self.compile(contract))
