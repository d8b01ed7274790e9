"""The series each engine core has of its own, labelled `engine="i"` as vLLM labels them
(one core: engine="0"; `--data-parallel-size N`: one series per core, which Prometheus sums
with `sum without (engine)`).

- its load (vllm:num_requests_running, vllm:num_requests_waiting, vllm:kv_cache_usage_perc)
  and its cumulative prefix-cache and preemption counts, as the core reports them;
- the requests it finished and their tokens (vllm:request_success, vllm:prompt_tokens,
  vllm:generation_tokens);
- the share of its device time spent idle over its latest steps (tandem:gpu_idle_fraction);
- its prefix cache's offload tiers, labelled tier="cpu" or "disk" (tandem:kv_offload_*:
  tokens looked up and found, bytes saved and loaded, blocks held and their capacity).

The latency histograms and the step-time histograms stay one series for the whole server.
"""

from __future__ import annotations

from typing import Any, Protocol

from prometheus_client import CollectorRegistry, Counter, Gauge

from telemetry.records import FINISH_REASONS, RequestRecord

IDLE_FRACTION_WINDOW_STEPS = 256


class EngineStatsLike(Protocol):
    """What the engine gauges and totals read from actors.protocol.messages.SchedulerStats."""

    @property
    def num_running(self) -> int: ...
    @property
    def num_waiting(self) -> int: ...
    @property
    def kv_usage_perc(self) -> float: ...
    @property
    def prefix_cache_queries_tokens(self) -> int: ...
    @property
    def prefix_cache_hits_tokens(self) -> int: ...
    @property
    def num_preemptions_total(self) -> int: ...


class _CumulativeCounter:
    """A prometheus Counter fed with a monotonic total kept elsewhere (increments by the
    difference). A total that goes down means its source restarted from zero."""

    def __init__(self, counter: Any) -> None:
        self._counter = counter
        self._last_total = 0

    def update(self, total: int) -> None:
        delta = total - self._last_total if total >= self._last_total else total
        if delta:
            self._counter.inc(delta)
        self._last_total = total


class CoreFamilies:
    """The families with an `engine` label, registered once."""

    def __init__(self, registry: CollectorRegistry) -> None:
        labels = ["model_name", "engine"]

        def gauge(name: str, documentation: str) -> Gauge:
            # With several API servers each one writes its own value; a scrape shows the
            # most recent write of a live process (the core's load, read by whoever was
            # scraped).
            return Gauge(
                name, documentation, labels, registry=registry, multiprocess_mode="livemostrecent"
            )

        def counter(name: str, documentation: str, *extra: str) -> Counter:
            return Counter(name, documentation, [*labels, *extra], registry=registry)

        self.num_running = gauge(
            "vllm:num_requests_running", "Number of requests in model execution batches."
        )
        self.num_waiting = gauge(
            "vllm:num_requests_waiting", "Number of requests waiting to be processed."
        )
        self.kv_usage = gauge(
            "vllm:kv_cache_usage_perc", "KV-cache usage. 1 means 100 percent usage."
        )
        self.prefix_queries = counter(
            "vllm:prefix_cache_queries",
            "Prefix cache queries, in terms of number of queried tokens.",
        )
        self.prefix_hits = counter(
            "vllm:prefix_cache_hits", "Prefix cache hits, in terms of number of cached tokens."
        )
        self.preemptions = counter(
            "vllm:num_preemptions", "Cumulative number of preemptions from the engine."
        )
        self.prompt_tokens = counter("vllm:prompt_tokens", "Number of prefill tokens processed.")
        self.generation_tokens = counter(
            "vllm:generation_tokens", "Number of generation tokens processed."
        )
        self.request_success = counter(
            "vllm:request_success", "Count of successfully processed requests.", "finished_reason"
        )
        tier = ("tier",)
        self.tier_queries = counter(
            "tandem:kv_offload_queries",
            "Prefix cache tokens looked up in an offload tier (missed by the tiers before it).",
            *tier,
        )
        self.tier_hits = counter(
            "tandem:kv_offload_hits",
            "Prefix cache tokens found in an offload tier (copied back, not computed).",
            *tier,
        )
        self.tier_bytes = counter(
            "tandem:kv_offload_bytes",
            "Bytes copied into (direction=save) or out of (direction=load) an offload tier.",
            *tier,
            "direction",
        )
        self.tier_blocks = Gauge(
            "tandem:kv_offload_blocks",
            "KV blocks an offload tier holds.",
            [*labels, "tier"],
            registry=registry,
            multiprocess_mode="livemostrecent",
        )
        self.tier_capacity = Gauge(
            "tandem:kv_offload_capacity_blocks",
            "KV blocks an offload tier can hold.",
            [*labels, "tier"],
            registry=registry,
            multiprocess_mode="livemostrecent",
        )
        self.idle_fraction = gauge(
            "tandem:gpu_idle_fraction",
            f"Share of device time spent idle between steps over "
            f"the last {IDLE_FRACTION_WINDOW_STEPS} steps.",
        )


class CoreSeries:
    """One engine core's series of CoreFamilies, and what its counters and idle fraction
    remember between calls."""

    def __init__(self, families: CoreFamilies, model_name: str, engine_index: int) -> None:
        self._model_name = model_name
        self._engine = str(engine_index)
        labels = {"model_name": model_name, "engine": self._engine}
        self._families = families
        self._num_running = families.num_running.labels(**labels)
        self._num_waiting = families.num_waiting.labels(**labels)
        self._kv_usage = families.kv_usage.labels(**labels)
        self._prefix_queries = _CumulativeCounter(families.prefix_queries.labels(**labels))
        self._prefix_hits = _CumulativeCounter(families.prefix_hits.labels(**labels))
        self._preemptions = _CumulativeCounter(families.preemptions.labels(**labels))
        self._prompt_tokens = families.prompt_tokens.labels(**labels)
        self._generation_tokens = families.generation_tokens.labels(**labels)
        self._idle_fraction = families.idle_fraction.labels(**labels)
        for reason in FINISH_REASONS:  # present at 0 from the start, as in vLLM
            self._success(reason)
        self._tiers: dict[str, _TierSeries] = {}
        self._recent_idle_s = [0.0] * IDLE_FRACTION_WINDOW_STEPS
        self._recent_step_s = [0.0] * IDLE_FRACTION_WINDOW_STEPS
        self._num_steps = 0

    def _success(self, reason: str) -> Any:
        return self._families.request_success.labels(
            model_name=self._model_name, engine=self._engine, finished_reason=reason
        )

    def set_load(self, stats: EngineStatsLike) -> None:
        self._num_running.set(stats.num_running)
        self._num_waiting.set(stats.num_waiting)
        self._kv_usage.set(stats.kv_usage_perc)

    def observe_totals(self, stats: EngineStatsLike) -> None:
        self._prefix_queries.update(stats.prefix_cache_queries_tokens)
        self._prefix_hits.update(stats.prefix_cache_hits_tokens)
        self._preemptions.update(stats.num_preemptions_total)
        for tier in getattr(stats, "kv_tiers", ()):
            series = self._tiers.get(tier.tier)
            if series is None:
                labels = {"model_name": self._model_name, "engine": self._engine}
                series = self._tiers[tier.tier] = _TierSeries(self._families, labels, tier.tier)
            series.observe(tier)

    def observe_step_times(self, step_time_s: float, gpu_idle_s: float) -> None:
        slot = self._num_steps % IDLE_FRACTION_WINDOW_STEPS
        self._recent_idle_s[slot] = gpu_idle_s
        self._recent_step_s[slot] = step_time_s
        self._num_steps += 1
        idle_s = sum(self._recent_idle_s)
        busy_s = idle_s + sum(self._recent_step_s)
        self._idle_fraction.set(idle_s / busy_s if busy_s > 0 else 0.0)

    def count_finished(self, record: RequestRecord) -> None:
        self._success(record.finish_reason).inc()
        if record.first_token_time is not None:
            self._prompt_tokens.inc(record.num_prompt_tokens)
        self._generation_tokens.inc(record.num_output_tokens)

    def count_aborted(self, num_requests: int) -> None:
        self._success("abort").inc(num_requests)


class _TierSeries:
    """One offload tier's series (actors.protocol.messages.KVTierStats)."""

    def __init__(self, families: CoreFamilies, labels: dict[str, str], tier: str) -> None:
        labels = {**labels, "tier": tier}
        self._queries = _CumulativeCounter(families.tier_queries.labels(**labels))
        self._hits = _CumulativeCounter(families.tier_hits.labels(**labels))
        self._saved = _CumulativeCounter(families.tier_bytes.labels(**labels, direction="save"))
        self._loaded = _CumulativeCounter(families.tier_bytes.labels(**labels, direction="load"))
        self._blocks = families.tier_blocks.labels(**labels)
        self._capacity = families.tier_capacity.labels(**labels)

    def observe(self, tier: Any) -> None:
        self._queries.update(tier.queries_tokens)
        self._hits.update(tier.hits_tokens)
        self._saved.update(tier.saved_bytes)
        self._loaded.update(tier.loaded_bytes)
        self._blocks.set(tier.num_blocks)
        self._capacity.set(tier.num_capacity_blocks)
