from __future__ import annotations

import io
import json
import logging
import warnings
from collections.abc import Callable, Iterator
from datetime import datetime

import anyio
import pytest
import structlog

from actors.protocol.config import EngineConfig
from actors.protocol.messages import StepStats
from telemetry.logging import (
    EngineStatsLog,
    bind_actor,
    bind_request,
    configure_logging,
    log_startup,
)

Configure = Callable[..., io.StringIO]


@pytest.fixture
def configure() -> Iterator[Configure]:
    """configure_logging into a StringIO; the previous logging setup comes back afterwards."""
    root = logging.getLogger()
    saved_handlers, saved_level = list(root.handlers), root.level
    saved_config = structlog.get_config()

    def _configure(json: bool = True, level: str = "info") -> io.StringIO:
        stream = io.StringIO()
        configure_logging(json=json, level=level, stream=stream)
        return stream

    yield _configure
    structlog.configure(**saved_config)
    root.handlers[:] = saved_handlers
    root.setLevel(saved_level)
    logging.captureWarnings(False)
    structlog.contextvars.clear_contextvars()


def json_lines(stream: io.StringIO) -> list[dict[str, object]]:
    return [json.loads(line) for line in stream.getvalue().splitlines()]


def test_lines_are_json_objects_with_the_standard_keys(configure: Configure) -> None:
    stream = configure()
    structlog.get_logger("tandem.test").info("server_listening", port=8000)
    [line] = json_lines(stream)
    assert line["event"] == "server_listening" and line["port"] == 8000
    assert line["level"] == "info" and line["logger"] == "tandem.test"
    timestamp = datetime.fromisoformat(str(line["timestamp"]))
    offset = timestamp.utcoffset()
    assert offset is not None and offset.total_seconds() == 0


def test_request_and_trace_ids_are_bound_only_inside_the_block(configure: Configure) -> None:
    stream = configure()
    log = structlog.get_logger("tandem.test")
    with bind_request("req-1", "0af7651916cd43dd8448eb211c80319c"):
        log.info("request_admitted")
        with bind_request("req-2"):
            log.info("nested")
        log.info("back")
    log.info("after")
    lines = json_lines(stream)
    assert [(d["event"], d.get("request_id"), d.get("trace_id")) for d in lines] == [
        ("request_admitted", "req-1", "0af7651916cd43dd8448eb211c80319c"),
        ("nested", "req-2", "0af7651916cd43dd8448eb211c80319c"),
        ("back", "req-1", "0af7651916cd43dd8448eb211c80319c"),
        ("after", None, None),
    ]


async def test_concurrent_tasks_keep_their_own_actor_and_request(configure: Configure) -> None:
    stream = configure()
    log = structlog.get_logger("tandem.test")

    async def actor_task(actor: str, request_id: str) -> None:
        bind_actor(actor)
        with bind_request(request_id):
            for _ in range(3):
                log.info("handled")
                await anyio.lowlevel.checkpoint()

    async with anyio.create_task_group() as tg:
        tg.start_soon(actor_task, "scheduler", "a")
        tg.start_soon(actor_task, "sampler", "b")
    pairs = {(d["actor"], d["request_id"]) for d in json_lines(stream)}
    assert pairs == {("scheduler", "a"), ("sampler", "b")}
    assert len(json_lines(stream)) == 6


def test_stdlib_logs_and_python_warnings_render_as_json(configure: Configure) -> None:
    stream = configure()
    with bind_request("req-7"):
        logging.getLogger("some.library").warning("disk at %d%%", 91)
        with warnings.catch_warnings():
            warnings.simplefilter("always")
            warnings.warn("old option", DeprecationWarning, stacklevel=1)
    logging.getLogger("some.library").info("below nothing: info is on")
    logging.getLogger("some.library").debug("dropped at info")
    lines = json_lines(stream)
    assert lines[0]["event"] == "disk at 91%" and lines[0]["level"] == "warning"
    assert lines[0]["logger"] == "some.library" and lines[0]["request_id"] == "req-7"
    assert lines[1]["logger"] == "py.warnings" and lines[1]["level"] == "warning"
    assert "DeprecationWarning: old option" in str(lines[1]["event"])
    assert lines[2]["event"] == "below nothing: info is on"
    assert len(lines) == 3


def test_runner_selection_fallback_warning_is_a_json_line(configure: Configure) -> None:
    from gpu.platform import Platform
    from gpu.runner_selection import RunnerSelectionInput, select_runner

    stream = configure()
    cpu = Platform(
        device_type="cpu",
        device="cpu",
        device_name="cpu",
        compute_capability=None,
        total_memory_bytes=1 << 30,
        free_memory_bytes=1 << 30,
        has_triton=False,
        pin_memory_available=False,
        uva_available=False,
        is_wsl=False,
    )
    choice = select_runner(
        RunnerSelectionInput(architecture="llama", custom_logits_processors=("my.Proc",)), cpu
    )
    assert choice.runner == "v1"
    [line] = json_lines(stream)
    assert line["level"] == "warning" and line["logger"] == "gpu.runner_selection"
    assert choice.reason in str(line["event"])


def test_exceptions_are_rendered_inside_the_json_line(configure: Configure) -> None:
    stream = configure()
    try:
        raise RuntimeError("step exploded")
    except RuntimeError:
        structlog.get_logger("tandem.test").exception("step_failed")
        logging.getLogger("some.library").exception("library saw it too")
    lines = json_lines(stream)
    assert len(lines) == 2
    for line in lines:
        assert line["level"] == "error"
        assert "RuntimeError: step exploded" in str(line["exception"])


def test_console_rendering_is_not_json_but_keeps_the_context(configure: Configure) -> None:
    stream = configure(json=False)
    with bind_request("req-9"):
        structlog.get_logger("tandem.test").info("request_admitted")
    text = stream.getvalue()
    assert "request_admitted" in text and "request_id=req-9" in text
    with pytest.raises(json.JSONDecodeError):
        json.loads(text.splitlines()[0])


def test_bad_level_is_refused_with_the_choices() -> None:
    with pytest.raises(ValueError, match="log level must be one of"):
        configure_logging(level="loud")


def fake_steps(num_steps: int) -> Iterator[StepStats]:
    for step_id in range(num_steps):
        yield StepStats(
            step_id=step_id,
            num_reqs=8,
            num_tokens=10,
            num_prefill_tokens=2,
            schedule_time_s=1e-4,
            step_time_s=0.004,
            gpu_idle_s=0.001,
        )


def run_engine_loop(stats_log: EngineStatsLog, clock: list[float], num_steps: int) -> None:
    """A fake engine: each 5 ms step logs through the per-step helper, as the actors do."""
    for stats in fake_steps(num_steps):
        clock[0] += 0.005
        stats_log.observe_step(stats)


def test_engine_loop_logs_no_per_step_lines_at_info(configure: Configure) -> None:
    stream = configure(level="info")
    clock = [0.0]
    stats_log = EngineStatsLog(
        structlog.get_logger("tandem.engine"), interval_s=1.0, clock=lambda: clock[0]
    )
    run_engine_loop(stats_log, clock, num_steps=2000)  # 10 s of engine time
    lines = json_lines(stream)
    assert {line["event"] for line in lines} == {"engine_throughput"}
    assert 9 <= len(lines) <= 10  # one per elapsed second, not one per step
    summary = lines[0]
    # 200 steps per second, 2 prefill + 8 decode tokens each, 4 ms busy + 1 ms idle each.
    assert summary["prompt_tokens_per_s"] == pytest.approx(400, rel=0.01)
    assert summary["decode_tokens_per_s"] == pytest.approx(1600, rel=0.01)
    assert summary["mean_step_ms"] == pytest.approx(4.0)
    assert summary["gpu_idle_fraction"] == pytest.approx(0.2)


def test_engine_loop_logs_every_step_at_debug(configure: Configure) -> None:
    stream = configure(level="debug")
    clock = [0.0]
    stats_log = EngineStatsLog(
        structlog.get_logger("tandem.engine"), interval_s=1.0, clock=lambda: clock[0]
    )
    run_engine_loop(stats_log, clock, num_steps=300)
    step_lines = [d for d in json_lines(stream) if d["event"] == "engine_step"]
    assert [d["step_id"] for d in step_lines] == list(range(300))
    assert all(d["level"] == "debug" for d in step_lines)


def test_idle_time_neither_logs_nor_dilutes_the_rates(configure: Configure) -> None:
    stream = configure(level="info")
    clock = [0.0]
    stats_log = EngineStatsLog(
        structlog.get_logger("tandem.engine"), interval_s=1.0, clock=lambda: clock[0]
    )
    run_engine_loop(stats_log, clock, num_steps=100)  # half a second: no summary yet
    clock[0] += 60.0  # a quiet minute
    assert stream.getvalue() == ""
    run_engine_loop(stats_log, clock, num_steps=250)
    lines = json_lines(stream)
    # The window open before the pause is closed by the first step after it; the next one
    # opens at that step and closes a second later.
    assert [line["num_steps"] for line in lines] == [100, 201]
    for line in lines:
        assert line["decode_tokens_per_s"] == pytest.approx(1600, rel=0.02)


def test_startup_line_has_config_device_runner_and_kv_size(configure: Configure) -> None:
    from gpu.runner_selection import RunnerChoice

    stream = configure()
    log_startup(
        structlog.get_logger("tandem.startup"),
        config=EngineConfig(max_num_seqs=64),
        device="cpu",
        runner=RunnerChoice("v2", "no fallback rule applies", "default"),
        num_kv_blocks=100,
        block_size=16,
        kv_cache_bytes=100 * 16 * 9216,
    )
    [line] = json_lines(stream)
    assert line["event"] == "engine_started" and line["device"] == "cpu"
    assert line["config"]["max_num_seqs"] == 64  # type: ignore[index]
    assert (line["runner"], line["runner_rule"]) == ("v2", "default")
    assert line["runner_reason"] == "no fallback rule applies"
    assert (line["kv_cache_blocks"], line["kv_cache_tokens"]) == (100, 1600)
    assert line["kv_cache_bytes"] == 100 * 16 * 9216
