"""Grammars for structured outputs, on llguidance: spec -> grammar, per-request matchers, and
the packed token bitmask the sampler applies (kernels/token_bitmask.py).

    compiler = GrammarCompiler(tokenizer.raw.to_str(), vocab_size, eos_token_ids)
    matcher = compiler.matcher(spec)                    # cached grammar, fresh state
    bitmask = allocate_bitmask(num_rows, vocab_size)    # [num_rows, num_words] int32
    fill_bitmasks([(matcher, row)], bitmask)            # before sampling the row
    matcher.accept_token(sampled_token_id)              # after

Why llguidance and not xgrammar (benchmarks/results/grammar_cpu.json, 2 CPU cores): a new
grammar costs 1-3 ms to its first mask with a 150k vocabulary against 31-46 ms for
xgrammar's ahead-of-time compile, and agent traffic brings a new schema with nearly every
tool list; xgrammar fills a mask faster per token (4-8 us vs 10-14 us at p50 for JSON),
but both are far below a decode step and llguidance fills a batch in parallel threads. And
llguidance needs neither torch nor transformers (xgrammar imports both, 3.8 s), so the
front end, which never imports torch, validates specs with the same library.
"""

from __future__ import annotations

import json
import os
from collections import OrderedDict
from collections.abc import Sequence

import llguidance
import llguidance.numpy
import numpy as np

from actors.structured_output import StructuredOutputSpec

_LLGUIDANCE_FORMATS = {"json": "json_schema", "regex": "regex", "choice": "choice",
                       "grammar": "grammar"}
DEFAULT_CACHE_SIZE = 256
MASK_FILL_THREADS = max(1, min(4, (os.cpu_count() or 1) // 2))
"""Threads filling a batch's masks. On the H200 host (16 CPUs, 256 JSON rows of a 150k
vocabulary, benchmarks/results/grammar/h200/summary.json): in-process, 2 threads filled a
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
    """The llguidance grammar for a spec (not yet checked). Raises GrammarError when the
    spec's text is not even well-formed (a schema that is not a JSON object, ...)."""
    try:
        if spec.kind == "json":
            schema = json.loads(spec.text)
            if not isinstance(schema, (dict, bool)):
                raise GrammarError("a JSON schema must be an object or a boolean")
            options = dict(_JSON_LAYOUT) if spec.strict else {**_JSON_LAYOUT, "lenient": True}
            return llguidance.LLMatcher.grammar_from_json_schema(schema, overrides=options)
        return llguidance.grammar_from(_LLGUIDANCE_FORMATS[spec.kind], spec.text)
    except (ValueError, TypeError) as exc:
        raise GrammarError(str(exc) or type(exc).__name__) from None


def check_spec(spec: StructuredOutputSpec, tokenizer: llguidance.LLTokenizer | None = None
               ) -> str:
    """The checked grammar definition of `spec`; raises GrammarError naming the problem."""
    definition = grammar_definition(spec)
    is_error, messages = llguidance.LLMatcher.validate_grammar_with_warnings(definition,
                                                                            tokenizer)
    if is_error:
        raise GrammarError(messages[0].strip())
    return definition


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
            raise GrammarError(f"cannot roll back {num_tokens} tokens: "
                               f"{self._matcher.get_error() or 'not that many accepted'}")

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

    def __init__(self, tokenizer_json: str, vocab_size: int, eos_token_ids: Sequence[int],
                 cache_size: int = DEFAULT_CACHE_SIZE) -> None:
        """`tokenizer_json`: a `tokenizers` tokenizer.json; `vocab_size`: rows of the model's
        logits (may exceed the tokenizer's, padding is never allowed)."""
        self.vocab_size = vocab_size
        self.tokenizer = llguidance.LLTokenizer(tokenizer_json, n_vocab=vocab_size,
                                                eos_token=list(eos_token_ids))
        self._cache: OrderedDict[StructuredOutputSpec, llguidance.LLMatcher] = OrderedDict()
        self._cache_size = cache_size
        self._executor = llguidance.LLExecutor(num_threads=MASK_FILL_THREADS)

    def matcher(self, spec: StructuredOutputSpec) -> GrammarMatcher:
        """A fresh matcher for `spec`; raises GrammarError when the spec is invalid."""
        pristine = self._cache.get(spec)
        if pristine is None:
            definition = check_spec(spec, self.tokenizer)
            pristine = llguidance.LLMatcher(self.tokenizer, definition, log_level=0)
            if pristine.is_error():
                raise GrammarError(pristine.get_error())
            self._cache[spec] = pristine
            if len(self._cache) > self._cache_size:
                self._cache.popitem(last=False)
        else:
            self._cache.move_to_end(spec)
        return GrammarMatcher(pristine.deep_copy())

    def fill_bitmasks(self, rows: Sequence[tuple[GrammarMatcher, int]],
                      bitmask: np.ndarray) -> None:
        """Fill `bitmask[row]` for each (matcher, row), in parallel threads (the GIL is
        released)."""
        pairs = [(matcher._matcher, row) for matcher, row in rows]
        llguidance.numpy.fill_next_token_bitmask_par(self._executor, pairs, bitmask)
