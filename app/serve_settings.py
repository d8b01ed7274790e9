"""`tandem serve`'s settings: what the flags and TANDEM_* variables configure."""

from __future__ import annotations

import os
from dataclasses import dataclass

from actors.protocol.config import EngineConfig

EMBEDDED_MODEL_NAME = "SmolLM2-135M-Instruct"


@dataclass(frozen=True, slots=True)
class ServeSettings:
    engine: EngineConfig
    host: str = "127.0.0.1"
    port: int = 8000
    served_model_names: tuple[str, ...] = ()
    """Names clients may send as `model`; the first is listed in /v1/models. Empty: derived
    from the model."""
    api_key: str | None = None
    max_queued_requests: int = 1024
    max_queued_prompt_tokens: int | None = None
    max_request_body_bytes: int = 16 * 1024 * 1024
    keep_alive_interval_s: float = 10.0
    shutdown_timeout_s: float = 5.0
    """On SIGTERM, how long in-flight requests may finish (app/server.py drain_bound_s)."""
    clamp_max_tokens: bool = False
    max_n: int = 16
    retry_after_s: int = 1
    access_log: bool = False
    max_consecutive_failed_steps: int = 5
    """This many failed engine steps in a row mark the engine dead: /health 503."""
    engine_stall_timeout_s: float = 10.0
    """An engine-core process silent this long (no heartbeat from its event loop) is
    reported stalled: /health 503 'stalled', new requests 503, until it answers again;
    silent twice this long, the requests in flight are failed (503). 0: never
    (app/engine_watchdog.py)."""
    keep_alive_timeout_s: float = 65.0
    """An idle connection (no request yet, or between requests) is closed after this; a
    request's headers must arrive within it."""
    request_body_timeout_s: float = 60.0
    """A request body that has not fully arrived this long after its headers gets 408."""
    send_timeout_s: float = 60.0
    """A response the client stops taking (a 64 KiB piece not taken within this long) has
    its connection aborted and its buffered output dropped (0: no limit)."""
    priority_scheduling: bool = False
    """Accept a request's `priority` (otherwise a non-zero priority gets 400)."""
    tool_call_parser: str = "auto"
    """How tool calls are read out of model text: hermes, llama3_json, none, or auto (from
    the chat template)."""
    reasoning_parser: str = "none"
    """How a chat completion's reasoning is read out of its text: qwen3 or deepseek_r1
    (`<think>` blocks, app/reasoning/); none or openai_gptoss leave it to the model's format
    (harmony models have theirs read anyway)."""
    grammar_compile_timeout_s: float = 10.0
    """The most a new structured output spec may take to compile (in a checker process)."""
    api_server_count: int = 1
    """Front-end processes sharing the listening socket, in front of one engine core."""
    api_server_stall_timeout_s: float = 30.0
    """With several API servers, one silent this long (no heartbeat from its event loop:
    stopped or blocked) is killed and restarted by the supervisor. 0: never
    (app/heartbeat_pipe.py)."""
    log_format: str = "json"
    log_level: str = "info"

    def model_names(self) -> tuple[str, ...]:
        if self.served_model_names:
            return self.served_model_names
        return default_model_names(self.engine.model)


def default_model_names(model: str) -> tuple[str, ...]:
    """A path is served under its base name (never the full path, which would leak in
    /v1/models), with the original string as an alias."""
    if model == "default":
        return (EMBEDDED_MODEL_NAME, "default")
    base = os.path.basename(os.path.normpath(model))
    base = base.removesuffix(".gguf") if base.endswith(".gguf") else base
    return (base, model) if base != model else (model,)
