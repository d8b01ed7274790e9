"""Hypothesis over sampling parameters through the engine API (the real engine core and a
front-end client on the embedded model, every protocol message encoded and decoded on the
way): every batch of requests with any valid parameters ends, each request with
a correct finish_reason and token count, and leaves no KV block, runner row or request
behind. The engine runs for the whole module, so anything leaked accumulates."""

from __future__ import annotations

import itertools
import time
from collections.abc import Iterator
from typing import Any

import anyio
import anyio.from_thread
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from actors.core.engine_startup import reuse_engine
from actors.inprocess_engine import InProcessEngine
from actors.protocol.config import DEFAULT_MAX_LOGPROBS
from actors.protocol.messages import EngineRequest
from actors.protocol.sampling_params import SamplingParams
from app.tokenizer_loader import load_tokenizer
from tests.app._server_fixtures import ENGINE, shared_model

pytestmark = pytest.mark.slow

MAX_NUM_SEQS = 8
MAX_TOKENS = 4
REQUEST_TIMEOUT_S = 60.0
VOCAB_SIZE = 49152  # SmolLM2's; checked against the model below
_ids = itertools.count()


class RunningEngine:
    def __init__(self) -> None:
        loaded = reuse_engine(shared_model(), ENGINE.replace(max_num_seqs=MAX_NUM_SEQS))
        self.worker = loaded.worker
        tokenizer = load_tokenizer(ENGINE.model)
        self.eos_token_ids = tokenizer.eos_token_ids
        self.engine = InProcessEngine(
            loaded.worker,
            loaded.runner,
            ENGINE.replace(max_num_seqs=MAX_NUM_SEQS),
            tokenizer=tokenizer,
            roundtrip=True,
        )
        self._portal_cm = anyio.from_thread.start_blocking_portal()
        self.portal = self._portal_cm.__enter__()
        self._run = self.portal.start_task_soon(self.engine.run)
        while self.engine.ready is None:
            time.sleep(0.01)

    def generate(self, requests: list[EngineRequest]) -> list[Any]:
        async def run() -> list[Any]:
            with anyio.fail_after(REQUEST_TIMEOUT_S):  # a hang fails the example
                streams = [self.engine.add_request(r) for r in requests]
                return [await s.wait_finished() for s in streams]

        return self.portal.call(run)

    def kv_free_and_checked(self) -> tuple[int, int]:
        async def ask() -> tuple[int, int]:
            checked = await self.engine.client.call("check_kv_invariants")
            assert checked.error is None, checked.error
            stats = (await self.engine.client.call("stats")).stats
            assert stats is not None
            return stats.num_free_kv_blocks, stats.num_total_kv_blocks

        return self.portal.call(ask)

    def stop(self) -> None:
        self.portal.call(self.engine.stop)
        self._run.result(timeout=60)
        self._portal_cm.__exit__(None, None, None)


@pytest.fixture(scope="module")
def engine() -> Iterator[RunningEngine]:
    running = RunningEngine()
    assert running.worker.model_config.vocab_size == VOCAB_SIZE
    yield running
    running.stop()


token_ids = st.integers(min_value=0, max_value=VOCAB_SIZE - 1)
stop_strings = st.lists(st.text(min_size=1, max_size=4), max_size=3).map(tuple)


@st.composite
def sampling_params(draw: st.DrawFn) -> SamplingParams:
    max_tokens = draw(st.integers(1, MAX_TOKENS))
    unit = st.floats(0.0, 1.0, allow_nan=False)
    penalty = st.floats(-2.0, 2.0, allow_nan=False)
    return SamplingParams(
        temperature=draw(st.one_of(st.just(0.0), st.floats(0.0, 5.0, allow_nan=False))),
        top_p=draw(st.one_of(st.just(1.0), st.floats(1e-6, 1.0, allow_nan=False))),
        top_k=draw(st.one_of(st.just(-1), st.integers(0, VOCAB_SIZE + 10))),
        min_p=draw(st.one_of(st.just(0.0), unit)),
        seed=draw(st.one_of(st.none(), st.integers(-(2**63), 2**64 - 1))),
        presence_penalty=draw(st.one_of(st.just(0.0), penalty)),
        frequency_penalty=draw(st.one_of(st.just(0.0), penalty)),
        repetition_penalty=draw(st.one_of(st.just(1.0), st.floats(0.01, 2.0, allow_nan=False))),
        logit_bias=tuple(
            draw(
                st.dictionaries(token_ids, st.floats(-100.0, 100.0, allow_nan=False), max_size=5)
            ).items()
        ),
        max_tokens=max_tokens,
        min_tokens=draw(st.integers(0, max_tokens)),
        stop=draw(stop_strings),
        stop_token_ids=tuple(draw(st.lists(token_ids, max_size=3))),
        ignore_eos=draw(st.booleans()),
        logprobs=draw(st.one_of(st.none(), st.integers(0, DEFAULT_MAX_LOGPROBS))),
        include_stop_str_in_output=draw(st.booleans()),
        skip_special_tokens=draw(st.booleans()),
    )


requests_strategy = st.lists(
    st.tuples(st.lists(token_ids, min_size=1, max_size=48), sampling_params()),
    min_size=1,
    max_size=4,
)


@settings(
    max_examples=40,
    deadline=None,
    database=None,
    derandomize=True,
    suppress_health_check=list(HealthCheck),
)
@given(batch=requests_strategy)
def test_any_sampling_parameters_finish_cleanly(
    engine: RunningEngine, batch: list[tuple[list[int], SamplingParams]]
) -> None:
    requests = [
        EngineRequest(
            request_id=f"fuzz-{next(_ids)}",
            prompt_token_ids=tuple(prompt),
            sampling_params=params,
            arrival_time=time.monotonic(),
            eos_token_ids=engine.eos_token_ids,
        )
        for prompt, params in batch
    ]
    deltas = engine.generate(requests)
    for request, delta in zip(requests, deltas):
        params = request.sampling_params
        assert delta is not None and delta.finish_reason in ("stop", "length"), delta
        num_tokens = len(delta.token_ids)
        assert delta.num_output_tokens == num_tokens
        assert params.min_tokens <= num_tokens <= params.max_tokens
        if delta.finish_reason == "length":
            assert num_tokens == params.max_tokens
        elif delta.stop_reason is None:  # EOS
            assert not params.ignore_eos and delta.token_ids[-1] in request.eos_token_ids
        elif isinstance(delta.stop_reason, int):
            assert delta.stop_reason in params.stop_token_ids
            assert delta.token_ids[-1] == delta.stop_reason
        else:
            assert delta.stop_reason in params.stop
        if params.logprobs is not None:
            assert delta.logprobs is not None and len(delta.logprobs) == num_tokens
            for entry in delta.logprobs:
                assert len(entry.top_logprobs) == params.logprobs and entry.rank >= 1
                assert -9999.0 <= entry.logprob <= 0.0
    _assert_nothing_left(engine)


def _assert_nothing_left(engine: RunningEngine) -> None:
    deadline = time.monotonic() + 10
    while True:
        scheduler = engine.engine.core.scheduler
        free, total = engine.kv_free_and_checked()
        if (scheduler.num_running, scheduler.num_waiting, free) == (0, 0, total):
            break
        assert time.monotonic() < deadline, (scheduler.num_running, free, total)
        time.sleep(0.01)
    assert engine.engine.client.sampler_actor.processor.num_requests == 0
