"""Prometheus metrics for GET /metrics, with vLLM's names, meanings and buckets.

Gateways, autoscalers and dashboards hard-code vLLM's names (`vllm:num_requests_waiting`,
`vllm:kv_cache_usage_perc`, ...), so tandem exports the same ones with the label
`model_name` (and the older names vLLM still exports: telemetry/legacy_names.py), plus its
own under `tandem:`. Each server owns an `EngineMetrics` with a private CollectorRegistry,
never prometheus-client's global one.

Calls come per step or per finished request, never per token:

- `observe_step(stats)`: each finished engine step (StepStats), with its speculative
  decoding counts (telemetry/spec_decode_metrics.py);
- `set_engine_load(stats)`: the core's load and KV usage, at scrape time;
- `observe_engine_totals(stats)`: the core's cumulative counts, after each step;
- `observe_request_finished(record)`: once per finished engine request (RequestRecord);
- `set_runner(runner, reason, rule)`, `record_rejection(reason)`, `record_disconnect()`,
  `record_predecessor_aborts(num)`: rare events.
- `set_unsent(num)`: at scrape time, from the admission actor.
- `observe_loop_lag(lag_s)`: twenty times a second, from each API server's event loop
  (app/loop_lag.py).

What one engine core reports takes its `engine_index` (`--data-parallel-size N` runs N):
those series carry vLLM's `engine` label (telemetry/core_metrics.py).

Token counters move when a request finishes, so their sums equal the responses' usage:
`vllm:prompt_tokens_total` counts the prompts of requests that produced a first token
(their prefill completed, as in vLLM), `vllm:generation_tokens_total` every output token.
"""

from __future__ import annotations

import os
from collections.abc import Iterable
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge
from prometheus_client.multiprocess import MultiProcessCollector

from telemetry import exposition
from telemetry.core_metrics import (
    IDLE_FRACTION_WINDOW_STEPS,
    CoreFamilies,
    CoreSeries,
    EngineStatsLike,
)
from telemetry.histogram import BatchHistogram
from telemetry.legacy_names import with_legacy_names
from telemetry.metric_buckets import (
    CPU_TIME_BUCKETS_S,
    GPU_IDLE_BUCKETS_S,
    LOOP_LAG_BUCKETS_S,
    PER_TOKEN_BUCKETS_S,
    REQUEST_LATENCY_BUCKETS_S,
    STEP_DURATION_BUCKETS_S,
    TTFT_BUCKETS_S,
)
from telemetry.records import RequestRecord
from telemetry.request_shape_metrics import RequestShapeMetrics
from telemetry.spec_decode_metrics import SpecDecodeMetrics

__all__ = ["IDLE_FRACTION_WINDOW_STEPS", "EngineMetrics", "EngineStatsLike"]

MULTIPROC_DIR_ENV = "PROMETHEUS_MULTIPROC_DIR"


class EngineMetrics:
    def __init__(
        self, model_name: str, registry: CollectorRegistry | None = None, num_engines: int = 1
    ) -> None:
        """`num_engines`: the engine cores whose series exist from the start (at 0)."""
        if not model_name:
            raise ValueError("model_name must be a non-empty string")
        self.model_name = model_name
        self.registry = CollectorRegistry(auto_describe=True) if registry is None else registry
        self._core_families = CoreFamilies(self.registry)
        self._cores: dict[int, CoreSeries] = {}
        for engine_index in range(num_engines):
            self._core(engine_index)
        self._make_request_metrics()
        self._make_step_metrics()
        self._make_server_metrics()
        self.request_shape = RequestShapeMetrics(model_name, self.registry)
        """vLLM's request-shape families (token counts, n, max_tokens, cache config)."""
        self.spec_decode = SpecDecodeMetrics(model_name, self.registry)
        """vLLM's vllm:spec_decode_* counters (speculative steps only)."""

    # ---- construction -------------------------------------------------------------------

    def _gauge(self, name: str, documentation: str) -> Any:
        # With several API servers each one writes its own value; a scrape shows the most
        # recent write of a live process (the engine's load, read by whoever was scraped).
        return Gauge(
            name,
            documentation,
            ["model_name"],
            registry=self.registry,
            multiprocess_mode="livemostrecent",
        ).labels(model_name=self.model_name)

    def _counter(self, name: str, documentation: str) -> Any:
        return Counter(name, documentation, ["model_name"], registry=self.registry).labels(
            model_name=self.model_name
        )

    def _histogram(self, name: str, documentation: str, buckets: Iterable[float]) -> BatchHistogram:
        return BatchHistogram(
            name,
            documentation,
            tuple(buckets),
            {"model_name": self.model_name},
            registry=self.registry,
        )

    def _core(self, engine_index: int) -> CoreSeries:
        series = self._cores.get(engine_index)
        if series is None:
            series = CoreSeries(self._core_families, self.model_name, engine_index)
            self._cores[engine_index] = series
        return series

    def _make_request_metrics(self) -> None:
        self._ttft = self._histogram(
            "vllm:time_to_first_token_seconds",
            "Histogram of time to first token in seconds.",
            TTFT_BUCKETS_S,
        )
        self._itl = self._histogram(
            "vllm:inter_token_latency_seconds",
            "Histogram of inter-token latency in seconds.",
            PER_TOKEN_BUCKETS_S,
        )
        self._tpot = self._histogram(
            "vllm:request_time_per_output_token_seconds",
            "Histogram of time_per_output_token_seconds per request.",
            PER_TOKEN_BUCKETS_S,
        )
        phases = {
            "e2e": ("vllm:e2e_request_latency_seconds", "e2e request latency"),
            "queue": ("vllm:request_queue_time_seconds", "time spent in WAITING phase"),
            "prefill": ("vllm:request_prefill_time_seconds", "time spent in PREFILL phase"),
            "decode": ("vllm:request_decode_time_seconds", "time spent in DECODE phase"),
            "inference": ("vllm:request_inference_time_seconds", "time spent in RUNNING phase"),
        }
        self._phase = {
            key: self._histogram(
                name, f"Histogram of {what} for request in seconds.", REQUEST_LATENCY_BUCKETS_S
            )
            for key, (name, what) in phases.items()
        }

    def _make_step_metrics(self) -> None:
        self._step_duration = self._histogram(
            "tandem:engine_step_duration_seconds",
            "Device time of one engine step.",
            STEP_DURATION_BUCKETS_S,
        )
        self._gpu_idle = self._histogram(
            "tandem:gpu_idle_between_steps_seconds",
            "Device idle time between the end of one step and the start of the next.",
            GPU_IDLE_BUCKETS_S,
        )
        self._schedule_cpu = self._histogram(
            "tandem:scheduler_cpu_time_per_step_seconds",
            "CPU time the scheduler spent building one step.",
            CPU_TIME_BUCKETS_S,
        )
        self._prepare_cpu = self._histogram(
            "tandem:step_prepare_cpu_time_seconds",
            "CPU time from receiving a step to its last device launch.",
            CPU_TIME_BUCKETS_S,
        )

    def _make_server_metrics(self) -> None:
        self._runner_info = Gauge(
            "tandem:runner_info",
            "The model runner in use (1) and why it was chosen.",
            ["model_name", "runner", "reason", "rule"],
            registry=self.registry,
            multiprocess_mode="livemax",
        )
        self._rejections = Counter(
            "tandem:rejected_requests",
            "Requests refused at admission, by reason.",
            ["model_name", "reason"],
            registry=self.registry,
        )
        self._disconnects = self._counter(
            "tandem:client_disconnects", "Requests whose client went away before the end."
        )
        self._num_unsent = self._gauge(
            "tandem:num_requests_unsent",
            "Requests the engine has finished whose output the client has not yet taken.",
        )
        self._loop_lag = self._histogram(
            "tandem:api_server_event_loop_lag_seconds",
            "How late an API server's event loop woke for a timer that was due: the time "
            "its one thread spent on other work (requests, streams) that everything waited on.",
            LOOP_LAG_BUCKETS_S,
        )

    # ---- per step -----------------------------------------------------------------------

    def observe_step(self, stats: Any, engine_index: int = 0) -> None:
        """One finished engine step (actors.protocol.messages.StepStats). Steps that ran no tokens
        (a failed step) carry no timings and are skipped."""
        if stats.num_tokens <= 0:
            return
        self.request_shape.observe_step(stats.num_tokens)
        if getattr(stats, "spec", None) is not None:
            self.spec_decode.observe(stats.spec)
        self._step_duration.observe(stats.step_time_s)
        self._gpu_idle.observe(stats.gpu_idle_s)
        self._schedule_cpu.observe(stats.schedule_time_s)
        self._prepare_cpu.observe(stats.prepare_time_s)
        self._core(engine_index).observe_step_times(stats.step_time_s, stats.gpu_idle_s)

    def set_engine_load(self, stats: EngineStatsLike, engine_index: int = 0) -> None:
        """The engine core's current load and KV usage (read at scrape time)."""
        self._core(engine_index).set_load(stats)

    def observe_engine_totals(self, stats: EngineStatsLike, engine_index: int = 0) -> None:
        """The core's cumulative prefix-cache query and hit tokens and preemptions (after
        every step, by one front end only): the counters advance by the change."""
        self._core(engine_index).observe_totals(stats)

    # ---- per finished request -----------------------------------------------------------

    def observe_request_finished(self, record: RequestRecord, engine_index: int = 0) -> None:
        self._core(engine_index).count_finished(record)
        self.request_shape.observe_finished(record.num_prompt_tokens, record.num_output_tokens)
        self._phase["e2e"].observe(record.e2e_latency_s)
        optional = (
            (self._ttft, record.time_to_first_token_s),
            (self._phase["queue"], record.queue_time_s),
            (self._phase["prefill"], record.prefill_time_s),
            (self._phase["decode"], record.decode_time_s),
            (self._phase["inference"], record.inference_time_s),
            (self._tpot, record.time_per_output_token_s),
        )
        for histogram, value in optional:
            if value is not None:
                histogram.observe(value)
        if record.inter_token_latencies_s:
            self._itl.observe_many(record.inter_token_latencies_s)

    # ---- rare events --------------------------------------------------------------------

    def set_runner(self, runner: str, reason: str, rule: str = "") -> None:
        """The runner choice as an info-style gauge."""
        if not os.environ.get(MULTIPROC_DIR_ENV):  # a process's files cannot be cleared
            self._runner_info.clear()
        self._runner_info.labels(
            model_name=self.model_name, runner=runner, reason=reason, rule=rule
        ).set(1)

    def record_rejection(self, reason: str) -> None:
        """A request refused before it reached the engine. `reason` must come from a small
        fixed set (e.g. 'queue_full', 'draining', 'too_many_tokens'): it becomes a label."""
        self._rejections.labels(model_name=self.model_name, reason=reason).inc()

    def record_disconnect(self) -> None:
        self._disconnects.inc()

    def record_predecessor_aborts(self, num_requests: int, engine_index: int = 0) -> None:
        """Requests that a killed process of this front end left in the engine core, which
        aborted them when this process took its place. They count as aborted here: the
        process that admitted them never saw them end."""
        self._core(engine_index).count_aborted(num_requests)

    def set_unsent(self, num_requests: int) -> None:
        """Admitted requests done in the engine whose output is still being sent (a client
        that reads slowly or not at all); they hold no engine capacity."""
        self._num_unsent.set(num_requests)

    def observe_loop_lag(self, lag_s: float) -> None:
        """How late this API server's event loop ran a timer that was due."""
        self._loop_lag.observe(lag_s)

    # ---- exposition ---------------------------------------------------------------------

    def render(self, accept_header: str | None = None) -> tuple[bytes, str]:
        """(body, content type) for GET /metrics: Prometheus text format 0.0.4, or
        OpenMetrics when `accept_header` asks for it; names keep their colons either way."""
        registry = with_legacy_names(_exposition_registry(self.registry))
        return exposition.render(registry, accept_header)


def _exposition_registry(own: CollectorRegistry) -> CollectorRegistry:
    """This process's registry, or, in multiprocess mode (PROMETHEUS_MULTIPROC_DIR set by
    `tandem serve --api-server-count N` for its API servers), a registry that sums what
    every process of the server wrote."""
    directory = os.environ.get(MULTIPROC_DIR_ENV)
    if not directory:
        return own
    registry = CollectorRegistry()
    MultiProcessCollector(registry, path=directory)
    return registry
