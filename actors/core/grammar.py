"""Grammars for structured outputs, on llguidance: spec -> grammar, per-request matchers, and
the packed token bitmask the sampler applies (kernels/token_bitmask.py).

    compiler = GrammarCompiler(tokenizer.raw.to_str(), vocab_size, eos_token_ids)
    matcher = compiler.cached_matcher(spec)             # a copy of a compiled grammar, or None
    matcher = compile_threads.submit(functools.partial(compiler.matcher, spec)).result()
    bitmask = allocate_bitmask(num_rows, vocab_size)    # [num_rows, num_words] int32
    fill_bitmasks([(matcher, row)], bitmask)            # before sampling the row
    matcher.accept_token(sampled_token_id)              # after

Why llguidance and not xgrammar (benchmarks/NOTES.md, "Grammar library", 2 CPU cores): a new
grammar costs 1-3 ms to its first mask with a 150k vocabulary against 31-46 ms for
xgrammar's ahead-of-time compile, and agent traffic brings a new schema with nearly every
tool list; xgrammar fills a mask faster per token (4-8 us vs 10-14 us at p50 for JSON),
but both are far below a decode step and llguidance fills a batch in parallel threads. And
llguidance needs neither torch nor transformers (xgrammar imports both, 3.8 s), so the
front end, which never imports torch, validates specs with the same library.

Compiling runs native code that recurses with the grammar's depth and may take long. So
specs are first held to actors.core.grammar_limits' budgets, every compile runs on a thread
with a deep stack (CompileThreads), the engine core compiles off its step loop, and the
front end checks each new spec in a process of its own (app/grammar_checker.py) under a
time budget, so that neither a crash nor a hang can reach a process serving others.
"""

from __future__ import annotations

import json
import os
import queue
import threading
from collections import OrderedDict
from collections.abc import Callable, Sequence
from concurrent.futures import Future
from typing import Any, TypeVar

import llguidance
import llguidance.numpy
import numpy as np
from llguidance.gbnf_to_lark import any_to_lark

from actors.core.grammar_limits import COMPILE_STACK_BYTES, check_json_schema, check_lark_grammar
from actors.core.grammar_reasoning import after_reasoning
from actors.protocol.structured_output import StructuredOutputSpec

T = TypeVar("T")
DEFAULT_CACHE_SIZE = 256
MAX_ERROR_CHARS = 600
"""A compile error is cut to this length: it reaches the client and the log."""
_PARSER_LIMITS = llguidance.LLParserLimits(verbose_errors=False)
"""The library's default limits, with errors that name the problem without echoing the
grammar (a refused 3,000-way choice would otherwise come back with all 3,000 choices)."""
MASK_FILL_THREADS = max(1, min(4, (os.cpu_count() or 1) // 2))
"""Threads filling a batch's masks. On the H200 host (16 CPUs, 256 JSON rows of a 150k
vocabulary; benchmarks/NOTES.md, "Structured outputs on the H200"): in-process, 2 threads filled a
little faster than 4 (2.0-2.2 against 2.5-2.7 ms) at the same throughput, and 8 or 16
slower (they contend with the core thread, the launcher and the thread waiting on the
device); served, 4 threads gave 0.77 of unconstrained throughput and 2 gave 0.69 (one
run each way, other changes between them), so 4 stays."""
_JSON_LAYOUT = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}
"""JSON on one line with fixed separators (as OpenAI writes it): with free whitespace a
weak model can spend its whole budget on newlines before the first key."""


class GrammarError(ValueError):
    """A spec that cannot be compiled; the message says what is wrong with it."""


def grammar_definition(spec: StructuredOutputSpec) -> str:
    """The llguidance grammar for a spec (not yet checked), after its reasoning lead when it
    has one (actors.core.grammar_reasoning). Raises GrammarError when the spec's text is not
    even well-formed (a schema that is not a JSON object, ...) or is over one of
    actors.core.grammar_limits' budgets."""
    definition = _answer_definition(spec)
    return after_reasoning(definition, spec.reasoning) if spec.reasoning else definition


def _answer_definition(spec: StructuredOutputSpec) -> str:
    try:
        if spec.kind == "json":
            schema: Any = json.loads(spec.text)
            if not isinstance(schema, (dict, bool)):
                raise GrammarError("a JSON schema must be an object or a boolean")
            check_json_schema(schema)
            options: Any = dict(_JSON_LAYOUT) if spec.strict else {**_JSON_LAYOUT, "lenient": True}
            return llguidance.LLMatcher.grammar_from_json_schema(
                schema if isinstance(schema, dict) else spec.text, overrides=options
            )
        if spec.kind == "choice":
            return llguidance.LLMatcher.grammar_from_lark(_choice_lark(json.loads(spec.text)))
        if spec.kind == "grammar":
            lark = any_to_lark(spec.text)
            check_lark_grammar(lark)
            return llguidance.LLMatcher.grammar_from_lark(lark)
        return llguidance.LLMatcher.grammar_from_regex(spec.text)
    except (ValueError, TypeError, RecursionError) as exc:
        raise GrammarError(short_error(str(exc) or type(exc).__name__)) from None


def _choice_lark(choices: list[str]) -> str:
    """One terminal matching any of the strings: the lexer walks them as one automaton,
    so a list of 50,000 costs what a regex does, where one grammar alternative per string
    fills a parser row per alternative (refused beyond 2,000, slow well before)."""
    return "start: CHOICE\nCHOICE: " + " | ".join(json.dumps(choice) for choice in choices)


def check_spec(spec: StructuredOutputSpec, tokenizer: llguidance.LLTokenizer | None = None) -> str:
    """The checked grammar definition of `spec`; raises GrammarError naming the problem.
    Call it on a compile thread (CompileThreads): the library recurses natively while it
    compiles."""
    definition = grammar_definition(spec)
    is_error, messages = llguidance.LLMatcher.validate_grammar_with_warnings(
        definition, tokenizer, limits=_PARSER_LIMITS
    )
    if is_error:
        raise GrammarError(short_error(messages[0].strip()))
    return definition


def compile_matcher(
    tokenizer: llguidance.LLTokenizer, spec: StructuredOutputSpec
) -> llguidance.LLMatcher:
    """A pristine matcher for `spec`; raises GrammarError naming the problem. On a compile
    thread, as check_spec (whose checks the matcher makes too: one compile, not two)."""
    definition = grammar_definition(spec)
    matcher = llguidance.LLMatcher(tokenizer, definition, log_level=0, limits=_PARSER_LIMITS)
    if matcher.is_error():
        raise GrammarError(short_error(matcher.get_error()))
    return matcher


def short_error(message: str) -> str:
    """The library's error, fit to send to a client."""
    message = message.replace("<non-verbose/>", "").strip()
    return message if len(message) <= MAX_ERROR_CHARS else message[:MAX_ERROR_CHARS] + "..."


class CompileThreads:
    """Runs jobs (compiles) in submission order on `num_threads` daemon threads with
    COMPILE_STACK_BYTES of stack each, started at the first submit."""

    def __init__(self, num_threads: int, name: str) -> None:
        self._num_threads = num_threads
        self._name = name
        self._jobs: queue.SimpleQueue[tuple[Future[Any], Callable[[], Any]]] = queue.SimpleQueue()
        self._lock = threading.Lock()
        self._started = False

    def submit(self, fn: Callable[[], T]) -> Future[T]:
        future: Future[T] = Future()
        self._jobs.put((future, fn))
        with self._lock:
            if not self._started:
                self._started = True
                self._start_threads()
        return future

    def _start_threads(self) -> None:
        with _STACK_SIZE_LOCK:  # the size applies to any thread started meanwhile
            previous = threading.stack_size(COMPILE_STACK_BYTES)
            try:
                for index in range(self._num_threads):
                    threading.Thread(
                        target=self._run, name=f"{self._name}-{index}", daemon=True
                    ).start()
            finally:
                threading.stack_size(previous)

    def _run(self) -> None:
        while True:
            future, fn = self._jobs.get()
            if future.set_running_or_notify_cancel():
                try:
                    future.set_result(fn())
                except BaseException as exc:  # noqa: BLE001 - the future carries it
                    future.set_exception(exc)


_STACK_SIZE_LOCK = threading.Lock()


def num_bitmask_words(vocab_size: int) -> int:
    return (vocab_size + 31) // 32


def allocate_bitmask(num_rows: int, vocab_size: int) -> np.ndarray:
    """[num_rows, num_words] int32, every token allowed."""
    return np.full((num_rows, num_bitmask_words(vocab_size)), -1, dtype=np.int32)


class GrammarMatcher:
    """One request's position in its grammar."""

    __slots__ = ("_matcher",)

    def __init__(self, matcher: llguidance.LLMatcher) -> None:
        self._matcher = matcher

    def accept_token(self, token_id: int) -> bool:
        """Advance by one sampled token; False (and the matcher stays in error) when the
        grammar forbids it."""
        return bool(self._matcher.consume_token(token_id))

    def rollback(self, num_tokens: int) -> None:
        """Undo the last `num_tokens` accepted tokens (a draft token that was rejected)."""
        if not self._matcher.rollback(num_tokens):
            raise GrammarError(
                f"cannot roll back {num_tokens} tokens: "
                f"{self._matcher.get_error() or 'not that many accepted'}"
            )

    def fill_bitmask(self, bitmask: np.ndarray, row: int) -> None:
        """Write the allowed next tokens into `bitmask[row]` ([num_rows, num_words] int32)."""
        llguidance.numpy.fill_next_token_bitmask(self._matcher, bitmask, row)

    @property
    def is_terminated(self) -> bool:
        """The grammar admits no further token but EOS (or the matcher is in error)."""
        return bool(self._matcher.is_stopped())

    @property
    def is_accepting(self) -> bool:
        """The output so far is a complete match (EOS is allowed now)."""
        return bool(self._matcher.is_accepting())

    @property
    def error(self) -> str | None:
        return self._matcher.get_error() or None


class GrammarCompiler:
    """Compiles specs against one tokenizer, caching the pristine matcher of each spec so a
    repeated spec (the same tools, the same schema) costs one copy."""

    def __init__(
        self,
        tokenizer_json: str,
        vocab_size: int,
        eos_token_ids: Sequence[int],
        cache_size: int = DEFAULT_CACHE_SIZE,
    ) -> None:
        """`tokenizer_json`: a `tokenizers` tokenizer.json; `vocab_size`: rows of the model's
        logits (may exceed the tokenizer's, padding is never allowed)."""
        self.vocab_size = vocab_size
        self.tokenizer = llguidance.LLTokenizer(
            tokenizer_json, n_vocab=vocab_size, eos_token=list(eos_token_ids)
        )
        self._cache: OrderedDict[StructuredOutputSpec, llguidance.LLMatcher] = OrderedDict()
        self._cache_size = cache_size
        self._lock = threading.Lock()  # the core thread copies while a compile thread adds
        self._executor = llguidance.LLExecutor(num_threads=MASK_FILL_THREADS)

    def cached_matcher(self, spec: StructuredOutputSpec) -> GrammarMatcher | None:
        """A fresh matcher for `spec` when it was compiled before (a copy: microseconds),
        else None."""
        with self._lock:
            pristine = self._cache.get(spec)
            if pristine is None:
                return None
            self._cache.move_to_end(spec)
        return GrammarMatcher(pristine.deep_copy())

    def matcher(self, spec: StructuredOutputSpec) -> GrammarMatcher:
        """A fresh matcher for `spec`, compiled unless cached; raises GrammarError when the
        spec is invalid. On a compile thread (CompileThreads), as check_spec."""
        cached = self.cached_matcher(spec)
        if cached is not None:
            return cached
        pristine = compile_matcher(self.tokenizer, spec)
        with self._lock:
            self._cache[spec] = pristine
            if len(self._cache) > self._cache_size:
                self._cache.popitem(last=False)
        return GrammarMatcher(pristine.deep_copy())

    def fill_bitmasks(
        self, rows: Sequence[tuple[GrammarMatcher, int]], bitmask: np.ndarray
    ) -> None:
        """Fill `bitmask[row]` for each (matcher, row), in parallel threads (the GIL is
        released)."""
        pairs = [(matcher._matcher, row) for matcher, row in rows]
        llguidance.numpy.fill_next_token_bitmask_par(self._executor, pairs, bitmask)
