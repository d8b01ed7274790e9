"""A grammar checker process: `python -m actors.core.grammar_worker PARENT_PID`, started by a
front end (app/grammar_checker.py). It reads framed messages (ToGrammarChecker) on stdin
and answers each with a GrammarVerdict on stdout (GrammarCheckerStart with an empty one,
once the tokenizer is loaded).

It compiles each spec exactly as the engine core will (the same budgets, tokenizer and
stack) and asks the matcher for its first masks, so that a spec that would crash or hang the
core's compile does so here, in a process that serves no one else: its parent kills it at
its time budget or sees it die, and refuses the spec.

Frames: a 4-byte little-endian length, then a msgpack message (actors/protocol/messages.py).
"""

from __future__ import annotations

import sys
from typing import BinaryIO

import llguidance
import msgspec
import numpy as np

from actors.core.grammar import (
    CompileThreads,
    GrammarError,
    GrammarMatcher,
    allocate_bitmask,
    check_spec,
    compile_matcher,
    short_error,
)
from actors.protocol.codec import frame, read_frame
from actors.protocol.messages import GrammarCheckerStart, GrammarVerdict, ToGrammarChecker
from actors.protocol.parent_death import die_with_parent
from actors.protocol.structured_output import StructuredOutputSpec

WALK_TOKENS = 4


class SpecChecker:
    """Compiles specs against one tokenizer (or only validates them without one)."""

    def __init__(self, start: GrammarCheckerStart) -> None:
        self._tokenizer = (
            None
            if start.tokenizer_json is None
            else llguidance.LLTokenizer(
                start.tokenizer_json, n_vocab=start.vocab_size, eos_token=list(start.eos_token_ids)
            )
        )
        self._vocab_size = start.vocab_size
        self._eos_token_ids = np.array(start.eos_token_ids, dtype=np.int64)

    def verdict(self, spec: StructuredOutputSpec) -> GrammarVerdict:
        try:
            if self._tokenizer is None:
                check_spec(spec)
                return GrammarVerdict()
            self._walk(GrammarMatcher(compile_matcher(self._tokenizer, spec)))
        except GrammarError as exc:
            return GrammarVerdict(str(exc))
        return GrammarVerdict()

    def _walk(self, matcher: GrammarMatcher) -> None:
        """Compute the masks of the first WALK_TOKENS tokens, taking the lowest allowed
        token each time: a grammar whose parser rows outgrow the library's limit once the
        output starts (a choice among thousands of alternatives) fails here, before the
        request's first token, rather than after it."""
        bitmask = allocate_bitmask(1, self._vocab_size)
        for _ in range(WALK_TOKENS):
            matcher.fill_bitmask(bitmask, 0)
            if matcher.error is not None:
                raise GrammarError(short_error(matcher.error))
            allowed = np.flatnonzero(np.unpackbits(bitmask[0].view(np.uint8), bitorder="little"))
            allowed = allowed[~np.isin(allowed, self._eos_token_ids)]
            if matcher.is_terminated or not len(allowed):
                return
            matcher.accept_token(int(allowed[0]))


def serve(stdin: BinaryIO, stdout: BinaryIO) -> None:
    decoder = msgspec.msgpack.Decoder(ToGrammarChecker)
    encoder = msgspec.msgpack.Encoder()
    checker: SpecChecker | None = None
    while (payload := read_frame(stdin)) is not None:
        message = decoder.decode(payload)
        if isinstance(message, GrammarCheckerStart):
            checker = SpecChecker(message)
            verdict = GrammarVerdict()  # ready
        else:
            assert checker is not None
            verdict = checker.verdict(message.spec)
        stdout.write(frame(encoder.encode(verdict)))
        stdout.flush()


def main() -> int:
    if len(sys.argv) > 1:
        die_with_parent(int(sys.argv[1]))
    # The whole loop runs on a compile thread: its stack is the engine core's.
    done = CompileThreads(1, "tandem-grammar-check").submit(
        lambda: serve(sys.stdin.buffer, sys.stdout.buffer)
    )
    done.result()
    return 0


if __name__ == "__main__":
    sys.exit(main())
