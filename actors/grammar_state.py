"""Structured outputs in the engine core: each constrained request's grammar matcher, the
step's token bitmask, and the finish a grammar decides.

    grammars.set_vocab(vocab)                   # GrammarVocab from a front end, once
    request.grammar = grammars.matcher(params)  # at arrival; GrammarError -> refused
    bitmask = grammars.step_bitmask(rows)       # when a step is scheduled
    finish = grammars.advance(request, token)   # per sampled token (Scheduler.update_from_step)

A matcher must have seen every earlier output token before it can say what may come next,
so a constrained request is never scheduled while one of its tokens is still in flight: it
waits at most one step, and the mask built when it is scheduled is exact. Requests without
a grammar keep both steps in flight.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

import numpy as np

from actors.grammar import GrammarCompiler, GrammarError, GrammarMatcher, num_bitmask_words
from actors.messages import GrammarBitmask, GrammarVocab, RequestFinish
from actors.sampling_params import SamplingParams

if TYPE_CHECKING:
    from actors.request import Request


class GrammarState:
    def __init__(self, vocab_size: int) -> None:
        """`vocab_size`: the model's logits width (masks cover it whole)."""
        self.vocab_size = vocab_size
        self._compiler: GrammarCompiler | None = None

    @property
    def has_vocab(self) -> bool:
        return self._compiler is not None

    def set_vocab(self, vocab: GrammarVocab) -> None:
        """Compile against this tokenizer from now on (the first front end's wins: every
        front end serves the same model)."""
        if self._compiler is None:
            self._compiler = GrammarCompiler(vocab.tokenizer_json, self.vocab_size,
                                             vocab.eos_token_ids)

    def matcher(self, params: SamplingParams) -> GrammarMatcher | None:
        """A fresh matcher for the request's structured output (None without one). Raises
        GrammarError when the spec cannot be compiled or no tokenizer was sent."""
        spec = params.structured_output
        if spec is None:
            return None
        if self._compiler is None:
            raise GrammarError("structured outputs need the model's tokenizer, and the front "
                               "end sent none")
        return self._compiler.matcher(spec)

    def step_bitmask(self, rows: Sequence[tuple[int, Request]]) -> GrammarBitmask | None:
        """The masks of (batch index, request) rows that sample under a grammar this step."""
        if not rows:
            return None
        assert self._compiler is not None
        bitmask = np.empty((len(rows), num_bitmask_words(self.vocab_size)), dtype=np.int32)
        self._compiler.fill_bitmasks([(request.grammar, i) for i, (_, request)
                                      in enumerate(rows)], bitmask)
        return GrammarBitmask(np.fromiter((index for index, _ in rows), dtype=np.int32,
                                          count=len(rows)), bitmask)

    @staticmethod
    def advance(request: Request, token_id: int) -> RequestFinish | None:
        """Feed a sampled token to the request's matcher: 'stop' once the grammar is
        complete (nothing but EOS could follow), 'error' if the token broke it (which the
        mask prevents)."""
        matcher: GrammarMatcher = request.grammar
        if not matcher.accept_token(token_id):
            return RequestFinish(request.request_id, "error",
                                 error=f"the output left its grammar: {matcher.error}")
        if matcher.is_terminated:
            return RequestFinish(request.request_id, "stop")
        return None
