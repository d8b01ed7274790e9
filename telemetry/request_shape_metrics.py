"""vLLM's request-shape metrics: token counts per request and per step, the n and
max_tokens parameters, and the KV cache configuration, with vLLM's names, meanings and
buckets (vllm/v1/metrics/loggers.py), so its dashboards find them.

    vllm:request_prompt_tokens              per finished engine request: prompt tokens
    vllm:request_generation_tokens          per finished engine request: output tokens
    vllm:request_params_max_tokens          per finished engine request: its max_tokens
    vllm:request_params_n                   per API request: n
    vllm:request_max_num_generation_tokens  per API request: the most output tokens of its
                                            samples (as vLLM records it for n > 1 parents)
    vllm:iteration_tokens_total             per engine step: tokens the step ran
    vllm:cache_config_info                  1, labelled with the KV cache configuration

The token histograms' buckets (1, 2, 5, 10, 20, 50, ... up to the context length) need the
context length, so they appear once `configure` has been called at engine start.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping

from prometheus_client import CollectorRegistry, Gauge

from telemetry.histogram import BatchHistogram

ITERATION_TOKENS_BUCKETS = (1, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384)
N_BUCKETS = (1, 2, 5, 10, 20)


def build_1_2_5_buckets(max_value: int) -> list[int]:
    """1, 2, 5, 10, 20, 50, ... up to `max_value` (vLLM's token-count buckets)."""
    buckets: list[int] = []
    scale = 1
    while True:
        for mantissa in (1, 2, 5):
            if mantissa * scale > max_value:
                return buckets
            buckets.append(mantissa * scale)
        scale *= 10


class RequestShapeMetrics:
    def __init__(self, model_name: str, registry: CollectorRegistry) -> None:
        self._labels = {"model_name": model_name}
        self._registry = registry
        self._iteration_tokens = self._histogram(
            "vllm:iteration_tokens_total",
            "Histogram of number of tokens per engine_step.",
            ITERATION_TOKENS_BUCKETS,
        )
        self._n = self._histogram(
            "vllm:request_params_n", "Histogram of the n request parameter.", N_BUCKETS
        )
        self._token_histograms: dict[str, BatchHistogram] = {}

    def _histogram(self, name: str, documentation: str, buckets: Iterable[float]) -> BatchHistogram:
        return BatchHistogram(
            name, documentation, tuple(buckets), self._labels, registry=self._registry
        )

    def configure(self, max_model_len: int, cache_config: Mapping[str, object]) -> None:
        """At engine start: the context length (token buckets) and the KV cache config."""
        if self._token_histograms:
            return
        buckets = build_1_2_5_buckets(max_model_len)
        documented = {
            "prompt": ("vllm:request_prompt_tokens", "Number of prefill tokens processed."),
            "generation": (
                "vllm:request_generation_tokens",
                "Number of generation tokens processed.",
            ),
            "max_tokens": (
                "vllm:request_params_max_tokens",
                "Histogram of the max_tokens request parameter.",
            ),
            "max_generation": (
                "vllm:request_max_num_generation_tokens",
                "Histogram of maximum number of requested generation tokens.",
            ),
        }
        self._token_histograms = {
            key: self._histogram(name, doc, buckets) for key, (name, doc) in documented.items()
        }
        info = Gauge(
            "vllm:cache_config_info",
            "Information of the LLMEngine CacheConfig",
            sorted(cache_config),
            registry=self._registry,
        )
        info.labels(**{k: str(v) for k, v in cache_config.items()}).set(1)

    def observe_step(self, num_tokens: int) -> None:
        self._iteration_tokens.observe(num_tokens)

    def observe_finished(self, num_prompt_tokens: int, num_output_tokens: int) -> None:
        """One finished engine request."""
        if self._token_histograms:
            self._token_histograms["prompt"].observe(num_prompt_tokens)
            self._token_histograms["generation"].observe(num_output_tokens)

    def observe_api_request(
        self, n: int, max_tokens: int | None, num_output_tokens: Iterable[int]
    ) -> None:
        """One finished API request with `n` samples of at most `max_tokens` each."""
        self._n.observe(n)
        if not self._token_histograms:
            return
        outputs = list(num_output_tokens)
        if max_tokens is not None:
            self._token_histograms["max_tokens"].observe_many([max_tokens] * len(outputs))
        if outputs:
            self._token_histograms["max_generation"].observe(max(outputs))
