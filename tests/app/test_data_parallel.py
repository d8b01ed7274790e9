"""`tandem serve --data-parallel-size 2` on the CPU: two engine cores behind one API server.
A burst spreads within 10% of even between them, a conversation's turns stay on the core
that holds its prefix (and hit its cache), and greedy outputs are those of one core."""

from __future__ import annotations

import time
from collections.abc import Iterator
from concurrent.futures import Future, ThreadPoolExecutor

import httpx
import pytest

from tests.app._data_parallel import (
    BLOCK_SIZE,
    by_core,
    chat,
    core_of_next_request,
    finished_by_core,
)
from tests.app._serve_process import ServeProcess

pytestmark = pytest.mark.slow

# The same arithmetic in every core and in one core alone: one thread, and float32 weights,
# whose products do not depend on how many rows a step has (the packed int4 model's do:
# steps past 8 rows use its bf16 copy, so a prefix-cache hit can change a near-tie).
THREADS = ("--cpu-threads", "1", "--quantization", "none")
BURST = 40


@pytest.fixture(scope="module")
def dp2(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServeProcess]:
    tmp = tmp_path_factory.mktemp("dp2")
    server = ServeProcess(tmp / "serve.log", "--data-parallel-size", "2", *THREADS)
    try:
        yield server
    finally:
        exit_code = server.stop()
    assert exit_code == 0
    assert not server.descendants()


@pytest.fixture(scope="module")
def one_core(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Future[ServeProcess]]:
    """The one-core server that the greedy outputs are compared with, started in a thread
    by the conversation test: its start (mostly one core loading the model) runs while
    that test keeps one of dp2's cores busy at a time, and checks no time."""
    tmp = tmp_path_factory.mktemp("dp1")
    with ThreadPoolExecutor(1) as pool:
        starting = pool.submit(ServeProcess, tmp / "dp1.log", *THREADS)
        yield starting
        if starting.exception() is None:
            assert starting.result().stop() == 0


def test_version_and_metrics_name_both_cores(dp2: ServeProcess) -> None:
    assert httpx.get(dp2.url + "/version", timeout=10).json()["data_parallel_size"] == 2
    text = httpx.get(dp2.url + "/metrics", timeout=10).text
    for core in ("0", "1"):
        assert f'vllm:num_requests_running{{engine="{core}"' in text
        assert f'vllm:kv_cache_usage_perc{{engine="{core}"' in text


def test_a_burst_spreads_within_ten_percent_of_even(dp2: ServeProcess) -> None:
    """40 chats at once, sharing the chat template's system prompt: the shared prefix
    steers nothing once both cores hold it, so each core serves 20 +- 2."""
    before = finished_by_core(dp2.url)

    def ask(i: int) -> int:
        body = chat(dp2.url, [{"role": "user", "content": f"Say the number {i}."}], max_tokens=4)
        return int(body["usage"]["completion_tokens"])

    with ThreadPoolExecutor(BURST) as pool:
        assert all(n >= 1 for n in pool.map(ask, range(BURST)))
    after = finished_by_core(dp2.url)
    served = [after[core] - before[core] for core in (0, 1)]
    assert sum(served) == BURST
    assert max(served) <= BURST / 2 * 1.1, served


@pytest.mark.usefixtures("one_core")
def test_a_conversation_stays_on_the_core_that_holds_its_prefix(dp2: ServeProcess) -> None:
    """Three conversations take turns over two cores (load alone would move them around:
    with the cores idle each request would go to the next core in turn); each stays on one
    core, and every later turn finds its earlier turns cached there."""
    with ThreadPoolExecutor(2) as pool:  # both cores hold the system prompt from here on
        list(pool.map(lambda i: chat(dp2.url, [{"role": "user", "content": f"Hi {i}"}]), [1, 2]))
    openings = {"a": "Oceans", "b": "Mountains", "c": "Deserts"}  # distinct from the first word
    conversations = {
        name: [{"role": "user", "content": f"{opening}: write one sentence about them."}]
        for name, opening in openings.items()
    }
    cores: dict[str, list[int]] = {name: [] for name in openings}
    previous: dict[str, int] = {}
    for turn in range(3):
        for name, messages in conversations.items():
            core, body = core_of_next_request(
                dp2.url, lambda m=messages: chat(dp2.url, m, max_tokens=12)
            )
            cores[name].append(core)
            usage = body["usage"]
            if turn > 0:  # every full block of the previous turn's prompt at least
                cached = usage["prompt_tokens_details"]["cached_tokens"]
                assert cached >= previous[name] // BLOCK_SIZE * BLOCK_SIZE, (name, turn, usage)
            previous[name] = usage["prompt_tokens"]
            messages += [
                {"role": "assistant", "content": body["choices"][0]["message"]["content"]},
                {"role": "user", "content": "And another one."},
            ]
    for name, used in cores.items():
        assert len(set(used)) == 1, cores
    assert {used[0] for used in cores.values()} == {0, 1}, cores


def test_a_client_that_goes_away_frees_its_request_on_the_core_that_ran_it(
    dp2: ServeProcess,
) -> None:
    """Two long streams, one per core, dropped after their first chunk: each core hears the
    abort of its own request (left running, each would take tens of seconds here)."""
    clients = [httpx.Client(base_url=dp2.url, timeout=60) for _ in range(2)]
    bodies = [
        {
            "messages": [{"role": "user", "content": f"{opening}: count to 100."}],
            "max_tokens": 400,
            "ignore_eos": True,
            "stream": True,
        }
        for opening in ("Apples", "Pears")
    ]
    try:
        streams = [
            c.stream("POST", "/v1/chat/completions", json=b) for c, b in zip(clients, bodies)
        ]
        responses = [stream.__enter__() for stream in streams]
        # Kept: a line iterator that is collected closes its response.
        lines = [response.iter_lines() for response in responses]
        for line_iterator in lines:
            _next_data(line_iterator)  # the role's chunk
            _next_data(line_iterator)  # the first token's
        assert by_core(dp2.url, "vllm:num_requests_running") == [1, 1]
    finally:
        for client in clients:
            client.close()  # the connections go, mid-stream
    deadline = time.monotonic() + 10
    while by_core(dp2.url, "vllm:num_requests_running") != [0, 0]:
        assert time.monotonic() < deadline, "a core kept running a request nobody reads"
        time.sleep(0.1)
    aborted = by_core(dp2.url, "vllm:request_success_total", finished_reason="abort")
    assert min(aborted) >= 1, aborted


def _next_data(lines: Iterator[str]) -> str:
    return next(line for line in lines if line.startswith("data: "))


def test_greedy_outputs_are_those_of_one_core(
    dp2: ServeProcess, one_core: Future[ServeProcess]
) -> None:
    prompts = [f"Name {n} fruits." for n in (2, 3, 4, 5)]
    served_before = finished_by_core(dp2.url)
    # sent together, so load (not a prefix both share) spreads them over the cores
    with ThreadPoolExecutor(len(prompts)) as pool:
        two = list(pool.map(lambda prompt: _completion(dp2.url, prompt), prompts))
    served = [a - b for a, b in zip(finished_by_core(dp2.url), served_before)]
    assert min(served) >= 1, served  # both cores answered some
    one_core_url = one_core.result().url
    one = [_completion(one_core_url, prompt) for prompt in prompts]
    assert two == one


def _completion(url: str, prompt: str) -> tuple[str, int]:
    body = chat(url, [{"role": "user", "content": prompt}], max_tokens=16)
    return body["choices"][0]["message"]["content"], body["usage"]["completion_tokens"]
