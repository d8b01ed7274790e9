"""Structured outputs in the engine core: each constrained request's grammar matcher, the
step's token bitmask, and the finish a grammar decides.

    grammars.set_vocab(vocab)                    # GrammarVocab from a front end, once
    future = grammars.compile(params)            # at arrival; off the core thread when new
    request.grammar = future.result()            # once done; GrammarError -> the request fails
    mask, deferred = grammars.plan_step(id, rows)  # when a step is scheduled
    finish = grammars.advance(request, token)    # per sampled token (Scheduler.update_from_step)
    for step_id, pending in grammars.ready_masks()  # after each update: deferred masks, now
        filler.submit(step_id, pending)             # exact, filled off the core thread

A matcher must have seen every earlier output token before it can say what may come next.
Constrained requests are scheduled like the others, two steps in flight; when one of them
still has a token in flight, the step's mask is deferred: the runner launches the step's
forward and waits for the mask only before sampling, and the core builds that mask as soon
as the previous step's tokens have advanced the matchers (while the forward runs). So a
constrained row waits at most one step's result for its mask, and a step with no
constrained row never waits.

A deferred mask is filled on a thread of its own (`MaskFiller`): the grammar library
releases the GIL while it computes, so the core thread meanwhile sends the step's outputs
and schedules the next step instead of doing the two in turn. A matcher is never advanced
while its mask is being filled: its next token comes from the step that waits for the mask.
"""

from __future__ import annotations

import functools
import queue
import threading
from collections import deque
from collections.abc import Callable, Sequence
from concurrent.futures import Future
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np
import structlog

from actors.core.grammar import (
    CompileThreads,
    GrammarCompiler,
    GrammarError,
    GrammarMatcher,
    num_bitmask_words,
)
from actors.protocol.messages import GrammarBitmask, GrammarVocab, RequestFinish
from actors.protocol.sampling_params import SamplingParams

if TYPE_CHECKING:
    from actors.core.request import Request

log = structlog.get_logger("tandem.grammar")

COMPILE_THREADS = 2
"""New specs compile this many at a time: one slow schema (the front end lets a compile
take up to its time budget) does not hold up every other constrained request."""


@dataclass(slots=True)
class PendingMask:
    """A step's mask whose matchers are up to date, not yet computed (the rows of requests
    that finished meanwhile already allow everything)."""

    compiler: GrammarCompiler
    live: list[tuple[GrammarMatcher, int]]
    """(matcher, row of the bitmask) of the rows still running."""
    mask: GrammarBitmask
    filled: threading.Event
    """Set once the fill has ended (its buffer may then be handed out again)."""

    def fill(self) -> GrammarBitmask:
        try:
            if self.live:
                self.compiler.fill_bitmasks(self.live, self.mask.bitmask)
            return self.mask
        finally:
            self.filled.set()


def _allocate(num_rows: int, num_words: int) -> np.ndarray:
    return np.empty((num_rows, num_words), np.int32)


class GrammarState:
    def __init__(
        self,
        vocab_size: int,
        max_steps_in_flight: int = 2,
        allocate_buffer: Callable[[int, int], np.ndarray] = _allocate,
    ) -> None:
        """`vocab_size`: the model's logits width (masks cover it whole);
        `max_steps_in_flight`: the scheduler's bound (masks alive at once);
        `allocate_buffer(num_rows, num_words)`: an int32 mask buffer (the runner's, which
        uploads page-locked ones without a copy)."""
        self.vocab_size = vocab_size
        self._allocate_buffer = allocate_buffer
        self._num_buffers = max_steps_in_flight + 1
        self._compiler: Future[GrammarCompiler] | None = None
        """Built on a compile thread from the first GrammarVocab (reading a large vocabulary
        takes a second, which the step loop must not wait for)."""
        self._deferred: deque[tuple[int, Sequence[tuple[int, Request]]]] = deque()
        """Scheduled steps whose masks wait for earlier tokens, in step order."""
        self._ring: list[tuple[np.ndarray, threading.Event | None]] = []
        """Mask buffers and the events their last fills set (None: never handed out)."""
        self._next_buffer = 0
        self._compile_threads = CompileThreads(COMPILE_THREADS, "tandem-grammar-compile")

    def set_vocab(self, vocab: GrammarVocab) -> None:
        """Compile against this tokenizer from now on (the first front end's wins: every
        front end serves the same model)."""
        if self._compiler is None:
            self._compiler = self._compile_threads.submit(
                functools.partial(
                    GrammarCompiler, vocab.tokenizer_json, self.vocab_size, vocab.eos_token_ids
                )
            )
            self._compiler.add_done_callback(_log_vocab_refused)

    def compile(self, params: SamplingParams) -> Future[GrammarMatcher]:
        """A fresh matcher for the request's structured output: done at once when the spec
        was compiled before, else compiled on a compile thread (the future then carries the
        GrammarError of a spec that does not compile, or of a tokenizer the grammar library
        cannot use). Raises GrammarError at once when no tokenizer was sent."""
        spec = params.structured_output
        assert spec is not None
        compiler = self._compiler
        if compiler is None:
            raise GrammarError(
                "structured outputs need the model's tokenizer, and the front end sent none"
            )
        if compiler.done() and compiler.exception() is None:
            matcher = compiler.result().cached_matcher(spec)
            if matcher is not None:
                done: Future[GrammarMatcher] = Future()
                done.set_result(matcher)
                return done
        return self._compile_threads.submit(lambda: _usable(compiler).matcher(spec))

    def plan_step(
        self, step_id: int, rows: Sequence[tuple[int, Request]]
    ) -> tuple[GrammarBitmask | None, bool]:
        """(mask, deferred) of a step just scheduled, whose (batch index, request) rows
        sample under a grammar (their placeholders for this step already counted): the
        mask now when every matcher is up to date, else deferred (see `ready_masks`)."""
        if not rows:
            return None, False
        if self._deferred or not _is_up_to_date(rows):
            self._deferred.append((step_id, rows))
            return None, True
        return self._pending(rows).fill(), False

    def ready_masks(self) -> list[tuple[int, PendingMask]]:
        """The deferred masks whose matchers have now seen every earlier token, oldest
        first, to be filled in that order (call after each step's tokens were applied)."""
        ready = []
        while self._deferred and _is_up_to_date(self._deferred[0][1]):
            step_id, rows = self._deferred.popleft()
            ready.append((step_id, self._pending(rows)))
        return ready

    def _pending(self, rows: Sequence[tuple[int, Request]]) -> PendingMask:
        """Rows of requests that finished meanwhile allow everything (their token is
        dropped)."""
        assert self._compiler is not None  # a request with a matcher had it compiled
        bitmask, filled = self._buffer(len(rows))
        live = []
        for i, (_, request) in enumerate(rows):
            if request.is_finished:
                bitmask[i] = -1
            else:
                live.append((request.grammar, i))
        indices = np.fromiter((index for index, _ in rows), dtype=np.int32, count=len(rows))
        return PendingMask(self._compiler.result(), live, GrammarBitmask(indices, bitmask), filled)

    def _buffer(self, num_rows: int) -> tuple[np.ndarray, threading.Event]:
        """A [num_rows, num_words] int32 buffer from a ring of reused ones, and the event its
        fill sets: a fresh 5 MB array per step (256 rows of a 150k vocabulary) costs its
        page faults, 2-3 ms on the step's critical path. A mask lives until its step
        samples, and no more steps than the scheduler keeps in flight hold one, so a ring
        one longer hands out a buffer no step still reads; one whose fill has not ended
        (its step failed without waiting for it) is replaced, not shared."""
        slot = self._next_buffer
        self._next_buffer = (slot + 1) % self._num_buffers
        if slot == len(self._ring):
            buffer = self._allocate_buffer(num_rows, num_bitmask_words(self.vocab_size))
            self._ring.append((buffer, None))
        buffer, last_fill = self._ring[slot]
        if len(buffer) < num_rows or (last_fill is not None and not last_fill.is_set()):
            buffer = self._allocate_buffer(num_rows, num_bitmask_words(self.vocab_size))
        filled = threading.Event()
        self._ring[slot] = (buffer, filled)
        return buffer[:num_rows], filled

    @staticmethod
    def advance(request: Request, token_id: int) -> RequestFinish | None:
        """Feed a sampled token to the request's matcher: 'stop' once the grammar is
        complete (nothing but EOS could follow), 'error' if the token broke it (which the
        mask prevents)."""
        matcher: GrammarMatcher = request.grammar
        if not matcher.accept_token(token_id):
            return RequestFinish(
                request.request_id, "error", error=f"the output left its grammar: {matcher.error}"
            )
        if matcher.is_terminated:
            return RequestFinish(request.request_id, "stop")
        return None


def _usable(compiler: Future[GrammarCompiler]) -> GrammarCompiler:
    """The compiler once built (on a compile thread: the build may still run on another)."""
    try:
        return compiler.result()
    except Exception as exc:  # noqa: BLE001 - every constrained request is refused with it
        raise GrammarError(
            f"structured outputs are unavailable: the grammar library cannot "
            f"use the model's tokenizer ({type(exc).__name__}: {exc})"
        ) from exc


def _log_vocab_refused(compiler: Future[GrammarCompiler]) -> None:
    if compiler.exception() is not None:
        log.error("grammar_vocab_refused", error=repr(compiler.exception()))


def _is_up_to_date(rows: Sequence[tuple[int, Request]]) -> bool:
    """Every row's request has no token in flight but the one this step samples."""
    return all(request.num_output_placeholders <= 1 or request.is_finished for _, request in rows)


class MaskFiller:
    """Fills deferred masks on a thread of its own, in the order submitted, and hands each
    to `provide(step_id, mask)` (thread-safe, the runner's) as soon as it is computed; a
    fill that fails hands over the exception, so its step fails instead of waiting.

    `submit` waits (at most START_WAIT_S) until the filler has taken the job. The filler
    needs the GIL to start a fill, and the core thread goes on running Python after
    submitting: left to the interpreter's switch interval, the fill could start
    milliseconds late, on the constrained step's critical path. Waiting hands the GIL over
    at once; the fill itself runs without it."""

    START_WAIT_S = 0.002

    def __init__(self, provide: Callable[[int, GrammarBitmask | BaseException], None]) -> None:
        self._provide = provide
        self._jobs: queue.SimpleQueue[tuple[int, PendingMask] | None] = queue.SimpleQueue()
        self._thread: threading.Thread | None = None
        self._taken = threading.Semaphore(0)

    def submit(self, step_id: int, pending: PendingMask) -> None:
        if self._thread is None:  # engines that never see a grammar start no thread
            self._thread = threading.Thread(
                target=self._run, name="tandem-grammar-fill", daemon=True
            )
            self._thread.start()
        self._jobs.put((step_id, pending))
        self._taken.acquire(timeout=self.START_WAIT_S)

    def close(self) -> None:
        if self._thread is not None:
            self._jobs.put(None)

    def _run(self) -> None:
        while (job := self._jobs.get()) is not None:
            step_id, pending = job
            self._taken.release()
            try:
                mask: GrammarBitmask | BaseException = pending.fill()
            except Exception as exc:  # noqa: BLE001 - the step fails with it, the core goes on
                log.error("grammar_mask_failed", step_id=step_id, error=repr(exc))
                mask = exc
            self._provide(step_id, mask)
