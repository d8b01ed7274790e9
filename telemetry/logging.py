"""Structured logs: one JSON object per line by default, console rendering on request.

    configure_logging(json=True, level="info")      # once, at process start
    log = structlog.get_logger("tandem.server")
    with bind_request(request_id, trace_id):
        log.info("request_admitted", num_prompt_tokens=12)
    # {"num_prompt_tokens": 12, "request_id": "...", "trace_id": "...", "event":
    #  "request_admitted", "level": "info", "logger": "tandem.server",
    #  "timestamp": "2025-01-01T00:00:00.000000Z"}

structlog loggers and stdlib loggers (libraries, Hypercorn, `warnings.warn`) go through
one stdlib handler and one renderer, so every line has the same shape. Values bound with
`bind_actor` / `bind_request` live in contextvars: an actor binds its name once at the top
of its task (or thread), a route binds the request id and trace id around its work, and
every line logged there carries them.

The rule for call sites: nothing is logged per token, and nothing per engine step at INFO
or above. Per-step detail goes to DEBUG (see `EngineStatsLog`, which also emits one INFO
summary per interval); per-request events (admitted, refused, disconnected, failed) are
fine at INFO. With the level above DEBUG a debug call costs one no-op method call.

Logger levels are fixed when a logger is first used (loggers are cached for speed), so
call `configure_logging` before the first log line.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import os
import sys
import time
from collections.abc import Callable, Iterator
from typing import Any, TextIO

import orjson
import structlog
from structlog.typing import Processor

_LEVELS = {
    "debug": logging.DEBUG,
    "info": logging.INFO,
    "warning": logging.WARNING,
    "error": logging.ERROR,
    "critical": logging.CRITICAL,
}


class _TandemHandler(logging.StreamHandler[TextIO]):
    """Marks the handler this module installed, so reconfiguring replaces only it."""


def configure_logging(
    json: bool = True,
    level: str = "info",
    stream: TextIO | None = None,
    process_name: str | None = None,
) -> None:
    """Route structlog and stdlib logging through one handler on the root logger.

    `json`: one JSON object per line (ISO UTC timestamp, level, event, logger, bound
    context); otherwise human-readable console lines. `level`: debug, info, warning, error
    or critical. `stream` defaults to stderr. `process_name` (e.g. 'api_server_1',
    'engine_core') tags every line with `process` and `pid`, so the lines of a server's
    processes can be told apart.
    """
    numeric_level = _LEVELS.get(level.strip().lower()) if isinstance(level, str) else None
    if numeric_level is None:
        raise ValueError(f"log level must be one of {', '.join(_LEVELS)}, got {level!r}")
    shared = _shared_processors()
    if process_name is not None:
        shared.append(_ProcessTag(process_name))
    structlog.configure(
        processors=[*shared, structlog.stdlib.ProcessorFormatter.wrap_for_formatter],
        logger_factory=structlog.stdlib.LoggerFactory(),
        wrapper_class=structlog.make_filtering_bound_logger(numeric_level),
        cache_logger_on_first_use=True,
    )
    renderer: list[Processor] = (
        [
            structlog.processors.format_exc_info,
            structlog.processors.JSONRenderer(serializer=_orjson_dumps),
        ]
        if json
        else [structlog.dev.ConsoleRenderer(colors=False)]
    )
    formatter = structlog.stdlib.ProcessorFormatter(
        foreign_pre_chain=[*shared, _strip_foreign_event],
        processors=[structlog.stdlib.ProcessorFormatter.remove_processors_meta, *renderer],
    )
    handler = _TandemHandler(sys.stderr if stream is None else stream)
    handler.setFormatter(formatter)
    root = logging.getLogger()
    for old in [h for h in root.handlers if isinstance(h, _TandemHandler)]:
        root.removeHandler(old)
    root.addHandler(handler)
    root.setLevel(numeric_level)
    logging.captureWarnings(True)


def _shared_processors() -> list[Processor]:
    return [
        structlog.contextvars.merge_contextvars,
        structlog.stdlib.add_log_level,
        structlog.stdlib.add_logger_name,
        structlog.processors.TimeStamper(fmt="iso", utc=True),
        structlog.processors.StackInfoRenderer(),
    ]


class _ProcessTag:
    def __init__(self, name: str) -> None:
        self._name = name
        self._pid = os.getpid()

    def __call__(self, logger: Any, method_name: str, event_dict: Any) -> Any:
        event_dict.setdefault("process", self._name)
        event_dict.setdefault("pid", self._pid)
        return event_dict


def _strip_foreign_event(logger: Any, method_name: str, event_dict: Any) -> Any:
    # warnings.formatwarning ends its message with a newline.
    event = event_dict.get("event")
    if isinstance(event, str):
        event_dict["event"] = event.rstrip()
    return event_dict


def _orjson_dumps(obj: Any, **kwargs: Any) -> str:
    return orjson.dumps(
        obj, default=kwargs.get("default", str), option=orjson.OPT_NON_STR_KEYS
    ).decode()


# ---- context binding -------------------------------------------------------------------


def bind_actor(name: str) -> None:
    """Tag every line logged from here on in this task or thread with `actor=name`.
    Call it at the top of an actor's task (or its thread's main function)."""
    structlog.contextvars.bind_contextvars(actor=name)


@contextlib.contextmanager
def bind_request(request_id: str, trace_id: str | None = None) -> Iterator[None]:
    """Tag the lines logged inside the block with the request id (and the trace id, when
    there is one); the previous values come back on exit."""
    if trace_id is None:
        with structlog.contextvars.bound_contextvars(request_id=request_id):
            yield
    else:
        with structlog.contextvars.bound_contextvars(request_id=request_id, trace_id=trace_id):
            yield


# ---- startup and per-step summaries ----------------------------------------------------


def log_startup(
    logger: Any,
    *,
    config: Any,
    device: str,
    runner: Any,
    num_kv_blocks: int,
    block_size: int,
    kv_cache_bytes: int,
) -> None:
    """One INFO line with what the server runs: the resolved config (a dataclass or a
    mapping), the device, the runner choice and why, and the KV cache size."""
    is_instance = dataclasses.is_dataclass(config) and not isinstance(config, type)
    config_fields = dataclasses.asdict(config) if is_instance else dict(config)
    logger.info(
        "engine_started",
        config=config_fields,
        device=device,
        runner=runner.runner,
        runner_reason=runner.reason,
        runner_rule=getattr(runner, "rule", None),
        kv_cache_blocks=num_kv_blocks,
        kv_cache_tokens=num_kv_blocks * block_size,
        kv_cache_bytes=kv_cache_bytes,
    )


def _is_debug_enabled(logger: Any) -> bool:
    # structlog's filtering loggers answer is_enabled_for; stdlib-style ones isEnabledFor.
    check = getattr(logger, "is_enabled_for", None) or getattr(logger, "isEnabledFor", None)
    return True if check is None else bool(check(logging.DEBUG))


class EngineStatsLog:
    """Per-step engine stats: every step at DEBUG, and one INFO `engine_throughput` summary
    per `interval_s` of wall time in which steps ran. A window opens at its first step and
    closes early when no step came for `interval_s`, so an idle engine logs nothing and
    idle time does not dilute the rates.

    Call `observe_step(stats)` once per finished step with the step's `StepStats`.
    """

    def __init__(
        self,
        logger: Any = None,
        interval_s: float = 10.0,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        if interval_s <= 0:
            raise ValueError(f"interval_s must be positive, got {interval_s}")
        self._log = logger if logger is not None else structlog.get_logger("tandem.engine")
        self._interval_s = interval_s
        self._clock = clock
        self._debug = _is_debug_enabled(self._log)
        self._window_start = 0.0
        self._last_step_time = 0.0
        self._reset_window()

    def observe_step(self, stats: Any) -> None:
        if self._debug:
            self._log.debug(
                "engine_step",
                step_id=stats.step_id,
                num_reqs=stats.num_reqs,
                num_tokens=stats.num_tokens,
                num_prefill_tokens=stats.num_prefill_tokens,
                step_time_s=stats.step_time_s,
                gpu_idle_s=stats.gpu_idle_s,
                schedule_time_s=stats.schedule_time_s,
            )
        now = self._clock()
        if self._num_steps and now - self._last_step_time >= self._interval_s:
            self._emit_summary(self._last_step_time)  # the engine went idle at that step
        if self._num_steps == 0:
            self._window_start = now
        self._last_step_time = now
        self._num_steps += 1
        self._num_prefill_tokens += stats.num_prefill_tokens
        self._num_decode_tokens += stats.num_tokens - stats.num_prefill_tokens
        self._step_time_s += stats.step_time_s
        self._gpu_idle_s += stats.gpu_idle_s
        if now - self._window_start >= self._interval_s:
            self._emit_summary(now)

    def _emit_summary(self, end_time: float) -> None:
        busy_s = self._step_time_s + self._gpu_idle_s
        elapsed_s = max(end_time - self._window_start, busy_s, 1e-9)
        self._log.info(
            "engine_throughput",
            num_steps=self._num_steps,
            prompt_tokens_per_s=round(self._num_prefill_tokens / elapsed_s, 1),
            decode_tokens_per_s=round(self._num_decode_tokens / elapsed_s, 1),
            mean_step_ms=round(1e3 * self._step_time_s / self._num_steps, 3),
            gpu_idle_fraction=round(self._gpu_idle_s / busy_s, 4) if busy_s else 0.0,
        )
        self._reset_window()

    def _reset_window(self) -> None:
        self._num_steps = 0
        self._num_prefill_tokens = 0
        self._num_decode_tokens = 0
        self._step_time_s = 0.0
        self._gpu_idle_s = 0.0
