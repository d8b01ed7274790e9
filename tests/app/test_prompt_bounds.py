"""The characters-per-token bound refuses text that cannot fit without tokenizing it: it
must never refuse text that fits, and must not exist where a token can cover unbounded
text."""

from __future__ import annotations

import functools
import unicodedata
from pathlib import Path
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from tokenizers import AddedToken, Tokenizer, models, normalizers, pre_tokenizers

from app import prompt_bounds
from app.prompt_bounds import (
    MAX_CANONICAL_DECOMPOSITION_CHARS,
    TRUNCATION_MARGIN_CHARS,
    CharsPerToken,
    chars_per_token,
    text_cannot_fit,
    truncation_start,
)
from app.prompts import encode_prompt
from app.tokenizer import Tokenizer as AppTokenizer
from app.tokenizer_loader import load_warm_tokenizer
from gpu.weights.gguf_file import GGUFFile
from tests._embedded_model import embedded_gguf_path, needs_embedded_model

DENSEST = "\n" + " " * 80
"""The embedded vocabulary's longest token: 81 characters."""


@pytest.fixture(scope="module")
def tokenizer() -> AppTokenizer:
    return AppTokenizer.from_gguf(GGUFFile(embedded_gguf_path()).metadata)


def test_the_bound_is_the_longest_token_and_dropped_characters_are_uncounted(
    tokenizer: AppTokenizer,
) -> None:
    bound = chars_per_token(tokenizer)
    assert bound is not None
    vocab = tokenizer.raw.get_vocab(with_added_tokens=True)
    assert bound.max_chars == max(map(len, vocab)) == len(DENSEST)
    assert tokenizer.encode(DENSEST) == [vocab["Ċ" + "Ġ" * 80]]
    # SmolLM2's byte-level vocabulary has no token for a few control characters: they are
    # dropped, so a text of them alone is no evidence of length.
    assert bound.dropped and all(tokenizer.encode(char * 1000) == [] for char in bound.dropped)
    assert not text_cannot_fit(bound.dropped * 10_000, tokenizer, 1)


@pytest.mark.parametrize("num_tokens", [1, 7, 300])
def test_the_densest_text_fits_exactly_and_one_token_more_does_not(
    tokenizer: AppTokenizer, num_tokens: int
) -> None:
    text = DENSEST * num_tokens
    assert len(tokenizer.encode(text)) == num_tokens
    assert not text_cannot_fit(text, tokenizer, num_tokens)
    assert text_cannot_fit(text, tokenizer, num_tokens - 1)


SAMPLES = st.lists(
    st.one_of(
        st.sampled_from(
            [
                " ",
                "\n",
                "\t",
                "#",
                "0",
                "1",
                "a",
                "é",
                "中",
                "😀",
                "\u0301",
                "\x04",
                "\x1d",
                "<|im_start|>",
                "<|im_end|>",
                DENSEST,
                "#" * 80,
                "=" * 64,
            ]
        ),
        # Lone surrogates never get this far: a body holding one is refused with a 400.
        st.characters(exclude_categories=("Cs",)),
    ),
    max_size=60,
).map("".join)


@settings(max_examples=400, deadline=None)
@given(text=SAMPLES)
def test_text_that_fits_is_never_refused(tokenizer: AppTokenizer, text: str) -> None:
    num_tokens = len(tokenizer.encode(text))
    assert not text_cannot_fit(text, tokenizer, num_tokens)


def _bpe(vocab: dict[str, int], **options: Any) -> Tokenizer:
    return Tokenizer(models.BPE(vocab, [], **options))


def _wrap(raw: Tokenizer) -> AppTokenizer:
    return AppTokenizer(raw)


def test_tokenizers_whose_tokens_can_cover_unbounded_text_have_no_bound() -> None:
    wordpiece = Tokenizer(models.WordPiece({"[UNK]": 0, "a": 1}, unk_token="[UNK]"))
    fused = _bpe({"<unk>": 0, "a": 1}, unk_token="<unk>", fuse_unk=True)
    no_unknown = _bpe({"a": 0})  # unknown characters vanish
    whitespace = _bpe({"<unk>": 0, "a": 1}, unk_token="<unk>")
    whitespace.pre_tokenizer = pre_tokenizers.Whitespace()  # whitespace vanishes
    strip = _bpe({"<unk>": 0, "a": 1}, unk_token="<unk>")
    strip.normalizer = normalizers.Strip()
    swallowing = _bpe({"<unk>": 0, "a": 1}, unk_token="<unk>")
    swallowing.add_special_tokens([AddedToken("<mask>", lstrip=True)])
    truncating = _bpe({"<unk>": 0, "a": 1}, unk_token="<unk>")
    truncating.enable_truncation(8)
    for raw in (wordpiece, fused, no_unknown, whitespace, strip, swallowing, truncating):
        assert chars_per_token(_wrap(raw)) is None
        assert not text_cannot_fit("a" * 10_000, _wrap(raw), 1)


def test_a_composing_normalizer_multiplies_the_bound() -> None:
    raw = _bpe({"<unk>": 0, "é": 1, "ab": 2}, unk_token="<unk>")
    assert chars_per_token(_wrap(raw)).max_chars == 5  # type: ignore[union-attr]
    raw.normalizer = normalizers.NFC()
    tokenizer = _wrap(raw)
    assert chars_per_token(tokenizer).max_chars == 5 * MAX_CANONICAL_DECOMPOSITION_CHARS  # type: ignore[union-attr]
    decomposed = "e\u0301" * 100  # NFC makes each pair one "é" token
    assert len(tokenizer.encode(decomposed)) == 100
    assert not text_cannot_fit(decomposed, tokenizer, 100)


def test_the_longest_canonical_decomposition_is_four_characters() -> None:
    longest = max(
        len(unicodedata.normalize("NFD", chr(code)))
        for code in range(0x110000)
        if not 0xD800 <= code <= 0xDFFF
    )
    assert longest == MAX_CANONICAL_DECOMPOSITION_CHARS


def test_byte_fallback_covers_every_character() -> None:
    vocab = {"<unk>": 0, "▁a": 1, **{f"<0x{byte:02X}>": 2 + byte for byte in range(256)}}
    raw = _bpe(vocab, unk_token="<unk>", fuse_unk=True, byte_fallback=True)
    raw.normalizer = normalizers.Sequence([normalizers.Prepend("▁"), normalizers.Replace(" ", "▁")])
    tokenizer = _wrap(raw)
    assert chars_per_token(tokenizer).max_chars == 6  # type: ignore[union-attr]
    text = "語" * 50
    assert not text_cannot_fit(text, tokenizer, len(tokenizer.encode(text)))


@needs_embedded_model
def test_the_served_tokenizer_has_its_bound_before_the_first_request() -> None:
    # Reading the vocabulary is one call that holds the GIL (tens of milliseconds for a
    # large vocabulary): a request's worker thread must not be the one to pay it.
    tokenizer = load_warm_tokenizer("default", None)
    assert tokenizer in prompt_bounds._bounds
    assert prompt_bounds._bounds[tokenizer] == chars_per_token(tokenizer)


# ---- truncate_prompt_tokens: the text is cut before it is tokenized --------------------

MAX_MODEL_LEN = 2048
REPO = Path(__file__).resolve().parents[2]
NORMAL_TEXTS = {
    "prose and markdown": (REPO / "README.md").read_text(),
    "python": (REPO / "app" / "prompts.py").read_text(),
    "many scripts": "Grüße aus Köln! 東京は晴れ。 Привет, мир. 🙂 مرحبا ¿Qué tal? 1234.5\n",
    "chat markup": (
        "<|im_start|>user\nHello there<|im_end|>\n<|im_start|>assistant\nHi!<|im_end|>\n"
    ),
    "dropped characters": "a\x04b \x1d\x1d\x1d word\x13 " + "\x06" * 40 + "\n",
}


def _long(text: str, num_tokens: int, bound: CharsPerToken) -> str:
    """`text` repeated to twice what the cut keeps."""
    num_counted = len(text) - sum(map(text.count, bound.dropped))
    num_kept = num_tokens * bound.max_chars + TRUNCATION_MARGIN_CHARS
    return text * (2 * num_kept // num_counted + 1)


@functools.cache
def _full_ids(tokenizer: AppTokenizer, text: str) -> list[int]:
    return tokenizer.encode(text, True)


@pytest.mark.parametrize("num_tokens", [1, 37, MAX_MODEL_LEN - 1])
@pytest.mark.parametrize("name", NORMAL_TEXTS)
def test_a_cut_text_ends_in_the_tokens_of_the_whole_text(
    tokenizer: AppTokenizer, name: str, num_tokens: int
) -> None:
    bound = chars_per_token(tokenizer)
    assert bound is not None
    text = _long(NORMAL_TEXTS[name], num_tokens, bound)
    assert 0 < truncation_start(text, tokenizer, num_tokens)
    ids = encode_prompt(tokenizer, text, True, num_tokens, MAX_MODEL_LEN)
    assert ids[-num_tokens:] == _full_ids(tokenizer, text)[-num_tokens:]


WORDS = st.sampled_from(
    [
        "the",
        " ",
        "\n\n",
        "naïve",
        "中文",
        "😀",
        "don't",
        "3.14",
        "#",
        "==",
        "<|im_end|>",
        "\t",
        DENSEST,
        "\x04",
        "ab\x1dcd",
    ]
) | st.text(max_size=12)


@settings(max_examples=60, deadline=None)
@given(words=st.lists(WORDS, min_size=1, max_size=40), num_tokens=st.integers(1, 40))
def test_a_cut_text_of_words_ends_in_the_same_tokens(
    tokenizer: AppTokenizer, words: list[str], num_tokens: int
) -> None:
    bound = chars_per_token(tokenizer)
    assert bound is not None
    # Each repetition ends in a word, so no run of spaces or marks is longer than it.
    text = _long(" ".join(words) + " end.\n", num_tokens, bound)
    tail = text[truncation_start(text, tokenizer, num_tokens) :]
    assert tokenizer.encode(tail)[-num_tokens:] == tokenizer.encode(text)[-num_tokens:]


def test_dropped_characters_move_the_cut_back(tokenizer: AppTokenizer) -> None:
    bound = chars_per_token(tokenizer)
    assert bound is not None and bound.dropped
    plain = "x " * 100_000
    dropped = bound.dropped[0] * 50_000
    cut = truncation_start(plain, tokenizer, 10)
    assert cut > 0 and truncation_start(plain + dropped, tokenizer, 10) == cut
    everything_dropped = dropped * 10
    assert truncation_start(everything_dropped, tokenizer, 10) == 0


def test_without_a_bound_the_whole_text_is_tokenized() -> None:
    wordpiece = _wrap(Tokenizer(models.WordPiece({"[UNK]": 0, "a": 1}, unk_token="[UNK]")))
    text = "a " * 100_000
    assert truncation_start(text, wordpiece, 3) == 0
    assert encode_prompt(wordpiece, text, False, 3, MAX_MODEL_LEN) == wordpiece.encode(text)
