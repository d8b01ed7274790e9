from __future__ import annotations

import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from actors.frontend.detokenizer import (
    MAX_UNREAD_TOKENS,
    NUM_CONTEXT_TOKENS,
    IncrementalDetokenizer,
)
from tests._embedded_model import needs_embedded_model
from tests.actors._tokenizer_fixtures import (
    byte_token_id,
    smollm2_tokenizer,
    tiny_sentencepiece_tokenizer,
    tiny_tokenizer,
)

FFFD = "\ufffd"
MULTILINGUAL = [
    "family 👨‍👩‍👧‍👦 and flag 🏳️‍🌈",
    "中文文本，日本語のテキスト",
    "héllo wörld, naïve façade, Ångström",
    "x €€€€€€€€€€€€ y",
    "mixed: Δ = 3·10⁻⁴, ∑ x² ≤ ∞ 🙂",
]


def stream_pieces(tokenizer, token_ids, prompt_ids=(), skip_special_tokens=True, chunk=1):
    detok = IncrementalDetokenizer(tokenizer, prompt_ids, skip_special_tokens)
    pieces = [detok.push(token_ids[i : i + chunk]) for i in range(0, len(token_ids), chunk)]
    return pieces, detok.flush()


def assert_streams_like_full_decode(tokenizer, token_ids, prompt_ids=(), skip=True, chunk=1):
    pieces, tail = stream_pieces(tokenizer, token_ids, prompt_ids, skip, chunk)
    full = tokenizer.decode(token_ids, skip_special_tokens=skip)
    emitted = ""
    for piece in pieces:
        emitted += piece
        # Text once streamed is never taken back: every prefix is final.
        assert full.startswith(emitted), (token_ids, pieces, full)
    assert emitted + tail == full
    return pieces, tail


@pytest.mark.parametrize("text", MULTILINGUAL)
def test_characters_split_over_byte_tokens_stream_without_replacement_chars(text):
    tokenizer = tiny_tokenizer()
    token_ids = tokenizer.encode(text).ids
    assert len(token_ids) > len(text.split())  # multi-byte characters span several tokens
    pieces, tail = assert_streams_like_full_decode(tokenizer, token_ids)
    assert "".join(pieces) == text and tail == ""
    assert not any(FFFD in piece for piece in pieces)


def test_bytes_are_held_until_the_character_completes():
    detok = IncrementalDetokenizer(tiny_tokenizer(), (), skip_special_tokens=True)
    assert detok.push([byte_token_id(0xE2)]) == ""
    assert detok.push([byte_token_id(0x82)]) == ""
    assert detok.num_unread_tokens == 2
    assert detok.push([byte_token_id(0xAC)]) == "€"
    assert detok.num_unread_tokens == 0


def test_flush_releases_an_unfinished_character_as_the_full_decode_does():
    tokenizer = tiny_tokenizer()
    ids = [byte_token_id(ord("a")), byte_token_id(0xE2), byte_token_id(0x82)]
    pieces, tail = stream_pieces(tokenizer, ids)
    assert pieces == ["a", "", ""]
    assert tail == FFFD == tokenizer.decode(ids[1:])


def test_tokens_that_each_end_inside_a_character_are_held_then_released_whole():
    tokenizer = tiny_tokenizer()
    token_ids = tokenizer.encode("€" * 12).ids
    assert len(token_ids) == 13  # [E2] [82 AC E2] x 11 [82 AC]: every boundary splits a "€"
    pieces, tail = stream_pieces(tokenizer, token_ids)
    assert pieces[:-1] == [""] * 12 and pieces[-1] == "€" * 12 and tail == ""


def test_a_run_of_invalid_bytes_is_released_without_growing_the_window():
    tokenizer = tiny_tokenizer()
    detok = IncrementalDetokenizer(tokenizer, (), skip_special_tokens=True)
    ids = [byte_token_id(0xE2)] * 40  # lead bytes that no continuation byte ever follows
    emitted = ""
    for token_id in ids:
        emitted += detok.push([token_id])
        assert detok.num_unread_tokens <= MAX_UNREAD_TOKENS + 1
    assert emitted and set(emitted) == {FFFD}
    assert emitted + detok.flush() == tokenizer.decode(ids) == FFFD * 40


@pytest.mark.parametrize("skip", [True, False])
def test_special_tokens_follow_skip_special_tokens(skip):
    tokenizer = tiny_tokenizer()
    eos = tokenizer.token_to_id("<eos>")
    ids = tokenizer.encode("hello").ids + [eos] * 30 + tokenizer.encode(" wörld").ids
    pieces, tail = assert_streams_like_full_decode(tokenizer, ids, skip=skip)
    expected = "hello" + ("" if skip else "<eos>" * 30) + " wörld"
    assert "".join(pieces) + tail == expected


def test_prompt_context_is_used_but_an_unfinished_prompt_character_is_not_completed():
    tokenizer = tiny_tokenizer()
    prompt = tokenizer.encode("say:").ids + [byte_token_id(0xE2)]
    output = [byte_token_id(0x82), byte_token_id(0xAC)] + tokenizer.encode(" ok").ids
    assert_streams_like_full_decode(tokenizer, output, prompt_ids=prompt)


class CountingDecoder:
    def __init__(self, tokenizer):
        self.tokenizer = tokenizer
        self.decoded_lengths: list[int] = []

    def decode(self, ids, skip_special_tokens=True):
        self.decoded_lengths.append(len(ids))
        return self.tokenizer.decode(ids, skip_special_tokens=skip_special_tokens)


def test_each_push_decodes_a_small_window_not_the_whole_output():
    counting = CountingDecoder(tiny_tokenizer())
    ids = tiny_tokenizer().encode("héllo wörld 👨‍👩‍👧 中文 " * 40).ids
    assert len(ids) > 1000
    pieces, tail = stream_pieces(counting, ids, prompt_ids=ids[:50])
    assert "".join(pieces) + tail == tiny_tokenizer().decode(ids)
    # The context plus the tokens of one character (at most four bytes) and the new one.
    assert max(counting.decoded_lengths) <= NUM_CONTEXT_TOKENS + 4 + 1
    assert len(counting.decoded_lengths) <= 2 * len(ids) + 2


@settings(max_examples=150, deadline=None)
@given(text=st.text(max_size=40), chunk=st.integers(1, 4))
def test_any_text_streams_back_exactly(text, chunk):
    tokenizer = tiny_tokenizer()
    ids = tokenizer.encode(text).ids
    pieces, tail = assert_streams_like_full_decode(tokenizer, ids, chunk=chunk)
    assert "".join(pieces) + tail == tokenizer.decode(ids)
    if FFFD not in text:
        assert not any(FFFD in piece for piece in pieces)


@settings(max_examples=300, deadline=None)
@given(
    ids=st.lists(st.integers(0, 264), max_size=40),
    prompt=st.lists(st.integers(0, 264), max_size=6),
    skip=st.booleans(),
    chunk=st.integers(1, 3),
)
def test_random_token_ids_stream_like_the_full_decode(ids, prompt, skip, chunk):
    assert tiny_tokenizer().get_vocab_size() == 265
    assert_streams_like_full_decode(tiny_tokenizer(), ids, prompt, skip, chunk)


@settings(max_examples=150, deadline=None)
@given(text=st.text(max_size=30))
def test_byte_fallback_tokenizer_streams_valid_text_exactly(text):
    tokenizer = tiny_sentencepiece_tokenizer()
    ids = tokenizer.encode(text).ids
    pieces, _ = assert_streams_like_full_decode(tokenizer, ids)
    if FFFD not in text:
        assert not any(FFFD in piece for piece in pieces)


def test_byte_fallback_tokenizer_keeps_spaces_around_skipped_special_tokens():
    tokenizer = tiny_sentencepiece_tokenizer()
    ids = tokenizer.encode("a").ids + [2] * 20 + tokenizer.encode(" hello 😀").ids
    pieces, tail = assert_streams_like_full_decode(tokenizer, ids)
    assert "".join(pieces) + tail == "a  hello 😀"


def test_prompt_context_keeps_the_space_a_leading_space_stripping_decoder_drops():
    tokenizer = tiny_sentencepiece_tokenizer()
    output = tokenizer.encode("hello world").ids  # "▁hello", "▁world"
    assert tokenizer.decode(output) == "hello world"
    pieces, tail = stream_pieces(tokenizer, output, prompt_ids=tokenizer.encode("say").ids)
    assert "".join(pieces) + tail == " hello world"  # prompt + output reads "say hello world"


@pytest.mark.slow
@needs_embedded_model
@pytest.mark.parametrize("text", MULTILINGUAL)
def test_real_tokenizer_multilingual_text_streams_without_replacement_chars(text):
    tokenizer = smollm2_tokenizer()
    ids = tokenizer.encode(text).ids
    pieces, tail = assert_streams_like_full_decode(tokenizer, ids)
    assert "".join(pieces) + tail == text
    assert not any(FFFD in piece for piece in pieces)


@pytest.mark.slow
@needs_embedded_model
def test_real_tokenizer_random_token_sequences():
    tokenizer = smollm2_tokenizer()
    vocab_size = tokenizer.get_vocab_size()
    rng = random.Random(1234)
    # Bias towards the byte-fragment tokens that make multi-byte characters.
    fragment_ids = [i for i in range(vocab_size) if FFFD in tokenizer.decode([i])]
    assert len(fragment_ids) > 100
    for _ in range(400):
        length = rng.randrange(1, 48)
        ids = [
            rng.choice(fragment_ids) if rng.random() < 0.4 else rng.randrange(vocab_size)
            for _ in range(length)
        ]
        prompt = [rng.randrange(vocab_size) for _ in range(rng.randrange(0, 8))]
        assert_streams_like_full_decode(
            tokenizer, ids, prompt, skip=rng.random() < 0.5, chunk=rng.randrange(1, 4)
        )
