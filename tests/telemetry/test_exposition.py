"""/metrics under every content type Prometheus 2.x and 3.x negotiate: names keep their
colons, and the vLLM request-shape families are there with vLLM's buckets."""

from __future__ import annotations

import pytest
from prometheus_client.openmetrics.parser import text_string_to_metric_families as parse_om
from prometheus_client.parser import text_string_to_metric_families as parse_text

from actors.protocol.messages import StepStats
from telemetry.metrics import EngineMetrics
from telemetry.records import RequestRecord
from telemetry.request_shape_metrics import build_1_2_5_buckets

PROMETHEUS_2 = (
    "application/openmetrics-text;version=1.0.0,application/openmetrics-text;"
    "version=0.0.1;q=0.75,text/plain;version=0.0.4;q=0.5,*/*;q=0.1"
)
PROMETHEUS_3 = (
    "application/openmetrics-text;version=1.0.0;escaping=allow-utf-8;q=0.5,"
    "application/openmetrics-text;version=0.0.1;q=0.4,text/plain;version=1.0.0;"
    "escaping=allow-utf-8;q=0.3,text/plain;version=0.0.4;q=0.2,*/*;q=0.1"
)
PROMETHEUS_3_PROTO_FIRST = (
    "application/vnd.google.protobuf;proto=io.prometheus.client."
    "MetricFamily;encoding=delimited;q=0.6," + PROMETHEUS_3
)
PROMETHEUS_3_TEXT = "text/plain;version=1.0.0;escaping=allow-utf-8;q=0.3,*/*;q=0.1"


def _served_metrics() -> EngineMetrics:
    metrics = EngineMetrics("m")
    metrics.request_shape.configure(2048, {"block_size": 16, "num_gpu_blocks": 100})
    metrics.observe_step(
        StepStats(step_id=1, num_reqs=2, num_tokens=40, num_prefill_tokens=38, step_time_s=0.01)
    )
    metrics.observe_request_finished(
        RequestRecord("a", 1.0, 2.0, "stop", num_prompt_tokens=30, num_output_tokens=7)
    )
    metrics.request_shape.observe_api_request(2, 64, [7, 12])
    return metrics


@pytest.mark.parametrize(
    ("accept", "openmetrics"),
    [
        (PROMETHEUS_2, True),
        (PROMETHEUS_3, True),
        (PROMETHEUS_3_PROTO_FIRST, True),
        (PROMETHEUS_3_TEXT, False),
        ("text/plain;version=0.0.4", False),
        (None, False),
    ],
)
def test_names_keep_their_colons(accept: str | None, openmetrics: bool) -> None:
    body, content_type = _served_metrics().render(accept)
    text = body.decode()
    assert content_type.startswith("application/openmetrics-text" if openmetrics else "text/plain")
    assert "vllm_" not in text
    families = {f.name: f for f in (parse_om if openmetrics else parse_text)(text)}
    samples: dict[str, float] = {}
    for family in families.values():
        for sample in family.samples:
            samples[sample.name] = samples.get(sample.name, 0.0) + sample.value
    assert samples["vllm:request_success_total"] == 1
    assert samples["vllm:generation_tokens_total"] == 7
    assert samples["vllm:request_prompt_tokens_sum"] == 30


def test_request_shape_families_have_vllm_buckets_and_meanings() -> None:
    families = {f.name: f for f in parse_text(_served_metrics().render()[0].decode())}

    def buckets(name: str) -> dict[str, float]:
        return {
            s.labels["le"]: s.value for s in families[name].samples if s.name == name + "_bucket"
        }

    assert list(buckets("vllm:request_params_n")) == ["1.0", "2.0", "5.0", "10.0", "20.0", "+Inf"]
    assert buckets("vllm:request_params_n")["2.0"] == 1
    assert len(buckets("vllm:request_prompt_tokens")) == len(build_1_2_5_buckets(2048)) + 1
    assert build_1_2_5_buckets(2048)[-1] == 2000
    assert buckets("vllm:iteration_tokens_total")["32.0"] == 0
    assert buckets("vllm:iteration_tokens_total")["64.0"] == 1
    max_generation = {
        s.name: s.value for s in families["vllm:request_max_num_generation_tokens"].samples
    }
    assert max_generation["vllm:request_max_num_generation_tokens_sum"] == 12  # the longest sample
    max_tokens = {s.name: s.value for s in families["vllm:request_params_max_tokens"].samples}
    assert max_tokens["vllm:request_params_max_tokens_count"] == 2  # one per sample
    (info,) = families["vllm:cache_config_info"].samples
    assert info.value == 1 and info.labels["block_size"] == "16"
