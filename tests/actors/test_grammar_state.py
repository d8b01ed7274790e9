"""Structured outputs in the scheduler: a constrained request waits at most one step for
its mask while the others keep two steps in flight, its mask follows every token it was
given, and a completed grammar finishes it with 'stop'."""

from __future__ import annotations

import functools
from typing import Any

import numpy as np
import pytest

from actors.grammar import GrammarError
from actors.grammar_state import GrammarState
from actors.kv_cache_manager import KVCacheManager
from actors.messages import EngineRequest, GrammarVocab
from actors.sampling_params import SamplingParams
from actors.scheduler import Scheduler
from actors.scheduler_config import SchedulerConfig
from actors.structured_output import StructuredOutputSpec
from app.tokenizer_loader import load_tokenizer
from tests.actors._kv_helpers import DirectKVClient, run_sync
from tests.actors.test_scheduler import answer, schedule

CHOICE = StructuredOutputSpec("choice", '["yes", "no"]')


@functools.cache
def _tokenizer() -> Any:
    return load_tokenizer("default")


def _scheduler(with_vocab: bool = True) -> Scheduler:
    tokenizer = _tokenizer()
    grammars = GrammarState(tokenizer.vocab_size)
    if with_vocab:
        grammars.set_vocab(GrammarVocab(tokenizer.raw.to_str(), tokenizer.eos_token_ids))
    config = SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=64, max_model_len=256,
                             block_size=16, max_steps_in_flight=2)
    return Scheduler(config, DirectKVClient(KVCacheManager(num_blocks=64, block_size=16)),
                     grammars)


def _request(request_id: str, spec: StructuredOutputSpec | None) -> EngineRequest:
    return EngineRequest(request_id, tuple(range(10, 18)),
                         SamplingParams(max_tokens=16, structured_output=spec), 0.0,
                         eos_token_ids=_tokenizer().eos_token_ids)


def _allowed(bitmask_row: np.ndarray) -> set[int]:
    bits = (bitmask_row.view(np.uint32)[:, None] >> np.arange(32, dtype=np.uint32)) & 1
    return set(np.flatnonzero(bits.reshape(-1)).tolist())


def test_a_constrained_request_skips_the_step_after_its_own_and_gets_exact_masks() -> None:
    scheduler = _scheduler()
    scheduler.add_request(_request("free", None))
    scheduler.add_request(_request("choice", CHOICE))
    (yes,) = _tokenizer().encode("yes")
    first = schedule(scheduler)
    assert first is not None and first.scheduled_request_ids == ("free", "choice")
    assert first.grammar_bitmask is not None
    assert first.grammar_bitmask.batch_indices.tolist() == [1]
    assert yes in _allowed(first.grammar_bitmask.bitmask[0])
    # Step 1 is built before step 0's tokens are known: only the free request runs in it.
    second = schedule(scheduler)
    assert second is not None and second.scheduled_request_ids == ("free",)
    assert second.grammar_bitmask is None
    scheduler.update_from_step(answer(first, overrides={"choice": yes}))
    # "yes" completes the choice: the request finishes with 'stop' on that token.
    request = scheduler.get_request("choice")
    assert request is None
    scheduler.update_from_step(answer(second))
    assert scheduler.get_request("free") is not None


def test_the_mask_follows_the_tokens_given_and_a_finished_grammar_stops() -> None:
    scheduler = _scheduler()
    scheduler.add_request(_request("r", StructuredOutputSpec("regex", "ab[0-9]")))
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


def test_requests_without_a_grammar_keep_two_steps_in_flight() -> None:
    scheduler = _scheduler()
    scheduler.add_request(_request("a", None))
    first, second = schedule(scheduler), schedule(scheduler)
    assert first is not None and second is not None
    assert second.scheduled_request_ids == ("a",) and scheduler.num_steps_in_flight == 2


def test_a_spec_without_a_tokenizer_or_that_does_not_compile_is_refused() -> None:
    with pytest.raises(GrammarError, match="tokenizer"):
        _scheduler(with_vocab=False).add_request(_request("a", CHOICE))
    scheduler = _scheduler()
    with pytest.raises(GrammarError):
        scheduler.add_request(_request("b", StructuredOutputSpec("regex", "(")))
    assert not scheduler.has_unfinished_requests
    config = SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=64, max_model_len=256,
                             block_size=16)
    no_grammars = Scheduler(config, DirectKVClient(KVCacheManager(num_blocks=8, block_size=16)))
    with pytest.raises(ValueError, match="structured outputs"):
        no_grammars.add_request(_request("c", CHOICE))
    run_sync(no_grammars.free_finished_blocks())
