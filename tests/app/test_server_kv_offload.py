"""A `tandem serve` with a host-memory tier behind a device pool of 8 blocks: /version names
the tier, a prompt evicted from the device pool comes back from host memory (its cached
tokens and the tandem:kv_offload_* series count it), and /reset_prefix_cache clears the
tier too."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from tests.app._server_fixtures import ENGINE, RunningServer

pytestmark = pytest.mark.slow

BLOCK_SIZE = 16
NUM_KV_BLOCKS = 8
PROMPT = {"prompt": "Answer in one word. " * 10 + "The sky is", "max_tokens": 2, "temperature": 0}
FLUSH = {"prompt": "Count the apples: " + "apple " * 110, "max_tokens": 1}
"""Long enough to take every block of the device pool."""


@pytest.fixture(scope="module")
def server() -> Iterator[RunningServer]:
    engine = ENGINE.replace(num_kv_blocks=NUM_KV_BLOCKS, kv_offload_cpu_bytes=64 << 20)
    with RunningServer(engine=engine) as running:
        yield running


def _post(server: RunningServer, path: str, body: dict[str, Any] | None = None) -> Any:
    response = httpx.post(server.url + path, json=body, timeout=120)
    assert response.status_code == 200, response.text
    return response.json()


def _cached_tokens(server: RunningServer, body: dict[str, Any]) -> int:
    return _post(server, "/v1/completions", body)["usage"]["prompt_tokens_details"]["cached_tokens"]


def _tier_samples(server: RunningServer) -> dict[tuple[str, str], float]:
    text = httpx.get(server.url + "/metrics", timeout=30).text
    return {
        (sample.name, sample.labels.get("tier", "")): sample.value
        for family in text_string_to_metric_families(text)
        for sample in family.samples
        if sample.name.startswith("tandem:kv_offload")
    }


def test_version_names_the_tiers(server: RunningServer) -> None:
    tiers = httpx.get(server.url + "/version", timeout=30).json()["kv_offload_tiers"]
    assert tiers.startswith("cpu ") and "blocks" in tiers


def test_an_evicted_prompt_comes_back_from_host_memory(server: RunningServer) -> None:
    _post(server, "/reset_prefix_cache")
    assert _cached_tokens(server, PROMPT) == 0
    _cached_tokens(server, FLUSH)
    cached = _cached_tokens(server, PROMPT)
    assert cached >= 2 * BLOCK_SIZE
    samples = _tier_samples(server)
    assert samples[("tandem:kv_offload_hits_total", "cpu")] >= cached
    assert samples[("tandem:kv_offload_blocks", "cpu")] > 0


def test_a_reset_clears_the_host_tier(server: RunningServer) -> None:
    _cached_tokens(server, PROMPT)
    _cached_tokens(server, FLUSH)  # the prompt's blocks now live in host memory only
    reset = _post(server, "/reset_prefix_cache")
    assert reset["num_dropped_offloaded_blocks"] > 0
    _cached_tokens(server, FLUSH)
    assert _cached_tokens(server, PROMPT) == 0
