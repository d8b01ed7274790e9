"""Speculative decoding telemetry: vLLM's vllm:spec_decode_* counters from the step stats,
the per-request acceptance on the request span, and the front end's per-request counts."""

from __future__ import annotations

import time

import numpy as np
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from actors.frontend.output_stream import RequestStream
from actors.frontend.sampler import OutputProcessor
from actors.protocol.messages import EngineCoreOutputs, EngineRequest, SpecDecodeStats, StepStats
from actors.protocol.sampling_params import SamplingParams
from telemetry.metrics import EngineMetrics
from telemetry.records import RequestRecord
from telemetry.tracing import setup_tracing
from tests.telemetry.test_metrics import MODEL, scrape, value


def test_step_stats_feed_the_spec_decode_counters() -> None:
    metrics = EngineMetrics(MODEL)
    metrics.observe_step(StepStats(0, 2, 10, 0, spec=SpecDecodeStats(2, 8, 5, (2, 2, 1, 0))))
    metrics.observe_step(StepStats(1, 2, 10, 0, spec=SpecDecodeStats(1, 4, 1, (1, 0, 0, 0))))
    metrics.observe_step(StepStats(2, 2, 2, 0))  # a step without speculation
    families = scrape(metrics)
    assert value(families, "vllm:spec_decode_num_drafts", "vllm:spec_decode_num_drafts_total") == 3
    assert (
        value(
            families, "vllm:spec_decode_num_draft_tokens", "vllm:spec_decode_num_draft_tokens_total"
        )
        == 12
    )
    assert (
        value(
            families,
            "vllm:spec_decode_num_accepted_tokens",
            "vllm:spec_decode_num_accepted_tokens_total",
        )
        == 6
    )
    per_pos = "vllm:spec_decode_num_accepted_tokens_per_pos"
    assert [value(families, per_pos, f"{per_pos}_total", position=str(p)) for p in range(4)] == [
        3,
        2,
        1,
        0,
    ]


def test_the_request_span_carries_the_acceptance_rate() -> None:
    exporter = InMemorySpanExporter()
    tracing = setup_tracing("tandem-test", exporter=exporter)
    arrival = time.monotonic()
    span = tracing.start_request("chat", MODEL, arrival_time=arrival)
    span.finish(
        RequestRecord(
            "r", arrival, arrival + 0.1, "length", 5, 9, num_draft_tokens=8, num_accepted_tokens=6
        )
    )
    assert tracing.force_flush()
    [finished] = exporter.get_finished_spans()
    attributes = dict(finished.attributes or {})
    tracing.shutdown()
    assert attributes["tandem.spec_decode.num_draft_tokens"] == 8
    assert attributes["tandem.spec_decode.acceptance_rate"] == 0.75


def test_the_front_end_counts_each_requests_drafts_and_accepted_tokens() -> None:
    records: list[RequestRecord] = []
    processor = OutputProcessor(None, on_request_finished=records.append)
    request = EngineRequest("r", (1, 2, 3), SamplingParams(max_tokens=5), time.monotonic())
    processor.add_request(request, RequestStream("r", 3))
    processor.process_outputs(
        EngineCoreOutputs(
            step_id=0,
            request_ids=("r",),
            new_token_ids=np.asarray([7, 8, 9], np.int32),
            num_new_tokens=np.asarray([3], np.int32),
            num_draft_tokens=np.asarray([4], np.int32),
        )
    )
    processor.finish("r", "length")
    [record] = records
    assert (record.num_draft_tokens, record.num_accepted_tokens) == (4, 2)
    assert record.num_output_tokens == 3
