"""A Prometheus histogram that takes one value or a whole batch per call.

prometheus-client's Histogram costs about a microsecond per `observe`; a finished
request's inter-token gaps (hundreds of values) would cost that many calls. This wrapper
sorts a batch into buckets with one numpy pass and adds each bucket's count once. It sits
on the client's own Histogram, so it works in Prometheus multiprocess mode too (several
API-server processes whose metrics one scrape sums).
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence

import numpy as np
from prometheus_client import CollectorRegistry, Histogram

_NUMPY_MIN_BATCH = 32
"""Below this many values a loop of single observations beats numpy's call overhead."""


class BatchHistogram:
    """One histogram series with fixed labels (e.g. model_name). Thread-safe."""

    def __init__(
        self,
        name: str,
        documentation: str,
        buckets: Sequence[float],
        labels: Mapping[str, str],
        registry: CollectorRegistry | None = None,
    ) -> None:
        upper_bounds = [float(b) for b in buckets if not math.isinf(b)]
        if not upper_bounds or upper_bounds != sorted(set(upper_bounds)):
            raise ValueError(f"{name}: buckets must be strictly increasing, got {list(buckets)}")
        self.name = name
        self._upper_bounds_np = np.asarray(upper_bounds, dtype=np.float64)
        family = Histogram(
            name, documentation, list(labels), buckets=upper_bounds, registry=registry
        )
        self._series = family.labels(**labels) if labels else family

    def observe(self, value: float) -> None:
        if math.isnan(value):  # no bucket holds it, and it would poison the sum
            return
        self._series.observe(value)

    def observe_many(self, values: Sequence[float] | np.ndarray) -> None:
        if len(values) < _NUMPY_MIN_BATCH:
            for value in values:
                self.observe(float(value))
            return
        values_np = np.asarray(values, dtype=np.float64)
        values_np = values_np[~np.isnan(values_np)]
        indices = np.searchsorted(self._upper_bounds_np, values_np, side="left")
        counts = np.bincount(indices, minlength=len(self._upper_bounds_np) + 1).tolist()
        # The client's own per-bucket values (not cumulative; its exposition sums them).
        for bucket, count in zip(self._series._buckets, counts):
            if count:
                bucket.inc(count)
        self._series._sum.inc(float(values_np.sum()))

    @property
    def count(self) -> int:
        return int(sum(bucket.get() for bucket in self._series._buckets))

    @property
    def sum(self) -> float:
        return float(self._series._sum.get())
