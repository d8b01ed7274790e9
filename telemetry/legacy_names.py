"""vLLM's older names for two series, which vLLM still exports beside the new ones and which
dashboards, gateways and autoscalers written against older vLLM still query:

    vllm:gpu_cache_usage_perc           the same gauge as vllm:kv_cache_usage_perc (0 to 1)
    vllm:time_per_output_token_seconds  the same histogram as vllm:inter_token_latency_seconds
                                        (vLLM's name for it before the rename; same buckets)

Each old family is a copy of the new one made when /metrics is scraped, so nothing is
observed twice. In multiprocess mode the copy is made of the families summed over every
API server, so the two names always agree.
"""

from __future__ import annotations

from collections.abc import Iterable

from prometheus_client import CollectorRegistry
from prometheus_client.metrics_core import Metric
from prometheus_client.registry import Collector

LEGACY_NAMES = {
    "vllm:kv_cache_usage_perc": (
        "vllm:gpu_cache_usage_perc",
        "GPU KV-cache usage. 1 means 100 percent usage. "
        "DEPRECATED: Use vllm:kv_cache_usage_perc instead.",
    ),
    "vllm:inter_token_latency_seconds": (
        "vllm:time_per_output_token_seconds",
        "Histogram of time per output token in seconds. "
        "DEPRECATED: Use vllm:inter_token_latency_seconds instead.",
    ),
}
"""Current family name -> (old name, vLLM's help text for the old name)."""


def with_legacy_names(source: CollectorRegistry) -> CollectorRegistry:
    """A registry that collects every family of `source` and, after each family that has an
    old name, its copy under that name."""
    registry = CollectorRegistry(auto_describe=False)
    registry.register(_LegacyNameCopies(source))
    return registry


class _LegacyNameCopies(Collector):
    def __init__(self, source: CollectorRegistry) -> None:
        self._source = source

    def collect(self) -> Iterable[Metric]:
        for family in self._source.collect():
            yield family
            legacy = LEGACY_NAMES.get(family.name)
            if legacy is not None:
                yield _renamed(family, *legacy)


def _renamed(family: Metric, name: str, documentation: str) -> Metric:
    copy = Metric(name, documentation, family.type, family.unit)
    # A sample's name is the family's plus a suffix (_bucket, _sum, _count, _created).
    copy.samples = [
        sample._replace(name=name + sample.name[len(family.name) :]) for sample in family.samples
    ]
    return copy
