from __future__ import annotations

import math

import numpy as np
import pytest
from prometheus_client import CollectorRegistry, Histogram

from telemetry.histogram import BatchHistogram

BOUNDS = (0.0, 0.01, 0.025, 0.05, 0.1, 0.5, 1.0)


def bucket_counts(registry: CollectorRegistry, name: str) -> dict[str, float]:
    [family] = [f for f in registry.collect() if f.name == name]
    return {s.labels["le"]: s.value for s in family.samples if s.name.endswith("_bucket")}


def sample_value(registry: CollectorRegistry, name: str, suffix: str) -> float:
    [family] = [f for f in registry.collect() if f.name == name]
    [value] = [s.value for s in family.samples if s.name == name + suffix]
    return value


@pytest.mark.parametrize("batch_size", [5, 31, 32, 1000])
def test_batches_land_in_the_same_buckets_as_prometheus_client(batch_size: int) -> None:
    """prometheus-client's own Histogram, fed one value at a time, is the reference."""
    rng = np.random.default_rng(batch_size)
    values = np.concatenate([rng.exponential(0.05, batch_size), np.array(BOUNDS), [-1.0, 5.0]])
    registry = CollectorRegistry()
    reference = Histogram(
        "ref_seconds", "reference", ["model_name"], buckets=BOUNDS, registry=registry
    ).labels(model_name="m")
    batch = BatchHistogram(
        "batch_seconds", "under test", BOUNDS, {"model_name": "m"}, registry=registry
    )
    for value in values:
        reference.observe(float(value))
    batch.observe_many(values[:batch_size])
    batch.observe_many(values[batch_size:].tolist())
    assert bucket_counts(registry, "batch_seconds") == bucket_counts(registry, "ref_seconds")
    assert sample_value(registry, "batch_seconds", "_sum") == pytest.approx(
        sample_value(registry, "ref_seconds", "_sum")
    )
    assert sample_value(registry, "batch_seconds", "_count") == len(values) == batch.count


def test_single_observations_and_nan_is_ignored() -> None:
    histogram = BatchHistogram("h", "doc", BOUNDS, {"model_name": "m"})
    for value in (0.01, 0.02, math.nan):
        histogram.observe(value)
    histogram.observe_many([math.nan] * 40 + [0.2] * 40)
    assert histogram.count == 42
    assert histogram.sum == pytest.approx(0.03 + 8.0)


@pytest.mark.parametrize("buckets", [(), (0.1, 0.05), (0.1, 0.1), (math.inf,)])
def test_buckets_must_increase(buckets: tuple[float, ...]) -> None:
    with pytest.raises(ValueError, match="strictly increasing"):
        BatchHistogram("h", "doc", buckets, {})
