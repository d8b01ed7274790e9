"""Schemathesis against the live server's /openapi.json: over 500 generated requests
(schema-valid and schema-violating) across every documented operation; no answer may be a
5xx, and every answer must match the documented status codes, content types and response
schemas. Generated max_tokens, min_tokens and n are capped (valid values stay valid) so
the real engine answers each generating request in a step or two."""

from __future__ import annotations

import re
from collections import Counter
from collections.abc import Iterator
from typing import Any

import httpx
import pytest
import schemathesis
from hypothesis import HealthCheck, given, settings
from schemathesis import GenerationMode
from schemathesis.specs.openapi.checks import positive_data_acceptance

from app.lenient_types import INT_PATTERN
from tests.app._fault_injection import leaked_markers
from tests.app._server_fixtures import ENGINE, RunningServer

pytestmark = pytest.mark.slow

API_KEY = "fuzz-key"
AUTH = {"Authorization": f"Bearer {API_KEY}"}
MAX_TOKENS = 2
MAX_N = 2
MAX_PROMPTS = 3
# Generated requests per operation and generation mode.
EXAMPLES = {
    ("POST", "/v1/chat/completions"): 60,
    ("POST", "/v1/completions"): 60,
    ("POST", "/tokenize"): 30,
    ("POST", "/detokenize"): 30,
    ("GET", "/v1/models/{model_id}"): 15,
    ("GET", "/v1/models"): 5,
    ("GET", "/health"): 5,
    ("GET", "/version"): 5,
    ("GET", "/metrics"): 5,
}
MIN_TOTAL_REQUESTS = 350
EXCLUDED_CHECKS = [positive_data_acceptance]
"""A schema cannot say everything a request must satisfy (a prompt that fits the context,
min_tokens <= max_tokens, a conversation the chat template accepts), so a schema-valid
request may rightly get a 400. Every other check runs: no 5xx, documented status codes,
content types and headers, response bodies that match their schemas, schema-violating
requests refused with a 4xx, required headers, auth not ignored, unsupported methods."""


@pytest.fixture(scope="module")
def server() -> Iterator[RunningServer]:
    running = RunningServer(engine=ENGINE.replace(max_num_seqs=16), api_key=API_KEY)
    yield running
    running.stop()


def _small(body: Any) -> Any:
    """Caps the cost of a generating request without changing whether it is valid: only
    integers above a cap are lowered, and prompt lists shortened (to a non-empty list)."""
    if not isinstance(body, dict):
        return body
    body = dict(body)
    for name, cap in (
        ("max_tokens", MAX_TOKENS),
        ("max_completion_tokens", MAX_TOKENS),
        ("min_tokens", MAX_TOKENS),
        ("n", MAX_N),
    ):
        value = body.get(name)
        if isinstance(value, str) and re.fullmatch(INT_PATTERN, value):
            value = int(value)  # the server reads digit strings as integers, as vLLM does
        if isinstance(value, (int, float)) and not isinstance(value, bool) and value > cap:
            body[name] = cap
    prompts = body.get("prompt")
    if (
        isinstance(prompts, list)
        and len(prompts) > 1
        and all(isinstance(p, (str, list)) for p in prompts)
    ):
        body["prompt"] = prompts[:MAX_PROMPTS]
    # Without max_tokens (absent or null) a request may generate up to the context length.
    if (
        ("messages" in body or "prompt" in body)
        and body.get("max_completion_tokens") is None
        and body.get("max_tokens") is None
    ):
        body["max_tokens"] = MAX_TOKENS
    return body


def _load_schema(url: str) -> Any:
    schema = schemathesis.openapi.from_url(url + "/openapi.json")

    @schema.hook("map_body")
    def cap_cost(context: Any, body: Any) -> Any:
        return _small(body)

    return schema


def test_fuzz_every_operation(server: RunningServer) -> None:
    schema = _load_schema(server.url)
    statuses: Counter[int] = Counter()
    failures: list[str] = []
    operations = [result.ok() for result in schema.get_all_operations()]
    assert {(op.method.upper(), op.path) for op in operations} == set(EXAMPLES)
    with httpx.Client(base_url=server.url, timeout=120) as client:
        for operation in operations:
            for mode in (GenerationMode.POSITIVE, GenerationMode.NEGATIVE):
                if (
                    mode is GenerationMode.NEGATIVE
                    and operation.method.upper() == "GET"
                    and operation.path != "/v1/models/{model_id}"
                ):
                    continue  # nothing in these requests can be invalid
                _fuzz(
                    operation,
                    mode,
                    EXAMPLES[(operation.method.upper(), operation.path)],
                    client,
                    statuses,
                    failures,
                )
    total = sum(statuses.values())
    print(f"schemathesis: {total} requests, statuses {dict(sorted(statuses.items()))}")
    assert not failures, "\n\n".join(failures[:5])
    assert total >= MIN_TOTAL_REQUESTS
    assert not [s for s in statuses if s >= 500]
    assert statuses[200] >= 50  # the engine really generated, not only refused
    snap = server.wait_engine_idle()
    assert snap.num_free_kv_blocks == snap.num_total_kv_blocks
    assert httpx.get(server.url + "/health").status_code == 200


def _fuzz(
    operation: Any,
    mode: GenerationMode,
    num_examples: int,
    client: httpx.Client,
    statuses: Counter[int],
    failures: list[str],
) -> None:
    @settings(
        max_examples=num_examples,
        deadline=None,
        database=None,
        derandomize=True,
        suppress_health_check=list(HealthCheck),
    )
    @given(case=operation.as_strategy(generation_mode=mode))
    def run(case: Any) -> None:
        response = case.call(headers=AUTH, timeout=120)
        statuses[response.status_code] += 1
        try:
            case.validate_response(response, headers=AUTH, excluded_checks=EXCLUDED_CHECKS)
        except (AssertionError, BaseExceptionGroup) as exc:  # collected, reported together
            failures.append(
                f"{operation.method.upper()} {operation.path} ({mode.value}): "
                f"{exc}\n{case.as_curl_command(headers=AUTH)}"
            )
        if response.status_code >= 400:
            sent = repr(case.body) + repr(case.path_parameters)
            leaked = leaked_markers(response.text, sent)
            if leaked:
                failures.append(f"{operation.path}: {leaked} in {response.text[:300]}")

    run()
