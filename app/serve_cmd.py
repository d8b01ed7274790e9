"""`tandem serve`: the OpenAI-compatible HTTP server.

Every flag has a TANDEM_<NAME> environment equivalent (--max-queued-requests and
TANDEM_MAX_QUEUED_REQUESTS); a flag on the command line wins over the environment.
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Callable
from typing import Any

from app.engine_args import add_engine_args, engine_config_from_args
from app.reasoning.parsers import REASONING_PARSERS

_LOG_LEVELS = ("debug", "info", "warning", "error")


def _env(name: str, default: Any, convert: Callable[[str], Any] = str) -> Any:
    value = os.environ.get("TANDEM_" + name.upper())
    if value is None or value == "":
        return default
    try:
        return convert(value)
    except ValueError:
        sys.exit(
            f"tandem: error: environment variable TANDEM_{name.upper()}={value!r} is not "
            f"a valid {getattr(convert, '__name__', 'value')}"
        )


def _env_flag(name: str) -> bool:
    return str(_env(name, "")).strip().lower() in ("1", "true", "yes", "on")


def add_parser(sub: Any) -> None:
    p = sub.add_parser(
        "serve",
        help="run the OpenAI-compatible HTTP server",
        description="Serve the model over an OpenAI-compatible HTTP API (/v1/chat/completions, "
        "/v1/completions, /v1/models, /health, /version, /tokenize, /detokenize, "
        "/metrics), over HTTP/1.1 only (HTTP/2 and TLS belong in a load balancer in "
        "front). The port opens at once; /health answers 503 until the model is "
        "loaded. Every flag can also be set as TANDEM_<FLAG> (e.g. "
        "TANDEM_PORT=8080). Traces go to OTLP when OTEL_EXPORTER_OTLP_ENDPOINT (or "
        "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT) is set; OTEL_SDK_DISABLED=true turns "
        "them off.",
    )
    server = p.add_argument_group("server")
    _add_listener_args(server)
    _add_connection_timeout_args(server)
    _add_admission_args(p.add_argument_group("admission"))
    _add_api_args(p.add_argument_group("api"))
    _add_logging_args(p.add_argument_group("logging"))
    _add_process_args(p.add_argument_group("processes"))
    add_engine_args(p)
    p.set_defaults(run=run)


def _add_listener_args(net: Any) -> None:
    """Where the server listens, under which model names, for whom, and how large a body."""
    net.add_argument(
        "--host",
        default=_env("host", "127.0.0.1"),
        help="address to listen on (default 127.0.0.1; 0.0.0.0 for all). Env: TANDEM_HOST",
    )
    net.add_argument(
        "--port",
        type=int,
        default=_env("port", 8000, int),
        help="TCP port (default 8000; 0 picks a free one). Env: TANDEM_PORT",
    )
    net.add_argument(
        "--served-model-name",
        nargs="+",
        metavar="NAME",
        default=_env("served_model_name", None, _split_names),
        help="names clients send as 'model'; the first is listed in /v1/models "
        "(default: the model's name). Env: TANDEM_SERVED_MODEL_NAME "
        "(comma-separated)",
    )
    net.add_argument(
        "--api-key",
        default=_env("api_key", None),
        help="require 'Authorization: Bearer KEY' on /v1/*, /tokenize and "
        "/detokenize (/health, /version and /metrics stay open). "
        "Env: TANDEM_API_KEY",
    )
    net.add_argument(
        "--max-request-body-bytes",
        type=int,
        default=_env("max_request_body_bytes", 16 * 1024 * 1024, int),
        help="larger request bodies get 413 (default 16 MiB). Env: TANDEM_MAX_REQUEST_BODY_BYTES",
    )


def _add_connection_timeout_args(net: Any) -> None:
    """How long connections, bodies, responses and shutdown may take."""
    net.add_argument(
        "--keep-alive-interval",
        type=float,
        default=_env("keep_alive_interval", 10.0, float),
        help="seconds between ': keep-alive' SSE comments while a stream waits "
        "(queued, long prefill); 0 disables (default 10). "
        "Env: TANDEM_KEEP_ALIVE_INTERVAL",
    )
    net.add_argument(
        "--keep-alive-timeout",
        type=float,
        default=_env("keep_alive_timeout", 65.0, float),
        help="seconds an idle connection stays open (before its first request's "
        "headers are complete, and between requests); keep it above the load "
        "balancer's idle timeout (default 65). Env: TANDEM_KEEP_ALIVE_TIMEOUT",
    )
    net.add_argument(
        "--request-body-timeout",
        type=float,
        default=_env("request_body_timeout", 60.0, float),
        help="a request body that has not fully arrived this many seconds after its "
        "headers gets 408 (default 60). Env: TANDEM_REQUEST_BODY_TIMEOUT",
    )
    net.add_argument(
        "--send-timeout",
        type=float,
        default=_env("send_timeout", 60.0, float),
        help="a response the client stops taking (a 64 KiB piece not taken within "
        "this many seconds) has its connection aborted and its buffered output "
        "dropped; 0 disables (default 60). Env: TANDEM_SEND_TIMEOUT",
    )
    net.add_argument(
        "--shutdown-timeout",
        type=float,
        default=_env("shutdown_timeout", 5.0, float),
        help="on SIGTERM, seconds in-flight requests may finish before they are "
        "aborted; the server has closed every connection at most 4 s later, so the "
        "default (5) fits the 10 s docker and podman give a container to stop. "
        "Env: TANDEM_SHUTDOWN_TIMEOUT",
    )


def _add_admission_args(adm: Any) -> None:
    """Which requests are taken and queued, and when the engine counts as unable to serve."""
    adm.add_argument(
        "--max-queued-requests",
        type=int,
        default=_env("max_queued_requests", 1024, int),
        help="requests that may wait beyond --max-num-seqs running ones; more get "
        "429 + Retry-After (default 1024). Env: TANDEM_MAX_QUEUED_REQUESTS",
    )
    adm.add_argument(
        "--max-queued-prompt-tokens",
        type=int,
        default=_env("max_queued_prompt_tokens", None, int),
        help="prompt tokens that may wait for prefill; more get 429 (default: no "
        "limit). Env: TANDEM_MAX_QUEUED_PROMPT_TOKENS",
    )
    adm.add_argument(
        "--max-n",
        type=int,
        default=_env("max_n", 16, int),
        help="largest n (samples per request) accepted (default 16). Env: TANDEM_MAX_N",
    )
    adm.add_argument(
        "--scheduling-policy",
        choices=("fcfs", "priority"),
        default=_env("scheduling_policy", "fcfs"),
        help="fcfs (default): first come, first served, and a request's 'priority' "
        "must be unset or 0; priority: requests run by their 'priority' "
        "(lower first, a 32-bit signed integer), then by arrival. "
        "Env: TANDEM_SCHEDULING_POLICY",
    )
    adm.add_argument(
        "--max-consecutive-failed-steps",
        type=int,
        default=_env("max_consecutive_failed_steps", 5, int),
        help="this many failed engine steps in a row mark the engine dead: /health "
        "answers 503 and new requests are refused (default 5). "
        "Env: TANDEM_MAX_CONSECUTIVE_FAILED_STEPS",
    )
    adm.add_argument(
        "--engine-stall-timeout",
        type=float,
        default=_env("engine_stall_timeout", 10.0, float),
        help="seconds the engine core may stay silent before it is reported "
        "stalled: /health answers 503 'stalled' and new requests get 503 + "
        "Retry-After, until it answers again. Silent for twice this, every "
        "request in flight ends with an error saying the engine stopped "
        "responding (503 + Retry-After, or an error event in a stream) and is "
        "aborted in the core, which frees what it held if it resumes. The core "
        "sends a heartbeat every 0.5 s from its event loop while its steps run "
        "on their own threads, so however long a step takes (a long prefill on "
        "a CPU) it does not count; an idle server is never stalled. At least 1, "
        "or 0 to disable (default 10). Env: TANDEM_ENGINE_STALL_TIMEOUT",
    )
    adm.add_argument(
        "--clamp-max-tokens",
        action="store_true",
        default=_env_flag("clamp_max_tokens"),
        help="shorten max_tokens to fit the context instead of answering 400. "
        "Env: TANDEM_CLAMP_MAX_TOKENS=1",
    )


def _add_api_args(api: Any) -> None:
    """How the OpenAI API's tool calls and structured outputs are handled."""
    api.add_argument(
        "--tool-call-parser",
        choices=("auto", "hermes", "llama3_json", "none"),
        default=_env("tool_call_parser", "auto"),
        help="how tool calls are read out of the model's text for tool_choice "
        "'auto': hermes (<tool_call>{...}</tool_call>, Hermes and Qwen), "
        "llama3_json (Llama 3.x JSON calls), none, or auto (default: from the "
        "chat template). Env: TANDEM_TOOL_CALL_PARSER",
    )
    api.add_argument(
        "--enable-auto-tool-choice",
        action="store_true",
        default=_env_flag("enable_auto_tool_choice"),
        help="vLLM's; a no-op (tool_choice 'auto' is always served). "
        "Env: TANDEM_ENABLE_AUTO_TOOL_CHOICE=1",
    )
    api.add_argument(
        "--reasoning-parser",
        choices=REASONING_PARSERS,
        default=_env("reasoning_parser", "none"),
        help="read chat reasoning out of the text into reasoning (and reasoning_content): qwen3 "
        "(<think>...</think>, opened by the completion or left open by the prompt), "
        "deepseek_r1 (reasoning from the start to </think>), openai_gptoss (gpt-oss only, "
        "read so anyway) or none (default). Output constraints (response_format, "
        "tool_choice required or named) bind the completion from its first token: the "
        "model cannot open a think block and answers without thinking. "
        "Env: TANDEM_REASONING_PARSER",
    )
    api.add_argument(
        "--grammar-compile-timeout",
        type=float,
        default=_env("grammar_compile_timeout", 10.0, float),
        help="seconds a new structured output spec (JSON schema, regex, grammar, "
        "choice) may take to compile; a longer one is refused with 400. Each "
        "new spec is compiled first in a checker process of its own, so a "
        "spec that would hang or crash the compiler harms no other request "
        "(default 10). Env: TANDEM_GRAMMAR_COMPILE_TIMEOUT",
    )


def _add_logging_args(log: Any) -> None:
    """The log's level and format (on stderr), and whether every HTTP request is logged."""
    log.add_argument(
        "--log-level",
        choices=_LOG_LEVELS,
        default=_env("log_level", "info"),
        help="default info. Env: TANDEM_LOG_LEVEL",
    )
    log.add_argument(
        "--log-format",
        choices=("json", "console"),
        default=_env("log_format", "json"),
        help="json lines (default) or human-readable console lines, on stderr. "
        "Env: TANDEM_LOG_FORMAT",
    )
    log.add_argument(
        "--access-log",
        action="store_true",
        default=_env_flag("access_log"),
        help="log every HTTP request (Hypercorn access log). Env: TANDEM_ACCESS_LOG=1",
    )


def _add_process_args(proc: Any) -> None:
    """How many API server processes and engine cores run, and how they are watched."""
    proc.add_argument(
        "--api-server-count",
        type=int,
        default=_env("api_server_count", 1, int),
        help="front-end processes (HTTP, tokenization, detokenization, SSE) sharing "
        "the listening socket in front of the engine-core process(es); more "
        "of them keep up with more streams. /metrics from any of them covers "
        "the whole server (default 1). Env: TANDEM_API_SERVER_COUNT",
    )
    proc.add_argument(
        "--data-parallel-size",
        "-dp",
        type=int,
        default=_env("data_parallel_size", 1, int),
        help="engine cores, each a whole copy of the model on a device of its own (core i "
        "on cuda:i, choose the GPUs with CUDA_VISIBLE_DEVICES; all on the CPU with "
        "--device cpu), behind every API server. Each request goes to the core whose load "
        "(running plus waiting requests) is least once each core is credited one request "
        "per 64 tokens of the prompt it was sent before beyond what every core was (a "
        "conversation's earlier turns, which its prefix cache holds), at most 2 + a quarter "
        "of the least loaded core's requests. The limits of --max-num-seqs and "
        '--num-kv-blocks are per core. /metrics labels each core\'s series engine="i"; a '
        "core that dies marks the server dead. Not with --tensor-parallel-size or "
        "--pipeline-parallel-size above 1 yet (default 1). "
        "Env: TANDEM_DATA_PARALLEL_SIZE",
    )
    proc.add_argument(
        "--api-server-stall-timeout",
        type=float,
        default=_env("api_server_stall_timeout", 30.0, float),
        help="with --api-server-count > 1: seconds an API server may stay silent "
        "(it sends the supervisor a heartbeat every 0.5 s from its event loop; "
        "stopped or blocked, it falls silent) before the supervisor logs "
        "api_server_unresponsive, kills it and starts another in its place. "
        "At least 1, or 0 to disable (default 30). "
        "Env: TANDEM_API_SERVER_STALL_TIMEOUT",
    )


def _split_names(value: str) -> list[str]:
    return [name.strip() for name in value.split(",") if name.strip()]


def settings_from_args(args: argparse.Namespace) -> Any:
    from app.serve_settings import ServeSettings

    return ServeSettings(
        engine=engine_config_from_args(args).replace(data_parallel_size=args.data_parallel_size),
        host=args.host,
        port=args.port,
        served_model_names=tuple(args.served_model_name or ()),
        api_key=args.api_key or None,
        max_queued_requests=args.max_queued_requests,
        max_queued_prompt_tokens=args.max_queued_prompt_tokens,
        max_request_body_bytes=args.max_request_body_bytes,
        keep_alive_interval_s=args.keep_alive_interval,
        shutdown_timeout_s=args.shutdown_timeout,
        clamp_max_tokens=args.clamp_max_tokens,
        max_n=args.max_n,
        access_log=args.access_log,
        max_consecutive_failed_steps=args.max_consecutive_failed_steps,
        engine_stall_timeout_s=args.engine_stall_timeout,
        keep_alive_timeout_s=args.keep_alive_timeout,
        request_body_timeout_s=args.request_body_timeout,
        send_timeout_s=args.send_timeout,
        priority_scheduling=args.scheduling_policy == "priority",
        api_server_count=args.api_server_count,
        api_server_stall_timeout_s=args.api_server_stall_timeout,
        log_format=args.log_format,
        log_level=args.log_level,
        tool_call_parser=args.tool_call_parser,
        reasoning_parser=args.reasoning_parser,
        grammar_compile_timeout_s=args.grammar_compile_timeout,
    )


def run(args: argparse.Namespace) -> int:
    from actors.protocol import event_loop
    from app.cli_errors import UserFacingError, flag_errors
    from app.serve_checks import check_serve_args
    from app.server import ServerStartError, TandemServer
    from telemetry.logging import configure_logging
    from telemetry.tracing import TracingConfigError

    check_serve_args(args)
    bound_frontend_threads()
    # Before anything logs: structlog fixes a logger's level when it is first used.
    configure_logging(
        json=args.log_format == "json",
        level=args.log_level,
        process_name="api_server_0" if args.api_server_count == 1 else "supervisor",
    )
    try:
        settings = settings_from_args(args)
    except flag_errors() as exc:
        raise UserFacingError(str(exc)) from None
    if args.api_server_count > 1:
        return _supervise(settings)
    try:
        server = TandemServer(settings)
    except (ServerStartError, TracingConfigError) as exc:
        raise UserFacingError(str(exc)) from None
    exit_code: int = event_loop.run(server.serve)
    if server.state.failure_message is not None:
        raise UserFacingError(server.state.failure_message)
    return exit_code


def bound_frontend_threads(environ: Any = os.environ) -> None:
    """Keep the tokenizers' (Rust) thread pools to one thread in this process and the ones
    it starts, unless the user chose otherwise: API servers tokenize one request at a time,
    and the CPUs belong to the engine core's torch threads."""
    environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    environ.setdefault("RAYON_NUM_THREADS", "1")


def _supervise(settings: Any) -> int:
    from app.cli_errors import UserFacingError
    from app.server import ServerStartError
    from app.supervisor import Supervisor

    try:
        supervisor = Supervisor(settings)
    except ServerStartError as exc:
        raise UserFacingError(str(exc)) from None
    return supervisor.run()
