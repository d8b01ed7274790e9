"""`python -m benchmarks.serve`: vLLM's metric definitions on hand-built event timelines,
the workload and argument checks, and real runs against a server: one client process and
several, on a running server and on one the benchmark starts itself."""

from __future__ import annotations

import itertools
import json
import math
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import anyio
import httpx
import pytest

from app.tokenizer_loader import load_tokenizer
from benchmarks.serve import main, parse_args
from benchmarks.serve_clients import arrival_offsets_s
from benchmarks.serve_metrics import RequestResult, StreamTimeline, summarize, tpot_s
from benchmarks.stream_client import sse_lines
from benchmarks.workloads import (
    ServeWorkload,
    request_body,
    text_prompts,
    token_id_prompts,
)

ROOT = Path(__file__).resolve().parents[2]

ROLE = {
    "choices": [{"index": 0, "delta": {"role": "assistant", "content": ""}, "finish_reason": None}]
}


def _content(text: str, finish_reason: str | None = None) -> dict[str, Any]:
    return {"choices": [{"index": 0, "delta": {"content": text}, "finish_reason": finish_reason}]}


def _usage(prompt_tokens: int, completion_tokens: int, cached_tokens: int = 0) -> dict[str, Any]:
    return {
        "choices": [],
        "usage": {
            "prompt_tokens": prompt_tokens,
            "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens,
            "prompt_tokens_details": {"cached_tokens": cached_tokens},
        },
    }


def _timeline(sent_s: float, events: list[tuple[float, dict[str, Any]]]) -> RequestResult:
    timeline = StreamTimeline(sent_s=sent_s)
    for at_s, event in events:
        timeline.on_event(at_s, event)
    return timeline.result()


# Request A: sent at 10.0; role chunk 10.2, a token in the same read (10.2), 10.5, the
# finish chunk 11.0, usage 11.1 (4 tokens). TTFT 0.2, ITL 0.0/0.3/0.5, E2EL 1.0,
# TPOT (1.0 - 0.2) / 3.
def _request_a() -> RequestResult:
    return _timeline(
        10.0,
        [
            (10.2, ROLE),
            (10.2, _content("a")),
            (10.5, _content("b")),
            (11.0, _content("c", "length")),
            (11.1, _usage(5, 4, 2)),
        ],
    )


# Request B: sent at 0; role 0.4, last token with finish 0.6, usage 0.9 (1 token).
# TTFT 0.4, ITL 0.2, E2EL 0.6, no TPOT (one output token).
def _request_b() -> RequestResult:
    return _timeline(0.0, [(0.4, ROLE), (0.6, _content("x", "stop")), (0.9, _usage(7, 1))])


def test_timeline_follows_vllm_definitions() -> None:
    a = _request_a()
    assert a.success and a.output_tokens == 4 and a.prompt_tokens == 5
    assert a.cached_prompt_tokens == 2
    assert a.ttft_s == pytest.approx(0.2)
    assert a.itl_s == pytest.approx((0.0, 0.3, 0.5))
    assert a.e2el_s == pytest.approx(1.0)  # the usage chunk at 11.1 does not count
    assert a.finish_reason == "length"
    assert tpot_s(a) == pytest.approx(0.8 / 3)
    b = _request_b()
    assert b.ttft_s == pytest.approx(0.4) and b.itl_s == pytest.approx((0.2,))
    assert tpot_s(b) is None


def test_failed_streams() -> None:
    error = _timeline(0.0, [(0.1, ROLE), (0.2, {"error": {"message": "boom", "code": 500}})])
    assert not error.success and error.error == "boom"
    no_usage = _timeline(0.0, [(0.1, ROLE), (0.2, _content("x", "stop"))])
    assert not no_usage.success and "usage" in no_usage.error
    empty = _timeline(0.0, [(0.3, _usage(3, 0))])
    assert not empty.success and "no choices" in empty.error


def test_summary_figures_are_hand_checked() -> None:
    failed = RequestResult(success=False, error="HTTP 503: busy")
    s = summarize([_request_a(), _request_b(), failed], duration_s=2.0, expected_output_tokens=4)
    assert (s["completed"], s["failed"], s["errors"]) == (2, 1, ["HTTP 503: busy"])
    assert (s["total_input_tokens"], s["total_output_tokens"]) == (12, 5)
    assert s["total_cached_prompt_tokens"] == 2
    assert s["request_throughput_req_s"] == pytest.approx(1.0)
    assert s["output_throughput_tok_s"] == pytest.approx(2.5)
    assert s["total_token_throughput_tok_s"] == pytest.approx(8.5)
    assert s["output_len_mismatches"] == 1
    # TTFT 200 and 400 ms; p99 interpolates linearly: 200 + 0.99 * 200.
    assert s["ttft"]["mean_ms"] == pytest.approx(300) and s["ttft"]["median_ms"] == pytest.approx(
        300
    )
    assert s["ttft"]["p99_ms"] == pytest.approx(398)
    # ITL pooled over both requests: 0, 200, 300, 500 ms.
    assert s["itl"]["mean_ms"] == pytest.approx(250) and s["itl"]["p50_ms"] == pytest.approx(250)
    assert s["itl"]["p99_ms"] == pytest.approx(300 + 0.97 * 200)
    # Only A has a TPOT.
    assert s["tpot"]["median_ms"] == pytest.approx(800 / 3)
    assert s["e2el"]["mean_ms"] == pytest.approx(800) and s["e2el"]["p99_ms"] == pytest.approx(996)


def test_summary_without_successes_reports_no_latency() -> None:
    s = summarize([RequestResult(success=False, error="x")], duration_s=1.0)
    assert (
        s["completed"] == 0 and s["ttft"]["median_ms"] is None and s["output_throughput_tok_s"] == 0
    )


def test_arrivals() -> None:
    assert arrival_offsets_s(3, math.inf, seed=0) == [0.0, 0.0, 0.0]
    offsets = arrival_offsets_s(4000, 20.0, seed=1)
    gaps = [b - a for a, b in itertools.pairwise(offsets)]
    assert offsets[0] == 0.0 and min(gaps) >= 0
    assert sum(gaps) / len(gaps) == pytest.approx(1 / 20.0, rel=0.1)
    assert arrival_offsets_s(10, 20.0, seed=1) == offsets[:10]


def test_prompts_and_bodies() -> None:
    prompts = token_id_prompts(3, 17, seed=5, token_id_range=(100, 200))
    assert [len(p) for p in prompts] == [17] * 3 and all(100 <= t < 200 for p in prompts for t in p)
    assert prompts == token_id_prompts(3, 17, seed=5, token_id_range=(100, 200))
    assert prompts != token_id_prompts(3, 17, seed=6, token_id_range=(100, 200))
    assert [len(t.split()) for t in text_prompts(2, 9, seed=0)] == [9, 9]
    tokenizer = load_tokenizer("default")
    sized = text_prompts(4, 33, seed=1, tokenizer=tokenizer)
    assert [len(tokenizer.encode(t)) for t in sized] == [33] * 4
    workload = ServeWorkload("chat", 1, 9, 12, ignore_eos=True, temperature=0.0, seed=0)
    body = request_body(workload, "hi there", "m")
    assert body["messages"] == [{"role": "user", "content": "hi there"}]
    assert body["max_completion_tokens"] == 12 and body["ignore_eos"] is True
    assert body["stream"] is True and body["stream_options"] == {"include_usage": True}


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (["--concurrency", "1,0"], "--concurrency"),
        (["--concurrency", "x"], "--concurrency"),
        (["--request-rate", "0"], "--request-rate"),
        (["--token-id-range", "50:10"], "--token-id-range"),
        (["--num-prompts", "0"], "--num-prompts"),
        (["--base-url", "127.0.0.1:8000"], "--base-url"),
        (["--clients", "4", "--concurrency", "2"], "--clients"),
        (["--response-format", "[1]"], "--response-format"),
        (["--base-url", "http://h:1", "--server", "--device cpu"], "not allowed with"),
    ],
)
def test_bad_flags_name_the_flag(
    flags: list[str], message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as exit_info:
        parse_args(flags)
    assert exit_info.value.code == 2 and message in capsys.readouterr().err


def test_flags_become_config() -> None:
    config = parse_args(
        [
            "--base-url",
            "http://h:1/v1/",
            "--concurrency",
            "1,16,64",
            "--request-rate",
            "inf",
            "--ignore-eos",
            "--endpoint",
            "chat",
            "--clients",
            "1",
        ]
    ).config
    assert config.base_url == "http://h:1" and config.concurrencies == (1, 16, 64)
    assert math.isinf(config.request_rate) and config.workload.ignore_eos
    assert config.workload.endpoint == "chat"


def test_the_structured_output_workload_reaches_every_request_body() -> None:
    """benchmarks/structured_output.json: the schema of `serve_chat_json_schema`."""
    config = parse_args(
        [
            "--endpoint",
            "chat",
            "--response-format",
            f"@{ROOT / 'benchmarks' / 'structured_output.json'}",
        ]
    ).config
    body = request_body(config.workload, "hi", "m")
    assert body["response_format"]["type"] == "json_schema"
    assert body["response_format"]["json_schema"]["schema"]["minItems"] == 200


@pytest.fixture(scope="module")
def server() -> Iterator[Any]:
    from tests.app._server_fixtures import RunningServer

    running = RunningServer()
    yield running
    running.stop()


def _serve(tmp_path: Path, *flags: str) -> dict[str, Any]:
    out = tmp_path / "serve.json"
    assert main([*flags, "--not-a-result", "--output", str(out)]) == 0
    return json.loads(out.read_text())


def _check_level(level: dict[str, Any], num_prompts: int, output_len: int) -> None:
    assert (level["completed"], level["failed"]) == (num_prompts, 0), level.get("errors")
    assert level["output_len_mismatches"] == 0
    assert level["total_output_tokens"] == num_prompts * output_len
    for metric in ("ttft", "tpot", "itl", "e2el"):
        figures = level[metric]
        assert 0 <= figures["p50_ms"] <= figures["p99_ms"], (metric, figures)
    assert level["e2el"]["median_ms"] > level["ttft"]["median_ms"]
    assert level["output_throughput_tok_s"] == pytest.approx(
        num_prompts * output_len / level["duration_s"]
    )


@pytest.mark.slow
def test_a_run_against_a_running_server(server: Any, tmp_path: Path) -> None:
    record = _serve(
        tmp_path,
        "--base-url",
        server.url,
        "--num-prompts",
        "3",
        "--input-len",
        "12",
        "--output-len",
        "6",
        "--concurrency",
        "1,3",
        "--warmup",
        "1",
        "--ignore-eos",
    )
    assert {"date", "commit", "clean", "hardware", "command", "workload"} <= set(record)
    assert record["workload"]["server"] == server.url
    details = record["details"]
    assert details["endpoint"] == "/v1/completions"
    assert details["model"] and details["server_version"]
    assert [level["concurrency"] for level in details["levels"]] == [1, 3]
    for level in details["levels"]:
        _check_level(level, 3, 6)
        assert level["total_input_tokens"] == 3 * 12  # token-id prompts are exact
    assert record["figures"]["c3_output_tok_s"] == pytest.approx(
        details["levels"][1]["output_throughput_tok_s"], abs=0.05
    )


@pytest.mark.slow
def test_several_client_processes_share_a_level_of_chat(server: Any, tmp_path: Path) -> None:
    record = _serve(
        tmp_path,
        "--base-url",
        server.url,
        "--endpoint",
        "chat",
        "--tokenizer",
        "default",
        "--num-prompts",
        "5",
        "--input-len",
        "8",
        "--output-len",
        "4",
        "--concurrency",
        "4",
        "--warmup",
        "2",
        "--clients",
        "2",
        "--ignore-eos",
    )
    assert record["details"]["endpoint"] == "/v1/chat/completions"
    (level,) = record["details"]["levels"]
    assert level["clients"] == 2 and level["concurrency"] == 4
    _check_level(level, 5, 4)  # the two processes' requests pooled


@pytest.mark.slow
def test_a_run_starts_and_stops_its_own_server(tmp_path: Path) -> None:
    record = _serve(
        tmp_path,
        "--server",
        "--device cpu --max-num-seqs 2 --max-model-len 256",
        "--num-prompts",
        "2",
        "--input-len",
        "8",
        "--output-len",
        "3",
        "--concurrency",
        "2",
        "--ignore-eos",
    )
    assert (
        record["workload"]["server"] == "tandem serve --device cpu --max-num-seqs 2 "
        "--max-model-len 256"
    )
    _check_level(record["details"]["levels"][0], 2, 3)
    assert "vllm:num_preemptions_total" in record["details"]["server_metrics"]


def test_sse_lines_end_only_at_line_feeds() -> None:
    # An event split across reads, CRLF endings, and a raw U+2028 inside its JSON (which
    # httpx's aiter_lines would take for a line end).
    chunks = [b'data: {"t": "a\xe2\x80\xa8', b'b"}\r\n\r\ndata: [DO', b"NE]\n\n"]

    async def body() -> AsyncIterator[bytes]:
        for chunk in chunks:
            yield chunk

    async def read() -> list[str]:
        transport = httpx.MockTransport(lambda request: httpx.Response(200, content=body()))
        async with httpx.AsyncClient(transport=transport) as client:
            async with client.stream("GET", "http://test/") as response:
                return [line async for line in sse_lines(response)]

    assert anyio.run(read) == ['data: {"t": "a\u2028b"}', "", "data: [DONE]", ""]
