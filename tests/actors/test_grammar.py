"""Grammar matchers on the embedded model's tokenizer: masks, acceptance, rollback, and the
end-to-end property that sampling under the mask always yields valid output."""

from __future__ import annotations

import functools
import json
from typing import Any

import jsonschema
import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from actors.core.grammar import GrammarCompiler, GrammarError, allocate_bitmask
from actors.protocol.structured_output import StructuredOutputSpec
from app.tokenizer_loader import load_tokenizer
from kernels.token_bitmask import apply_token_bitmask
from tests._embedded_model import embedded_gguf_path

MAX_OUTPUT_TOKENS = 400


@functools.cache
def _tokenizer() -> Any:
    embedded_gguf_path()  # skips the test where the embedded model is not installed
    tokenizer = load_tokenizer("default")
    assert tokenizer is not None
    return tokenizer


@functools.cache
def _compiler() -> GrammarCompiler:
    tokenizer = _tokenizer()
    return GrammarCompiler(tokenizer.raw.to_str(), tokenizer.vocab_size, tokenizer.eos_token_ids)


def _allowed(bitmask_row: np.ndarray) -> np.ndarray:
    bits = (bitmask_row.view(np.uint32)[:, None] >> np.arange(32, dtype=np.uint32)) & 1
    return bits.reshape(-1)[: _tokenizer().vocab_size].astype(bool)


def test_choice_masks_accepts_and_rolls_back() -> None:
    tokenizer = _tokenizer()
    matcher = _compiler().matcher(StructuredOutputSpec("choice", '["yes", "no"]'))
    bitmask = allocate_bitmask(1, tokenizer.vocab_size)
    matcher.fill_bitmask(bitmask, 0)
    allowed = _allowed(bitmask[0])
    assert allowed[tokenizer.encode("yes")[0]] and allowed[tokenizer.encode("no")[0]]
    assert not allowed[tokenizer.encode("maybe")[0]] and not allowed[tokenizer.eos_token_id]
    (yes,) = tokenizer.encode("yes")
    assert matcher.accept_token(yes) and matcher.is_accepting
    matcher.rollback(1)
    assert not matcher.is_accepting
    assert not matcher.accept_token(tokenizer.encode("maybe")[0])
    assert matcher.error is not None


def test_a_cached_spec_gives_independent_matchers() -> None:
    spec = StructuredOutputSpec("regex", "[0-9]{2}")
    first, second = _compiler().matcher(spec), _compiler().matcher(spec)
    for token_id in _tokenizer().encode("42"):
        assert first.accept_token(token_id)
    assert first.is_accepting and not second.is_accepting


def test_parallel_fill_equals_one_by_one() -> None:
    compiler, vocab_size = _compiler(), _tokenizer().vocab_size
    specs = [
        StructuredOutputSpec("regex", "[a-c]+"),
        StructuredOutputSpec("json", '{"type":"integer"}'),
        StructuredOutputSpec("grammar", 'root ::= "x" [0-9]'),
    ]
    matchers = [compiler.matcher(s) for s in specs]
    together, alone = allocate_bitmask(3, vocab_size), allocate_bitmask(3, vocab_size)
    compiler.fill_bitmasks([(m, row) for row, m in enumerate(matchers)], together)
    for row, matcher in enumerate(matchers):
        matcher.fill_bitmask(alone, row)
    assert np.array_equal(together, alone)


def test_invalid_specs_raise_grammar_error() -> None:
    for spec in (
        StructuredOutputSpec("regex", "(("),
        StructuredOutputSpec("json", "[1]"),
        StructuredOutputSpec("grammar", "start: nowhere"),
    ):
        with pytest.raises(GrammarError):
            _compiler().matcher(spec)


@pytest.mark.parametrize(
    "choices",
    [
        ["a", "ab", 'a"b', "\\x", "é€😀", "line\nbreak", "{brace}", "  spaces  ", "|bar|"],
        [f"option {i}" for i in range(5000)],  # past the 2,000 alternatives of one parser row
    ],
)
def test_a_choice_yields_exactly_one_of_its_strings(choices: list[str]) -> None:
    spec = StructuredOutputSpec("choice", json.dumps(choices))
    outputs = {_sample_under_mask(spec, seed) for seed in range(8)}
    assert outputs <= set(choices) and outputs


# ---- property: sampling under the mask yields valid JSON ---------------------------------

_KEYS = st.sampled_from(["id", "name", "tags", "size", "ok", "kind", "note"])
_LEAVES = st.one_of(
    st.builds(lambda n: {"type": "string", "maxLength": n}, st.integers(0, 12)),
    st.builds(
        lambda lo, span: {"type": "integer", "minimum": lo, "maximum": lo + span},
        st.integers(-50, 50),
        st.integers(0, 1000),
    ),
    st.just({"type": "boolean"}),
    st.just({"type": "null"}),
    st.builds(
        lambda values: {"enum": values},
        st.lists(
            st.sampled_from(["red", "green", "x y", "ü"]), min_size=1, max_size=3, unique=True
        ),
    ),
)


def _objects(children: st.SearchStrategy[dict[str, Any]]) -> st.SearchStrategy[dict[str, Any]]:
    def build(properties: dict[str, Any], data: st.DataObject) -> dict[str, Any]:
        required = data.draw(st.lists(st.sampled_from(sorted(properties)), unique=True))
        return {
            "type": "object",
            "properties": properties,
            "required": required,
            "additionalProperties": False,
        }

    arrays = st.builds(
        lambda items, lo, extra: {
            "type": "array",
            "items": items,
            "minItems": lo,
            "maxItems": lo + extra,
        },
        children,
        st.integers(0, 2),
        st.integers(0, 2),
    )
    objects = st.builds(build, st.dictionaries(_KEYS, children, min_size=1, max_size=3), st.data())
    return st.one_of(arrays, objects)


SCHEMAS = st.recursive(_LEAVES, _objects, max_leaves=6)


def _sample_under_mask(spec: StructuredOutputSpec, seed: int) -> str:
    """Random logits, the grammar's mask applied by the kernel's reference, argmax; EOS once
    the matcher accepts. Whitespace-only tokens get lower logits, as a model's would, so
    the walk ends."""
    tokenizer, compiler = _tokenizer(), _compiler()
    matcher = compiler.matcher(spec)
    bitmask = torch.from_numpy(allocate_bitmask(1, tokenizer.vocab_size))
    generator = torch.Generator().manual_seed(seed)
    token_ids: list[int] = []
    for _ in range(MAX_OUTPUT_TOKENS):
        if matcher.is_accepting and (
            matcher.is_terminated or torch.rand(1, generator=generator) < 0.5
        ):
            return tokenizer.decode(token_ids)
        matcher.fill_bitmask(bitmask.numpy(), 0)
        logits = torch.randn(1, tokenizer.vocab_size, generator=generator) - _whitespace_penalty()
        apply_token_bitmask(logits, bitmask, torch.zeros(1, dtype=torch.int32))
        token_id = int(logits.argmax())
        if token_id in tokenizer.eos_token_ids:
            assert matcher.is_accepting
            return tokenizer.decode(token_ids)
        assert matcher.accept_token(token_id), matcher.error
        token_ids.append(token_id)
    raise AssertionError(f"no complete output within {MAX_OUTPUT_TOKENS} tokens")


@functools.cache
def _whitespace_penalty() -> torch.Tensor:
    tokenizer = _tokenizer()
    texts = [tokenizer.decode([i]) for i in range(tokenizer.vocab_size)]
    return torch.tensor([[20.0 if t and not t.strip() else 0.0 for t in texts]])


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(schema=SCHEMAS, seed=st.integers(0, 2**31))
def test_sampling_under_the_mask_always_validates(schema: dict[str, Any], seed: int) -> None:
    text = _sample_under_mask(StructuredOutputSpec("json", json.dumps(schema)), seed)
    jsonschema.validate(json.loads(text), schema)
