"""Structured outputs in the scheduler: constrained requests keep two steps in flight, a
step behind one of their tokens gets its mask once that token is in (whatever became of
its step), the mask follows every token given, and a completed grammar finishes the
request with 'stop'."""

from __future__ import annotations

import functools
import queue
import threading
import time
import types
from typing import Any

import numpy as np
import pytest

from actors.core.grammar import GrammarError
from actors.core.grammar_state import GrammarState, MaskFiller
from actors.core.kv_cache_manager import KVCacheManager
from actors.core.scheduler import Scheduler
from actors.core.scheduler_config import SchedulerConfig
from actors.protocol.messages import (
    EngineRequest,
    GrammarVocab,
    RequestFinish,
    StepOutput,
    StepStats,
)
from actors.protocol.sampling_params import SamplingParams
from actors.protocol.structured_output import StructuredOutputSpec
from app.tokenizer_loader import load_tokenizer
from tests._embedded_model import embedded_gguf_path
from tests.actors.test_scheduler import answer, schedule

CHOICE = StructuredOutputSpec("choice", '["yes", "no"]')


@functools.cache
def _tokenizer() -> Any:
    embedded_gguf_path()  # skips the test where the embedded model is not installed
    return load_tokenizer("default")


def _scheduler(with_vocab: bool = True) -> Scheduler:
    tokenizer = _tokenizer()
    grammars = GrammarState(tokenizer.vocab_size)
    if with_vocab:
        grammars.set_vocab(GrammarVocab(tokenizer.raw.to_str(), tokenizer.eos_token_ids))
    config = SchedulerConfig(
        max_num_seqs=8,
        max_num_batched_tokens=64,
        max_model_len=256,
        block_size=16,
        max_steps_in_flight=2,
    )
    return Scheduler(config, KVCacheManager(num_blocks=64, block_size=16), grammars)


def _request(request_id: str, spec: StructuredOutputSpec | None) -> EngineRequest:
    return EngineRequest(
        request_id,
        tuple(range(10, 18)),
        SamplingParams(max_tokens=16, structured_output=spec),
        0.0,
        eos_token_ids=_tokenizer().eos_token_ids,
    )


def _add(scheduler: Scheduler, request: EngineRequest) -> RequestFinish | None:
    """Add a request and, when its grammar compiles on a compile thread, wait for it as the
    scheduler actor does; the request's error finish when it does not compile."""
    compiling = scheduler.add_request(request)
    if compiling is None:
        return None
    compiling.exception(timeout=30)
    return scheduler.grammar_compiled(request.request_id, compiling)


def _allowed(bitmask_row: np.ndarray) -> set[int]:
    bits = (bitmask_row.view(np.uint32)[:, None] >> np.arange(32, dtype=np.uint32)) & 1
    return set(np.flatnonzero(bits.reshape(-1)).tolist())


def test_a_constrained_step_behind_a_token_in_flight_gets_its_mask_after_that_token() -> None:
    scheduler = _scheduler()
    _add(scheduler, _request("free", None))
    _add(scheduler, _request("num", StructuredOutputSpec("regex", "[0-9]{3}")))
    tokenizer = _tokenizer()
    digit = tokenizer.encode("7")[0]
    first = schedule(scheduler)
    assert first is not None and first.scheduled_request_ids == ("free", "num")
    assert first.grammar_bitmask is not None and not first.grammar_mask_deferred
    assert first.grammar_bitmask.batch_indices.tolist() == [1]
    assert digit in _allowed(first.grammar_bitmask.bitmask[0])
    # Step 1 is built while step 0 runs: both requests keep going, the mask waits.
    second = schedule(scheduler)
    assert second is not None and second.scheduled_request_ids == ("free", "num")
    assert second.grammar_bitmask is None and second.grammar_mask_deferred
    result = scheduler.update_from_step(answer(first, overrides={"num": digit}))
    ((step_id, pending),) = result.grammar_masks
    mask = pending.fill()
    assert step_id == second.step_id and mask.batch_indices.tolist() == [1]
    after_one_digit = _allowed(mask.bitmask[0])
    assert digit in after_one_digit and not set(tokenizer.eos_token_ids) & after_one_digit
    third = schedule(scheduler)  # step 1 still runs: deferred again
    assert third is not None and third.grammar_mask_deferred
    assert scheduler.update_from_step(answer(second, overrides={"num": digit})).grammar_masks


def test_a_deferred_mask_comes_even_when_the_step_before_failed() -> None:
    scheduler = _scheduler()
    _add(scheduler, _request("choice", CHOICE))
    first, second = schedule(scheduler), schedule(scheduler)
    assert first is not None and second is not None and second.grammar_mask_deferred
    failed = StepOutput(
        first.step_id,
        (),
        np.zeros(0, np.int64),
        None,
        StepStats(first.step_id, 1, 1, 0),
        error="boom",
        failed_request_ids=first.scheduled_request_ids,
    )
    result = scheduler.update_from_step(failed)
    ((step_id, pending),) = result.grammar_masks
    assert step_id == second.step_id and (pending.fill().bitmask == -1).all()  # the request is gone


def test_the_mask_follows_the_tokens_given_and_a_finished_grammar_stops() -> None:
    scheduler = _scheduler()
    _add(scheduler, _request("r", StructuredOutputSpec("regex", "ab[0-9]")))
    tokenizer = _tokenizer()
    token_ids = tokenizer.encode("ab") + tokenizer.encode("7")
    finishes = []
    for token_id in token_ids:
        out = schedule(scheduler)
        assert out is not None and out.grammar_bitmask is not None
        assert token_id in _allowed(out.grammar_bitmask.bitmask[0])
        assert len(_allowed(out.grammar_bitmask.bitmask[0])) < tokenizer.vocab_size // 2
        finishes.extend(scheduler.update_from_step(answer(out, token_id=token_id)).finished)
    assert [(f.request_id, f.reason) for _, f in finishes] == [("r", "stop")]
    assert finishes[0][0].output_token_ids == token_ids


def test_a_spec_without_a_tokenizer_or_that_does_not_compile_is_refused() -> None:
    with pytest.raises(GrammarError, match="tokenizer"):
        _add(_scheduler(with_vocab=False), _request("a", CHOICE))
    scheduler = _scheduler()
    finish = _add(scheduler, _request("b", StructuredOutputSpec("regex", "(")))
    assert finish is not None and finish.reason == "error"
    assert finish.error is not None and "unclosed group" in finish.error  # the library's words
    assert not scheduler.has_unfinished_requests
    config = SchedulerConfig(
        max_num_seqs=8, max_num_batched_tokens=64, max_model_len=256, block_size=16
    )
    no_grammars = Scheduler(config, KVCacheManager(num_blocks=8, block_size=16))
    with pytest.raises(ValueError, match="structured outputs"):
        no_grammars.add_request(_request("c", CHOICE))
    no_grammars.free_finished_blocks()


def _gate_compiles(
    scheduler: Scheduler, monkeypatch: pytest.MonkeyPatch
) -> tuple[threading.Event, list[str]]:
    """Compiles wait for the returned event; the list gets the name of each compile's thread."""
    release = threading.Event()
    thread_names: list[str] = []
    compiler = scheduler.grammars._compiler.result(30)
    compile_matcher = compiler.matcher

    def gated_matcher(spec: StructuredOutputSpec) -> Any:
        thread_names.append(threading.current_thread().name)
        release.wait(30)
        return compile_matcher(spec)

    monkeypatch.setattr(compiler, "matcher", gated_matcher)
    return release, thread_names


def test_a_new_grammar_compiles_off_the_core_thread_while_other_requests_run(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    scheduler = _scheduler()
    release, thread_names = _gate_compiles(scheduler, monkeypatch)
    compiling = scheduler.add_request(_request("json", StructuredOutputSpec("regex", "[a-z]{4}")))
    scheduler.add_request(_request("free", None))
    assert compiling is not None and not compiling.done()
    first = schedule(scheduler)
    assert first is not None and first.scheduled_request_ids == ("free",)
    release.set()
    compiling.result(timeout=30)
    assert thread_names[0].startswith("tandem-grammar-compile")
    assert scheduler.grammar_compiled("json", compiling) is None
    second = schedule(scheduler)
    assert second is not None and second.scheduled_request_ids == ("free", "json")
    assert second.grammar_bitmask is not None
    # Compiled once: the same spec again is a copy of the cached grammar, at once.
    assert (
        scheduler.add_request(_request("again", StructuredOutputSpec("regex", "[a-z]{4}"))) is None
    )


def test_a_request_aborted_while_its_grammar_compiles_is_gone_when_the_compile_ends(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    scheduler = _scheduler()
    release, _ = _gate_compiles(scheduler, monkeypatch)
    compiling = scheduler.add_request(_request("r", StructuredOutputSpec("regex", "[a-z]{5}")))
    assert compiling is not None
    assert scheduler.abort_requests(["r"]) == ["r"]
    assert not scheduler.has_unfinished_requests
    release.set()
    compiling.result(timeout=30)
    assert scheduler.grammar_compiled("r", compiling) is None
    assert not scheduler.has_unfinished_requests and scheduler.num_waiting == 0
    scheduler.free_finished_blocks()


def test_a_tokenizer_the_grammar_library_cannot_use_refuses_constrained_requests_only() -> None:
    # What a grammar library of another version, or a broken tokenizer.json, does: the core
    # must keep serving (free requests run) and refuse constrained ones with the reason.
    scheduler = _scheduler(with_vocab=False)
    scheduler.grammars.set_vocab(GrammarVocab("{not a tokenizer", (0,)))
    for request_id in ("a", "b"):
        refused = _add(scheduler, _request(request_id, CHOICE))
        assert refused is not None and "cannot use the model's tokenizer" in refused.error
    assert _add(scheduler, _request("c", None)) is None
    assert scheduler.get_request("c") is not None and scheduler.num_waiting == 1


def test_masks_alive_together_never_share_memory_and_a_finished_row_allows_everything() -> None:
    tokenizer = _tokenizer()
    grammars = GrammarState(tokenizer.vocab_size, max_steps_in_flight=2)
    grammars.set_vocab(GrammarVocab(tokenizer.raw.to_str(), tokenizer.eos_token_ids))
    row = types.SimpleNamespace(
        grammar=grammars.compile(
            SamplingParams(structured_output=StructuredOutputSpec("regex", "[0-9]{3}"))
        ).result(30),
        is_finished=False,
        num_output_placeholders=1,
    )
    digits = {tokenizer.encode(str(d))[0] for d in range(10)}
    masks = [grammars.plan_step(step_id, [(0, row)])[0] for step_id in range(3)]
    for i, mask in enumerate(masks):
        assert mask is not None and digits <= _allowed(mask.bitmask[0])
        assert len(_allowed(mask.bitmask[0])) < tokenizer.vocab_size // 2
        assert not any(np.shares_memory(mask.bitmask, other.bitmask) for other in masks[:i])
    row.is_finished = True  # its buffer held the digits-only row just before
    again = [grammars.plan_step(step_id, [(0, row)])[0] for step_id in range(3, 6)]
    assert all(mask is not None and (mask.bitmask == -1).all() for mask in again)


def test_masks_are_filled_in_the_buffers_the_runner_allocates() -> None:
    # The runner hands out page-locked buffers on CUDA: a mask must be written into one of
    # them (not copied out of another), or the upload pays a staging copy again.
    tokenizer = _tokenizer()
    allocated: list[np.ndarray] = []

    def allocate(num_rows: int, num_words: int) -> np.ndarray:
        allocated.append(np.empty((num_rows, num_words), np.int32))
        return allocated[-1]

    grammars = GrammarState(tokenizer.vocab_size, max_steps_in_flight=2, allocate_buffer=allocate)
    grammars.set_vocab(GrammarVocab(tokenizer.raw.to_str(), tokenizer.eos_token_ids))
    rows = [
        (
            i,
            types.SimpleNamespace(
                grammar=grammars.compile(
                    SamplingParams(structured_output=StructuredOutputSpec("regex", "[0-9]{3}"))
                ).result(30),
                is_finished=False,
                num_output_placeholders=1,
            ),
        )
        for i in range(2)
    ]
    masks = [grammars.plan_step(step_id, rows)[0] for step_id in range(5)]
    assert len(allocated) == 3  # one per ring slot, reused after
    for step_id, mask in enumerate(masks):
        assert mask is not None and np.shares_memory(mask.bitmask, allocated[step_id % 3])
    # A mask whose fill has not ended (its step failed without waiting for it) keeps its
    # buffer: the ring hands out a new one in its place.
    for _, row in rows:
        row.num_output_placeholders = 2
    assert grammars.plan_step(5, rows) == (None, True)
    for _, row in rows:
        row.num_output_placeholders = 1
    ((_, unfilled),) = grammars.ready_masks()
    later = [grammars.plan_step(step_id, rows)[0] for step_id in range(6, 9)]
    assert len(allocated) == 4
    assert not any(np.shares_memory(unfilled.mask.bitmask, mask.bitmask) for mask in later)


def test_the_filler_hands_over_masks_in_order_and_a_failed_fill_as_its_error() -> None:
    tokenizer = _tokenizer()
    grammars = GrammarState(tokenizer.vocab_size)
    grammars.set_vocab(GrammarVocab(tokenizer.raw.to_str(), tokenizer.eos_token_ids))
    row = types.SimpleNamespace(
        grammar=grammars.compile(
            SamplingParams(structured_output=StructuredOutputSpec("regex", "[0-9]{3}"))
        ).result(30),
        is_finished=False,
        num_output_placeholders=2,
    )
    assert grammars.plan_step(4, [(0, row)]) == (None, True)  # a token in flight: deferred
    row.num_output_placeholders = 1
    (good,) = grammars.ready_masks()

    class Broken:
        def fill(self) -> None:
            raise RuntimeError("library failure")

    provided: queue.SimpleQueue = queue.SimpleQueue()
    filler = MaskFiller(lambda step_id, mask: provided.put((step_id, mask)))
    filler.submit(*good)
    filler.submit(5, Broken())
    filler.close()
    step_id, mask = provided.get(timeout=10)
    digits = {tokenizer.encode(str(d))[0] for d in range(10)}
    assert step_id == 4 and digits <= _allowed(mask.bitmask[0])
    step_id, error = provided.get(timeout=10)
    assert step_id == 5 and isinstance(error, RuntimeError)


def test_submit_returns_once_the_filler_took_the_job_and_never_waits_behind_a_fill() -> None:
    """The handoff puts the fill's start on the submitting thread's clock instead of the
    interpreter's switch interval; a filler still busy with an earlier mask must not hold
    the core thread for longer than START_WAIT_S."""
    release = threading.Event()

    class Slow:
        def fill(self) -> str:
            release.wait(10)
            return "mask"

    provided: queue.SimpleQueue = queue.SimpleQueue()
    filler = MaskFiller(lambda step_id, mask: provided.put((step_id, mask)))
    filler.submit(1, Slow())
    # Taken before submit returned, unless the machine starved the new thread for longer
    # than START_WAIT_S (other processes on the CPUs): then it is taken soon after.
    deadline = time.monotonic() + 5.0
    while not filler._jobs.empty() and time.monotonic() < deadline:
        time.sleep(0.001)
    assert filler._jobs.empty()
    started = time.perf_counter()
    filler.submit(2, Slow())  # the filler is inside step 1's fill
    assert time.perf_counter() - started < MaskFiller.START_WAIT_S + 0.5
    assert not filler._jobs.empty()
    release.set()
    filler.close()
    assert [provided.get(timeout=10) for _ in range(2)] == [(1, "mask"), (2, "mask")]
