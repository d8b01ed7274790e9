"""Prompt logprobs on their way out of the core and through the front end: each front end
gets its own requests' rows, entries land at their prompt positions (a recomputed chunk
after a preemption overwrites with the same values), and the delta with the first output
token carries them, once (a stream sends them before any generated text). And
a grammar's 'stop' keeps its last token's text (EOS's is dropped)."""

from __future__ import annotations

import numpy as np

from actors.core.core_outputs import CoreOutputs
from actors.core.scheduler import StepResult
from actors.frontend.output_stream import RequestStream
from actors.frontend.sampler import OutputProcessor
from actors.protocol.messages import (
    EngineCoreOutputs,
    EngineRequest,
    LogprobsArrays,
    PromptLogprobs,
    RequestFinish,
    StepOutput,
    StepStats,
)
from actors.protocol.sampling_params import SamplingParams
from tests.actors._tokenizer_fixtures import tiny_tokenizer

EOS = 0


def _ids(text: str) -> list[int]:
    return tiny_tokenizer().encode(text).ids


def _rows(request_ids: tuple[str, ...], starts: list[int], counts: list[int]) -> PromptLogprobs:
    num_rows = sum(counts)
    token_ids = np.stack([np.arange(num_rows) + 10, np.full(num_rows, 3)], axis=1)
    return PromptLogprobs(
        request_ids,
        np.array(starts, np.int32),
        np.array(counts, np.int32),
        LogprobsArrays(
            token_ids.astype(np.int64),
            -np.arange(1, 2 * num_rows + 1, dtype=np.float32).reshape(num_rows, 2),
            np.arange(1, num_rows + 1, dtype=np.int64),
        ),
    )


def test_each_front_end_gets_only_its_requests_rows() -> None:
    sent: list[tuple[int, EngineCoreOutputs]] = []
    out = StepOutput(
        4,
        (),
        np.zeros(0, np.int64),
        None,
        StepStats(4, 3, 9, 9),
        prompt_logprobs=_rows(("a", "b", "c"), [1, 1, 5], [2, 3, 1]),
    )
    CoreOutputs(lambda client, message: sent.append((client, message))).step(
        out, StepResult(), prompt_clients=[0, 1, None]
    )
    by_client = {client: message.prompt_logprobs for client, message in sent}
    assert by_client[0] is not None and by_client[0].request_ids == ("a",)
    assert by_client[1] is not None and by_client[1].request_ids == ("b",)
    assert by_client[1].logprobs.token_ids[:, 0].tolist() == [12, 13, 14]
    assert by_client[1].start_positions.tolist() == [1]


def _processor(
    prompt_logprobs: int | None, max_tokens: int = 4
) -> tuple[OutputProcessor, RequestStream, EngineRequest]:
    processor = OutputProcessor(tiny_tokenizer())
    request = EngineRequest(
        "a",
        tuple(_ids("Q: hi there")),
        SamplingParams(max_tokens=max_tokens, prompt_logprobs=prompt_logprobs),
        0.0,
        eos_token_ids=(EOS,),
    )
    stream = RequestStream("a", num_prompt_tokens=len(request.prompt_token_ids))
    processor.add_request(request, stream)
    return processor, stream, request


async def test_entries_land_at_their_positions_and_ride_on_the_final_delta() -> None:
    processor, stream, request = _processor(prompt_logprobs=1)
    num_prompt = len(request.prompt_token_ids)
    assert num_prompt >= 4
    processor.process_outputs(EngineCoreOutputs(1, prompt_logprobs=_rows(("a",), [1], [2])))
    # Preempted and recomputed: positions 1..num_prompt-1 again, then the first token.
    processor.process_outputs(
        EngineCoreOutputs(
            2,
            ("a",),
            np.array([5], np.int32),
            prompt_logprobs=_rows(("a",), [1], [num_prompt - 1]),
            finished=(RequestFinish("a", "length"),),
        )
    )
    delta = await stream.wait_finished()
    assert delta is not None and delta.prompt_logprobs is not None
    entries = delta.prompt_logprobs
    assert len(entries) == num_prompt and entries[0] is None
    assert [e.token_id for e in entries[1:]] == list(range(10, 10 + num_prompt - 1))
    assert [len(e.top_logprobs) for e in entries[1:]] == [1] * (num_prompt - 1)
    assert entries[1].rank == 1 and entries[1].logprob == -1.0


async def test_the_first_tokens_delta_carries_them_once() -> None:
    processor, stream, request = _processor(prompt_logprobs=0)
    num_prompt = len(request.prompt_token_ids)
    processor.process_outputs(EngineCoreOutputs(1, prompt_logprobs=_rows(("a",), [1], [2])))
    processor.process_outputs(
        EngineCoreOutputs(
            2, ("a",), np.array([5], np.int32), prompt_logprobs=_rows(("a",), [3], [num_prompt - 3])
        )
    )
    first = await stream.get()
    assert first is not None and not first.finished and first.token_ids == (5,)
    assert first.prompt_logprobs is not None and len(first.prompt_logprobs) == num_prompt
    assert all(e is not None for e in first.prompt_logprobs[1:])
    processor.process_outputs(
        EngineCoreOutputs(
            3, ("a",), np.array([6], np.int32), finished=(RequestFinish("a", "length"),)
        )
    )
    last = await stream.get()
    assert last is not None and last.finished and last.prompt_logprobs is None


async def test_a_grammar_stop_keeps_the_last_tokens_text_and_eos_does_not() -> None:
    for last_token, expected in ((_ids("}")[0], "}"), (EOS, "")):
        processor, stream, _ = _processor(prompt_logprobs=None)
        processor.process_outputs(
            EngineCoreOutputs(
                1, ("a",), np.array([last_token], np.int32), finished=(RequestFinish("a", "stop"),)
            )
        )
        delta = await stream.wait_finished()
        assert delta is not None and delta.text == expected and delta.prompt_logprobs is None
