"""The /metrics body in the format the scraper negotiated, with metric names unchanged.

Prometheus 2.x asks for OpenMetrics first (`application/openmetrics-text;version=1.0.0,...`)
and Prometheus 3.x for OpenMetrics with `escaping=allow-utf-8`. prometheus_client's
OpenMetrics encoder, under its default "underscores" escaping, rewrites the colons of
sample names (`vllm:prompt_tokens_total` -> `vllm_prompt_tokens_total`) while keeping them
in the HELP/TYPE lines, so dashboards and alerts that query `vllm:*` find nothing. Colons
are legal in legacy Prometheus names, so no escaping scheme may change them: every name
here is checked to be a legacy name, which every scheme leaves as it is, and the encoder is
run in the mode that writes such names verbatim.
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.exposition import CONTENT_TYPE_PLAIN_0_0_4, choose_encoder
from prometheus_client.openmetrics import exposition as openmetrics
from prometheus_client.validation import _is_valid_legacy_metric_name


def render(registry: CollectorRegistry, accept_header: str | None) -> tuple[bytes, str]:
    """(body, content type): OpenMetrics when the Accept header lists it, else the
    Prometheus text format (0.0.4, or 1.0.0 when asked)."""
    if not accept_header or "application/openmetrics-text" not in accept_header:
        if accept_header and "text/plain" in accept_header and "version=1.0.0" in accept_header:
            encoder, content_type = choose_encoder(accept_header)
            return encoder(registry), content_type
        return generate_latest(registry), CONTENT_TYPE_PLAIN_0_0_4
    _, content_type = choose_encoder(accept_header)
    _check_legacy_names(registry)
    version = "1.0.0"
    body = openmetrics.generate_latest(registry, escaping=openmetrics.ALLOWUTF8, version=version)
    return body, content_type


def _check_legacy_names(registry: CollectorRegistry) -> None:
    for family in registry.collect():
        for sample in family.samples:
            if not _is_valid_legacy_metric_name(sample.name):
                raise ValueError(
                    f"metric {sample.name!r} is not a legacy Prometheus name; "
                    "escaping would rename it"
                )
