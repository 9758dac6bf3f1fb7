"""The FastAPI app: OpenAI routes, health, metrics, admin shedding, auth, streaming.

`create_app(engine, registry, settings)` wires an `AsyncEngine` (which loads the model in the
background) to HTTP. Requests are validated by `protocol.py`; checks that need the loaded model
(model name, context length, priority class) happen here; admission answers 429 with
Retry-After; a client disconnect (streaming or not) aborts the request in the engine.
"""

from __future__ import annotations

import asyncio
import dataclasses
import hmac
import logging
import os
from contextlib import asynccontextmanager
from dataclasses import dataclass
from typing import Any, AsyncIterator

from fastapi import Depends, FastAPI, Header, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CollectorRegistry

from magnitude.engine.sampling import SamplingParams
from magnitude.server.auth import (
    DEFAULT_RELOAD_INTERVAL_S,
    GATEWAY_CLASS_HEADER,
    GATEWAY_TENANT_HEADER,
    Authenticator,
    AuthError,
    Claims,
    Decision,
    bearer_token,
)
from magnitude.server.async_engine import (
    AsyncEngine,
    Delta,
    Failed,
    Finished,
    NotReady,
    Progress,
    Rejected,
    RequestSpec,
    RequestStream,
    new_request_id,
)
from magnitude.server.answer import AnswerPlan, PlanError, plan_answer
from magnitude.server.body_limit import DEFAULT_MAX_BODY_BYTES, BodySizeLimit
from magnitude.server.choices import ChoiceStreams
from magnitude.server.errors import APIError, install_error_handlers
from magnitude.server.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    SheddingRequest,
    TokenizeChatRequest,
    TokenizeCompletionRequest,
)
from magnitude.server.responses import SSE_DONE, ResponseBuilder, merge_choices, sse
from magnitude.server.structured import Grammars, SchemaError
from magnitude.server.timeline import ArrivalStamp, arrival_of, client_request_id
from magnitude.server.tools import messages_for_template

log = logging.getLogger("magnitude.server")

NOT_READY_RETRY_S = 5.0


@dataclass
class ServerSettings:
    api_key: str | None = None  # bearer key for /v1 routes; None: open
    auth_mode: str | None = None  # none | apiKeys | trustedGateway (auth.py); None: none
    api_keys_file: str | None = None  # apiKeys: the keys document, re-read when it changes
    api_keys_reload_s: float = DEFAULT_RELOAD_INTERVAL_S  # how often a lookup may re-check the keys file
    admin_token: str | None = None  # bearer token for /admin routes; None: admin disabled
    served_model_name: str | None = None  # extra name clients may use for the model
    shutdown_grace_s: float = 30.0
    loading_wait_s: float = 600.0  # how long a streaming request with include_progress waits for loading
    max_body_bytes: int | None = None  # None: what the model's context can use (DEFAULT_MAX_BODY_BYTES while loading)

    @classmethod
    def from_env(cls, **overrides: Any) -> "ServerSettings":
        s = cls(
            api_key=os.environ.get("MAGNITUDE_API_KEY") or None,
            admin_token=os.environ.get("MAGNITUDE_ADMIN_TOKEN") or None,
            auth_mode=os.environ.get("MAGNITUDE_AUTH_MODE") or None,
            api_keys_file=os.environ.get("MAGNITUDE_API_KEYS_FILE") or None,
        )
        for k, v in overrides.items():
            if v is not None:
                setattr(s, k, v)
        return s


def _bearer_ok(authorization: str | None, secret: str) -> bool:
    token = bearer_token(authorization)
    return token is not None and hmac.compare_digest(token.encode(), secret.encode())


def _api_error(exc: AuthError) -> APIError:
    return APIError(exc.status, exc.message, param=exc.param, code=exc.code)


def create_app(engine: AsyncEngine, registry: CollectorRegistry | None = None, settings: ServerSettings | None = None) -> FastAPI:
    settings = settings or ServerSettings()
    # Bad settings or keys file: AuthConfigError before serving (`magnitude serve` exits 2).
    authenticator = Authenticator.build(
        settings.auth_mode,
        settings.api_key,
        settings.api_keys_file,
        [c.name for c in engine.config.scheduler.priority_classes],
        settings.api_keys_reload_s,
    )

    @asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        engine.start()
        yield
        await engine.shutdown(grace_s=0.0 if engine.stopping else settings.shutdown_grace_s)

    app = FastAPI(title="Magnitude", version="0.1.0", lifespan=lifespan)
    app.add_middleware(
        BodySizeLimit,
        max_bytes=lambda: settings.max_body_bytes or engine.max_body_bytes or DEFAULT_MAX_BODY_BYTES,
    )
    app.add_middleware(ArrivalStamp, clock=engine.clock)  # outermost: arrival before the body is read
    app.state.engine = engine
    app.state.settings = settings
    install_error_handlers(app)

    async def require_api_key(request: Request, authorization: str | None = Header(default=None)) -> None:
        # The identity (apiKeys) rides on the request for `_serve`'s decision.
        try:
            request.state.identity = authenticator.authenticate(authorization)
        except AuthError as exc:
            raise _api_error(exc) from exc

    async def require_admin(authorization: str | None = Header(default=None)) -> None:
        if not settings.admin_token:
            raise APIError(403, "admin endpoint disabled: set MAGNITUDE_ADMIN_TOKEN", code="admin_disabled")
        if not _bearer_ok(authorization, settings.admin_token):
            raise APIError(401, "missing or invalid admin token", code="invalid_admin_token")

    def source_info() -> dict[str, str]:
        """Where the served weights came from and the revision they were pinned to (hf://: the commit SHA)."""
        src = getattr(engine.runner, "model_source", None)
        return {"source": src.source, "revision": src.revision} if src is not None and src.source else {}

    def model_names() -> list[str]:
        names = [n for n in (engine.model_name, settings.served_model_name) if n]
        return list(dict.fromkeys(names))

    # -- health, readiness, metrics ---------------------------------------------------------------
    # Liveness: fails only when a restart is the fix (the engine loop died, or a step hung), never
    # while loading or deliberately not ready, so the kubelet restarts exactly those pods.
    @app.get("/healthz")
    async def healthz() -> JSONResponse:
        failure = engine.liveness_failure
        if failure is not None:
            return JSONResponse({"status": failure[0], "message": failure[1]}, status_code=503)
        return JSONResponse({"status": "ok"})

    @app.get("/health")
    async def health() -> Response:
        """vLLM's shape: 200 with an empty body while alive; the same verdict as /healthz."""
        failure = engine.liveness_failure
        if failure is not None:
            return APIError(503, failure[1], code=f"engine_{failure[0]}").response()
        return Response(status_code=200)

    @app.get("/readyz")
    async def readyz() -> JSONResponse:
        # The quantization record rides along both ways: the operator reads it from not-ready pods.
        record = {"quantization": engine.quantization} if engine.quantization is not None else {}
        # Which dtype/quantization the runner loaded and why (magnitude serve: runner/defaults.py).
        choice = getattr(engine.runner, "weights_choice", None)
        if choice is not None:
            record["weights"] = choice.to_document()
        kv_dtype = getattr(engine.runner, "kv_cache_dtype", None)
        if kv_dtype is not None:  # kvCache.dtype as resolved (runner/defaults.py)
            record["kv_cache"] = {"dtype": kv_dtype, "reason": getattr(engine.runner, "kv_cache_dtype_reason", "")}
        if engine.ready:
            # What the scheduler runs with (derived or set): the operator shows it in status.scheduler.
            limits = getattr(engine, "scheduler_limits", None)
            scheduler = {"scheduler": limits.to_document()} if limits is not None else {}
            return JSONResponse({"status": "ready", "model": engine.model_name, "load_seconds": engine.load_seconds,
                                 **source_info(), **record, **scheduler})
        phase, message = engine.not_ready_reason()
        return JSONResponse(
            {"status": "not_ready", "phase": phase, "progress": engine.phase_progress, "message": message,
             **getattr(engine, "phase_detail", {}), **source_info(), **record},
            status_code=503,
            headers={"Retry-After": str(int(NOT_READY_RETRY_S))},
        )

    @app.get("/metrics")
    async def metrics() -> Response:
        engine.refresh_gauges()
        body, content_type = engine.metrics.exposition()
        return Response(body, media_type=content_type)

    # -- admin --------------------------------------------------------------------------------------
    @app.get("/admin/shedding", dependencies=[Depends(require_admin)])
    async def get_shedding() -> dict[str, Any]:
        return {"enabled": bool(engine.shed_classes), "shed_classes": sorted(engine.shed_classes), "order": engine.shed_order()}

    @app.post("/admin/shedding", dependencies=[Depends(require_admin)])
    async def post_shedding(body: SheddingRequest) -> dict[str, Any]:
        try:
            shed = engine.set_shedding(body.enabled, body.levels, body.classes)
        except ValueError as exc:
            raise APIError(400, str(exc), param="classes") from exc
        log.warning("load shedding %s: %s", "on" if shed else "off", shed)
        return {"enabled": bool(shed), "shed_classes": shed, "order": engine.shed_order()}

    # -- debug: what happened to a request, and why (admin token: timelines name tenants) ------------
    @app.get("/debug/requests/{request_id}", dependencies=[Depends(require_admin)])
    async def debug_request(request_id: str) -> dict[str, Any]:
        doc = engine.request_log.find(request_id)
        if doc is None:
            raise APIError(404, f"no request '{request_id}' among the live and the {engine.request_log.max_requests} "
                                "most recent ones", param="request_id", code="request_not_found")
        return doc

    @app.get("/debug/cost-model", dependencies=[Depends(require_admin)])
    async def debug_cost_model() -> dict[str, Any]:
        """The step-cost model the scheduler runs on, in the format `magnitude simulate --cost-model` reads."""
        doc = getattr(engine, "cost_model_document", None)
        if doc is None:
            phase = "the engine is still loading" if not engine.ready else "this engine was started without one"
            raise APIError(404, f"no cost model: {phase}", code="cost_model_unavailable")
        served = getattr(engine, "served_cost", None)
        if served is not None:  # what served steps took against the table, for replays (sim/cost.py ServedCost)
            doc = {**doc, "meta": {**(doc.get("meta") or {}), **served.document_meta(getattr(engine, "origin", 0.0))}}
        return doc

    @app.get("/debug/decisions", dependencies=[Depends(require_admin)])
    async def debug_decisions(since: int = 0, limit: int = 1000) -> dict[str, Any]:
        if since < 0 or not 1 <= limit <= 10_000:
            raise APIError(400, "since must be >= 0 and limit in 1..10000", param="since" if since < 0 else "limit")
        return engine.request_log.decisions(since, limit)

    # -- OpenAI -------------------------------------------------------------------------------------
    @app.get("/v1/models", dependencies=[Depends(require_api_key)])
    async def list_models() -> dict[str, Any]:
        record = {"quantization": engine.quantization} if engine.quantization is not None else {}
        data = [
            {"id": n, "object": "model", "created": 0, "owned_by": "magnitude", "max_model_len": engine.max_model_len or None,
             **source_info(), **record}
            for n in model_names()
        ]
        return {"object": "list", "data": data}

    @app.post("/v1/chat/completions", dependencies=[Depends(require_api_key)])
    async def chat_completions(
        body: ChatCompletionRequest, request: Request, x_tenant: str | None = Header(default=None)
    ) -> Response:
        return await _serve(body, request, x_tenant, chat=True)

    @app.post("/v1/completions", dependencies=[Depends(require_api_key)])
    async def completions(body: CompletionRequest, request: Request, x_tenant: str | None = Header(default=None)) -> Response:
        return await _serve(body, request, x_tenant, chat=False)

    def check_model(name: str | None) -> None:
        """An omitted model means the served one (vLLM's behaviour with one model)."""
        if name is not None and name not in model_names():
            raise APIError(404, f"model '{name}' not found; available: {model_names()}", param="model", code="model_not_found")

    def model_id(body: ChatCompletionRequest | CompletionRequest) -> str:
        return body.model or next(iter(model_names()), "")

    # -- vLLM's tokenizer endpoints ---------------------------------------------------------------------

    @app.post("/tokenize", dependencies=[Depends(require_api_key)])
    async def tokenize(body: TokenizeCompletionRequest | TokenizeChatRequest) -> dict[str, Any]:
        check_not_ready()
        check_model(body.model)
        renderer = engine.renderer
        assert renderer is not None
        try:
            if isinstance(body, TokenizeChatRequest):
                messages, _ = messages_for_template(renderer, [m.template_fields() for m in body.messages], None)
                ids = await asyncio.to_thread(renderer.chat, messages, body.add_generation_prompt)
            else:
                ids = await asyncio.to_thread(renderer.text, body.prompt, body.add_special_tokens)
        except Exception as exc:  # noqa: BLE001 - e.g. a chat template refusing a role order
            raise APIError(400, f"could not tokenize: {exc}", param="messages" if isinstance(body, TokenizeChatRequest) else "prompt") from exc
        return {"count": len(ids), "max_model_len": engine.max_model_len, "tokens": ids,
                "token_strs": renderer.token_strs(ids) if body.return_token_strs else None}

    @app.post("/detokenize", dependencies=[Depends(require_api_key)])
    async def detokenize(body: DetokenizeRequest) -> dict[str, Any]:
        check_not_ready()
        check_model(body.model)
        renderer = engine.renderer
        assert renderer is not None
        bad = renderer.check_ids(body.tokens)
        if bad is not None:
            raise APIError(400, f"token id {body.tokens[bad]} at index {bad} is outside the vocabulary", param="tokens")
        return {"prompt": await asyncio.to_thread(renderer.tokenizer.decode, body.tokens)}

    # -- request handling ---------------------------------------------------------------------------
    def check_not_ready() -> None:
        if not engine.ready:
            phase, message = engine.not_ready_reason()
            raise APIError(503, message, code=f"not_ready:{phase}", retry_after_s=NOT_READY_RETRY_S)

    grammars: list[Grammars] = []  # built on first use (xgrammar reads the whole vocabulary once)

    async def constraint_for(plan: AnswerPlan, body: ChatCompletionRequest | CompletionRequest) -> Any:
        """The request's grammar matcher, or None; 400 naming the field when it cannot be built."""
        if plan.contract is None:
            return None
        param = plan.contract_param or "response_format"
        runner = engine.runner
        if not getattr(runner, "supports_constraints", False):
            raise APIError(400, f"{param}: this engine's runner ({type(runner).__name__}) cannot constrain decoding",
                           param=param, code="unsupported_parameter")
        if not grammars:
            assert runner is not None
            built = await asyncio.to_thread(Grammars, runner.tokenizer, int(runner.vocab_size), list(runner.eos_token_ids))
            grammars[:] = grammars or [built]
        try:
            return await asyncio.to_thread(grammars[0].constraint, plan.contract)
        except SchemaError as exc:
            raise APIError(400, f"{param}: {exc}", param=param, code="invalid_schema") from exc

    async def prepare(body: ChatCompletionRequest | CompletionRequest, who: Decision, chat: bool) -> tuple[AnswerPlan, RequestSpec]:
        """Checks that need the loaded model, then tokenization and sampling parameters."""
        check_model(body.model)
        max_choices = engine.config.admission.max_choices
        if body.n > max_choices:
            raise APIError(400, f"n={body.n}: at most {max_choices} choices per request (admission.maxChoices)", param="n")
        classes = [c.name for c in engine.config.scheduler.priority_classes]
        priority_class = who.priority_class
        if priority_class not in classes:
            raise APIError(400, f"unknown priority_class '{priority_class}'; known: {classes}", param=who.class_param)
        renderer = engine.renderer
        assert renderer is not None
        plan = AnswerPlan()
        if isinstance(body, ChatCompletionRequest):
            try:
                plan = plan_answer(body)
            except PlanError as exc:
                raise APIError(400, str(exc), param=exc.param, code="invalid_schema") from exc
        if plan.contract is not None and body.ignore_eos:
            # The grammar ends the answer (only EOS is allowed once it is complete).
            raise APIError(400, f"ignore_eos: cannot be combined with {plan.contract_param}: the grammar ends the answer",
                           param="ignore_eos")
        constraint = await constraint_for(plan, body)
        prompt_param = "messages" if chat else "prompt"
        limit = engine.max_model_len
        # Bounded before any rendering or tokenizing: more characters (or ids) than can fit.
        chars = body.prompt_chars
        if chars > engine.max_prompt_chars:
            raise APIError(
                400,
                f"{prompt_param} has {chars} characters; at most {engine.max_prompt_chars} characters can fit "
                f"the model's context of {limit} tokens ({renderer.max_chars_per_token} characters per token at most)",
                param=prompt_param,
                code="context_length_exceeded",
            )
        try:
            if isinstance(body, ChatCompletionRequest):
                messages, tools = await asyncio.to_thread(
                    messages_for_template, renderer, [m.template_fields() for m in body.messages], plan.tools)
                dropped = renderer.unrendered_field(messages)
                if dropped is not None:
                    index, field = dropped
                    raise APIError(400, f"messages[{index}].{field}: this model's chat template does not render it, "
                                        "so it would be dropped", param=f"messages.{index}.{field}",
                                   code="unsupported_parameter")
                ids = await asyncio.to_thread(renderer.chat, messages, True, tools)
            elif isinstance(body.prompt, list) and body.prompt and isinstance(body.prompt[0], int):
                ids = body.prompt  # type: ignore[assignment]
                if len(ids) < limit:
                    bad = await asyncio.to_thread(renderer.check_ids, ids)
                    if bad is not None:
                        raise APIError(400, f"prompt token id {ids[bad]} at index {bad} is outside the vocabulary", param="prompt")
            else:
                text = body.prompt if isinstance(body.prompt, str) else body.prompt[0]
                ids = await asyncio.to_thread(renderer.text, text)  # type: ignore[arg-type]
        except APIError:
            raise
        except Exception as exc:  # noqa: BLE001 - e.g. a chat template refusing a role order
            raise APIError(400, f"could not render {prompt_param}: {exc}", param=prompt_param) from exc
        if not ids:
            raise APIError(400, f"{prompt_param} is empty after tokenization", param=prompt_param)
        if len(ids) >= limit:
            raise APIError(
                400,
                f"{prompt_param} has {len(ids)} tokens; the model's context is {limit} tokens",
                param=prompt_param,
                code="context_length_exceeded",
            )
        max_tokens = body.requested_max_tokens
        if max_tokens is None:
            # The rest of the context (vLLM's default), or the configured default; never more than
            # the KV pool can hold, so a request that sets nothing is never refused for its size.
            rest = min(limit, engine.kv_capacity_tokens or limit) - len(ids)
            default = engine.config.admission.default_max_tokens
            max_tokens = max(1, min(rest, default) if default is not None else rest)
        elif len(ids) + max_tokens > limit:
            raise APIError(
                400,
                f"max_tokens={max_tokens} plus {len(ids)} prompt tokens exceeds the context of {limit} tokens",
                param="max_tokens",
                code="context_length_exceeded",
            )
        bias = body.token_bias
        for param, ids_ in (("logit_bias", list(bias)), ("stop_token_ids", body.stop_token_ids or [])):
            outside = [t for t in ids_ if t >= renderer.vocab_size]
            if outside:
                raise APIError(400, f"{param}: token id {outside[0]} is outside the vocabulary of {renderer.vocab_size}",
                               param=param)
        try:
            sampling = SamplingParams(
                max_tokens=max_tokens,
                temperature=body.temperature,
                top_p=body.top_p,
                top_k=body.top_k,
                seed=None if body.seed is None else body.seed % 2**63,  # any int a client sends maps into int64
                stop=body.stop_strings,
                ignore_eos=body.ignore_eos,
                logprobs=body.num_logprobs,
                presence_penalty=body.presence_penalty,
                frequency_penalty=body.frequency_penalty,
                repetition_penalty=body.repetition_penalty,
                min_p=body.min_p,
                logit_bias=bias,
                stop_token_ids=list(body.stop_token_ids or []),
                constraint=constraint,
            )
        except ValueError as exc:
            raise APIError(400, str(exc), param=str(exc).split(" ", 1)[0]) from exc
        return plan, RequestSpec(
            prompt_token_ids=ids,
            sampling=sampling,
            priority_class=priority_class,
            tenant=who.tenant,
            deadline_ms=body.deadline_ms,
            include_progress=body.include_progress,
        )

    def submit(spec: RequestSpec, request_id: str | None = None) -> RequestStream:
        try:
            return engine.submit(spec, request_id)
        except Rejected as exc:
            kind = exc.reason.split(":", 1)[0]
            if kind in ("too_long", "exceeds_kv_capacity"):
                raise APIError(400, f"request too large for this server: {exc.reason}", param="max_tokens", code=kind) from exc
            raise APIError(429, f"server overloaded: {exc.reason}", code=kind, retry_after_s=exc.retry_after_s or 1.0) from exc
        except NotReady as exc:
            raise APIError(503, str(exc), code=f"not_ready:{exc.phase}", retry_after_s=NOT_READY_RETRY_S) from exc

    async def _serve(body: ChatCompletionRequest | CompletionRequest, request: Request, x_tenant: str | None, chat: bool) -> Response:
        claims = Claims(
            user=body.user,
            x_tenant=x_tenant,
            priority_class=body.priority_class,
            gateway_tenant=request.headers.get(GATEWAY_TENANT_HEADER),
            gateway_class=request.headers.get(GATEWAY_CLASS_HEADER),
        )
        try:
            who = authenticator.decide(
                getattr(request.state, "identity", None), claims, engine.config.scheduler.default_priority_class
            )
        except AuthError as exc:
            raise _api_error(exc) from exc
        arrival = arrival_of(request.scope)
        try:
            client_id = client_request_id(request.headers.get("x-request-id"))
        except ValueError as exc:
            raise APIError(400, str(exc), param="X-Request-Id") from exc
        if body.stream and body.include_progress and not engine.ready and engine.phase not in ("failed",) and not engine.stopping:
            return StreamingResponse(_stream_after_loading(body, who, chat, arrival, client_id), media_type="text/event-stream")
        check_not_ready()
        plan, spec = await prepare(body, who, chat)
        spec.arrival, spec.client_request_id = arrival, client_id
        specs = await choice_specs(body, plan, spec)
        choices = start_choices(specs)
        builders = choice_builders(choices.streams[0].request_id, body, chat, plan, specs[0])
        headers = {"X-Request-Id": choices.streams[0].request_id}
        if body.stream:
            return StreamingResponse(_sse(choices, builders, body.include_usage), media_type="text/event-stream",
                                     headers=headers)
        return await _collect(choices, builders, request, headers)

    async def choice_specs(body: ChatCompletionRequest | CompletionRequest, plan: AnswerPlan, spec: RequestSpec) -> list[RequestSpec]:
        """One spec per choice: its own seed (seed + index) and its own grammar matcher."""
        specs = [spec]
        for i in range(1, body.n):
            seed = spec.sampling.seed
            sampling = dataclasses.replace(spec.sampling, seed=None if seed is None else (seed + i) % 2**63,
                                           constraint=await constraint_for(plan, body))
            specs.append(dataclasses.replace(spec, sampling=sampling))
        return specs

    def start_choices(specs: list[RequestSpec], request_id: str | None = None) -> ChoiceStreams:
        first = submit(specs[0], request_id)
        return ChoiceStreams(first, len(specs), lambda i: submit(specs[i], f"{first.request_id}-{i}"))

    def choice_builders(request_id: str, body: ChatCompletionRequest | CompletionRequest, chat: bool, plan: AnswerPlan,
                        spec: RequestSpec) -> list[ResponseBuilder]:
        builders = [ResponseBuilder(request_id, chat, model_id(body), want_logprobs=spec.sampling.logprobs is not None,
                                    index=i, plan=plan, on_contract=engine.metrics.on_output_contract)
                    for i in range(body.n)]
        for b in builders[1:]:
            b.created = builders[0].created
        return builders

    async def _stream_after_loading(
        body: ChatCompletionRequest | CompletionRequest, who: Decision, chat: bool, arrival: float | None, client_id: str | None
    ) -> AsyncIterator[str]:
        """Streaming request that arrived while loading: report loading progress, then serve it."""
        request_id = new_request_id()
        progress = ResponseBuilder(request_id, chat, model_id(body))
        queue: list[str] = []

        async def report(ev: Progress) -> None:
            queue.append(sse(progress.progress_chunk(ev)))

        waiter = asyncio.create_task(engine.wait_ready(report, settings.loading_wait_s))
        try:
            while not waiter.done():
                await asyncio.wait({waiter}, timeout=0.2)
                while queue:
                    yield queue.pop(0)
            while queue:
                yield queue.pop(0)
            waiter.result()
            loading_s = 0.0 if arrival is None else max(0.0, engine.clock() - arrival)
            plan, spec = await prepare(body, who, chat)
            spec.arrival, spec.loading_s, spec.client_request_id = arrival, loading_s, client_id
            specs = await choice_specs(body, plan, spec)
            choices = start_choices(specs, request_id)
        except (APIError, NotReady) as exc:
            err = exc if isinstance(exc, APIError) else APIError(503, str(exc), code=f"not_ready:{exc.phase}")
            yield sse(err.body())
            yield SSE_DONE
            return
        finally:
            waiter.cancel()
        builders = choice_builders(request_id, body, chat, plan, specs[0])
        for b in builders:
            b.created = progress.created
        async for chunk in _sse(choices, builders, body.include_usage):
            yield chunk

    async def _sse(choices: ChoiceStreams, builders: list[ResponseBuilder], include_usage: bool) -> AsyncIterator[str]:
        finished: dict[int, Finished] = {}
        try:
            if builders[0].chat:
                for b in builders:
                    yield sse(b.role_chunk())
            async for i, ev in choices.events():
                builder = builders[i]
                if isinstance(ev, Progress):
                    yield sse(builder.progress_chunk(ev))
                elif isinstance(ev, Delta):
                    chunk = builder.delta_chunk(ev)
                    if chunk is not None:
                        yield sse(chunk)
                elif isinstance(ev, Finished):
                    finished[i] = ev
                    for chunk in builder.finish_chunks(ev):
                        yield sse(chunk)
                elif isinstance(ev, Failed):
                    yield sse(APIError(ev.status, ev.message, code=ev.code).body())
            if include_usage and len(finished) == len(builders):
                yield sse(builders[0].usage_chunk([finished[i] for i in range(len(builders))]))
            yield SSE_DONE
        except APIError as exc:  # a later choice refused by admission: the stream has started
            yield sse(exc.body())
            yield SSE_DONE
        finally:
            # Client gone (the response task was cancelled) or stream ended: abort is a no-op if finished.
            choices.abort()

    async def _collect(choices: ChoiceStreams, builders: list[ResponseBuilder], request: Request,
                       headers: dict[str, str]) -> Response:
        async def consume() -> tuple[list[list[Delta]], list[Finished]]:
            deltas: list[list[Delta]] = [[] for _ in builders]
            ends: dict[int, Finished] = {}
            async for i, ev in choices.events():
                if isinstance(ev, Delta):
                    deltas[i].append(ev)
                elif isinstance(ev, Failed):
                    raise APIError(ev.status, ev.message, code=ev.code)
                elif isinstance(ev, Finished):
                    ends[i] = ev
            if len(ends) != len(builders):
                raise APIError(500, "stream ended without a result")
            return deltas, [ends[i] for i in range(len(builders))]

        async def disconnected() -> None:
            while True:
                message = await request.receive()
                if message["type"] == "http.disconnect":
                    return

        work = asyncio.create_task(consume())
        watch = asyncio.create_task(disconnected())
        try:
            done, _ = await asyncio.wait({work, watch}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            watch.cancel()
            if not work.done():
                work.cancel()
                choices.abort()
        if work not in done:
            return Response(status_code=499)  # nobody is listening; the request was aborted
        deltas, ends = work.result()  # raises the APIError of a failed or refused choice
        return JSONResponse(merge_choices([b.full(d, f) for b, d, f in zip(builders, deltas, ends)], ends),
                            headers=headers)

    return app
