from __future__ import annotations

import random
import threading
import time

import pytest
from tokenizers import Tokenizer as RawTokenizer
from tokenizers import models

from app.chat_template import ChatTemplateError
from app.tokenizer import Tokenizer
from gpu.weights.gguf_file import GGUFFile
from tests._embedded_model import embedded_gguf_path
from tests._hf_reference import hf_reference_dir, hf_reference_tokenizer

TRICKY_TEXTS = [
    "Hello, world!",
    "a  1",
    "x =   42",
    "col1\t\t2",
    "a\n\n3",
    "The year 2024 had 366 days; 3.14159 ≈ π.",
    "naïve café déjà vu — Ünïcödé",
    "日本語のテキストと中文文本，한국어 텍스트",
    "family: 👨‍👩‍👧‍👦, flags: 🇫🇷🇯🇵, skin: 👍🏽, zwj: 🏳️‍🌈",
    "def f(x):\n    return x ** 2  # square\n\n\nprint(f(10))",
    "if (a != b) { return a->c[i++]; }\r\n",
    "   leading and trailing spaces   ",
    "\n\n\n",
    "",
    "tabs\tand\u00a0non-breaking\u2003spaces",
    "<|im_start|>user\nHi there<|im_end|>\n<|im_start|>assistant\n",
    "text<|endoftext|>more<repo_name>x<file_sep>",
    "don't won't I'm they're we've it'll he'd",
    "ALL CAPS and MiXeD CaSe 123abc456",
]


def _random_texts(count: int, seed: int = 0) -> list[str]:
    rng = random.Random(seed)
    pool = (
        list("abcXYZ019")
        + [" ", "  ", "\t", "\n", "\r\n", "'", ".", ",", "-", "_", "#", "("]
        + ["é", "ß", "ñ", "中", "語", "😀", "\u200d", "👍", "🏽", "\u00a0", "<|im_end|>"]
    )
    return ["".join(rng.choice(pool) for _ in range(rng.randint(0, 30))) for _ in range(count)]


@pytest.fixture(scope="module")
def gguf_metadata():
    return GGUFFile(embedded_gguf_path()).metadata


@pytest.fixture(scope="module")
def tokenizer(gguf_metadata):
    start = time.perf_counter()
    tok = Tokenizer.from_gguf(gguf_metadata)
    print(f"\nTokenizer.from_gguf: {(time.perf_counter() - start) * 1000:.0f} ms")
    return tok


def test_special_tokens_and_ids(tokenizer):
    assert tokenizer.vocab_size == 49152
    assert tokenizer.bos_token_id == 1 and tokenizer.id_to_token(1) == "<|im_start|>"
    assert tokenizer.eos_token_id == 2 and tokenizer.id_to_token(2) == "<|im_end|>"
    assert tokenizer.eos_token_ids == (2,)
    assert tokenizer.special_token_ids == frozenset(range(17))  # the 17 CONTROL tokens
    assert tokenizer.add_bos_token is False
    assert tokenizer.chat_template and "<|im_start|>" in tokenizer.chat_template
    with pytest.raises(ValueError, match="outside the vocabulary"):
        tokenizer.id_to_token(10**6)


def test_llama_cpp_splits_whitespace_runs_before_digits(tokenizer):
    # llama.cpp's `smollm` pre-tokenizer isolates digits before the GPT-2 split, so a run of
    # spaces before a digit stays one piece ('ĠĠ'), unlike plain GPT-2 ('Ġ', 'Ġ').
    ids = tokenizer.encode("a  1")
    assert [tokenizer.id_to_token(i) for i in ids] == ["a", "ĠĠ", "1"]
    pieces = tokenizer.raw.pre_tokenizer.pre_tokenize_str
    assert [p for p, _ in pieces("x =   42")] == ["x", "Ġ=", "ĠĠĠ", "4", "2"]
    assert [p for p, _ in pieces("col1\t\t2")] == ["col", "1", "ĉĉ", "2"]
    assert [p for p, _ in pieces("a\n\n3")] == ["a", "ĊĊ", "3"]


def test_special_tokens_in_text_stay_whole(tokenizer):
    ids = tokenizer.encode("<|im_start|>user\nHi<|im_end|>")
    assert ids[0] == 1 and ids[-1] == 2 and 1 not in ids[1:-1]
    assert tokenizer.decode(ids, skip_special_tokens=True) == "user\nHi"
    assert tokenizer.decode(ids) == "<|im_start|>user\nHi<|im_end|>"


def test_round_trip_and_token_bytes(tokenizer):
    for text in TRICKY_TEXTS + _random_texts(300):
        ids = tokenizer.encode(text)
        assert tokenizer.decode(ids) == text
        assert b"".join(tokenizer.token_bytes(i) for i in ids) == text.encode("utf-8")


def test_token_bytes_of_a_split_character(tokenizer):
    ids = tokenizer.encode("😀")
    parts = [tokenizer.token_bytes(i) for i in ids]
    assert b"".join(parts) == "😀".encode()
    assert tokenizer.token_bytes(tokenizer.encode(" the")[0]) == b" the"


def test_add_special_tokens_follows_add_bos(gguf_metadata):
    plain = Tokenizer.from_gguf(gguf_metadata)
    assert plain.encode("hi", add_special_tokens=True) == plain.encode("hi")
    with_bos = Tokenizer.from_gguf({**gguf_metadata, "tokenizer.ggml.add_bos_token": True})
    assert with_bos.encode("hi", add_special_tokens=True) == [1, *plain.encode("hi")]


@pytest.mark.parametrize(
    ("pre", "pieces"),
    [
        ("smollm", ["abc", "Ġ", "1", "2", "3", "4", "5"]),
        ("gpt-2", ["abc", "Ġ12345"]),
        ("llama-bpe", ["abc", "Ġ", "123", "45"]),
        ("qwen2", ["abc", "Ġ", "1", "2", "3", "4", "5"]),
        ("default", ["abc", "Ġ", "123", "45"]),
    ],
)
def test_pre_tokenizer_names(gguf_metadata, pre, pieces):
    tok = Tokenizer.from_gguf({**gguf_metadata, "tokenizer.ggml.pre": pre})
    assert [p for p, _ in tok.raw.pre_tokenizer.pre_tokenize_str("abc 12345")] == pieces
    assert tok.decode(tok.encode("abc 12345")) == "abc 12345"


def test_llama3_contractions_and_newlines(gguf_metadata):
    tok = Tokenizer.from_gguf({**gguf_metadata, "tokenizer.ggml.pre": "llama-bpe"})
    pieces = [p for p, _ in tok.raw.pre_tokenizer.pre_tokenize_str("I'M here\n\n  ok")]
    assert pieces == ["I", "'M", "Ġhere", "ĊĊ", "Ġ", "Ġok"]


def test_unsupported_tokenizer_metadata(gguf_metadata):
    with pytest.raises(ValueError, match="pre-tokenizer 'mystery'.*smollm"):
        Tokenizer.from_gguf({**gguf_metadata, "tokenizer.ggml.pre": "mystery"})
    with pytest.raises(ValueError, match="tokenizer model 'llama'.*gpt2"):
        Tokenizer.from_gguf({**gguf_metadata, "tokenizer.ggml.model": "llama"})


def test_chatml_fallback_without_a_template(tokenizer):
    bare = Tokenizer(tokenizer.raw, bos_token_id=1, eos_token_id=2, chat_template=None)
    prompt = bare.apply_chat_template([{"role": "user", "content": "Hi"}])
    assert prompt == "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n"


def test_no_template_and_no_chatml_is_a_clear_error():
    raw = RawTokenizer(models.BPE(vocab={"a": 0, "b": 1}, merges=[]))
    with pytest.raises(ChatTemplateError, match="no chat template"):
        Tokenizer(raw).apply_chat_template([{"role": "user", "content": "a"}])


# Against transformers (the cached reference carries the llama.cpp pre-tokenizer fix).


@pytest.mark.slow
def test_ids_equal_transformers(tokenizer):
    hf = hf_reference_tokenizer()
    mismatches = [
        text
        for text in TRICKY_TEXTS + _random_texts(1000, seed=1)
        if tokenizer.encode(text) != hf.encode(text, add_special_tokens=False)
    ]
    assert mismatches == []


@pytest.mark.slow
def test_hf_dir_tokenizer_equals_gguf_tokenizer(tokenizer):
    from_dir = Tokenizer.from_hf_dir(hf_reference_dir())
    assert from_dir.vocab_size == tokenizer.vocab_size
    assert (from_dir.bos_token_id, from_dir.eos_token_id) == (1, 2)
    assert from_dir.eos_token_ids == (2,)
    assert from_dir.special_token_ids == tokenizer.special_token_ids
    assert from_dir.chat_template == tokenizer.chat_template
    assert from_dir.add_bos_token is False
    for text in TRICKY_TEXTS + _random_texts(200, seed=2):
        assert from_dir.encode(text) == tokenizer.encode(text)
    extra = Tokenizer.from_hf_dir(hf_reference_dir(), generation_config={"eos_token_id": [2, 0]})
    assert extra.eos_token_ids == (2, 0)


CONVERSATIONS = [
    [{"role": "user", "content": "What is the capital of France?"}],
    [
        {"role": "system", "content": "You are terse."},
        {"role": "user", "content": "Name a prime > 10."},
    ],
    [
        {"role": "system", "content": "Réponds en français. 🙂"},
        {"role": "user", "content": "Bonjour"},
        {"role": "assistant", "content": "Salut !"},
        {"role": "user", "content": "Ça va ?\n\n  1  2"},
    ],
]


@pytest.mark.slow
@pytest.mark.parametrize("add_generation_prompt", [True, False])
@pytest.mark.parametrize("conversation", CONVERSATIONS)
def test_chat_template_equals_transformers(tokenizer, conversation, add_generation_prompt):
    hf = hf_reference_tokenizer()
    ours = tokenizer.apply_chat_template(conversation, add_generation_prompt=add_generation_prompt)
    theirs = hf.apply_chat_template(
        conversation, tokenize=False, add_generation_prompt=add_generation_prompt
    )
    assert ours == theirs
    assert tokenizer.encode(ours) == hf.encode(theirs, add_special_tokens=False)


@pytest.mark.slow
def test_list_of_parts_content_equals_joined_string(tokenizer):
    hf = hf_reference_tokenizer()
    parts = [
        {
            "role": "user",
            "content": [{"type": "text", "text": "Line one"}, {"type": "text", "text": "line two"}],
        }
    ]
    joined = [{"role": "user", "content": "Line one\nline two"}]
    assert tokenizer.apply_chat_template(parts) == hf.apply_chat_template(
        joined, tokenize=False, add_generation_prompt=True
    )


def test_hf_dir_reads_bos_from_post_processor_and_named_templates(tokenizer, tmp_path):
    import json

    from tokenizers import processors

    raw = RawTokenizer.from_str(tokenizer.raw.to_str())
    raw.post_processor = processors.TemplateProcessing(
        single="<|im_start|> $A", special_tokens=[("<|im_start|>", 1)]
    )
    raw.save(str(tmp_path / "tokenizer.json"))
    config = {
        "bos_token": "<|im_start|>",
        "eos_token": {"content": "<|im_end|>", "special": True},
        "chat_template": [
            {"name": "tool_use", "template": "T"},
            {"name": "default", "template": "D"},
        ],
    }
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(config))
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": [2, 0]}))
    from_dir = Tokenizer.from_hf_dir(tmp_path)
    assert from_dir.add_bos_token is True
    assert from_dir.encode("hi", add_special_tokens=True) == [1, *tokenizer.encode("hi")]
    assert from_dir.encode("hi") == tokenizer.encode("hi")
    assert (from_dir.bos_token_id, from_dir.eos_token_id, from_dir.eos_token_ids) == (1, 2, (2, 0))
    assert from_dir.chat_template == "D"


def test_encoding_a_long_text_lets_other_threads_run(tokenizer):
    """The server tokenizes a long prompt in a worker thread while its event loop sends
    other streams' tokens; an encode that held the GIL would stop the loop for all of it."""
    text = " ".join(TRICKY_TEXTS) * 300  # about 100k tokens: tens of ms
    started, done = threading.Event(), threading.Event()

    def encode() -> None:
        started.set()
        tokenizer.encode(text)
        done.set()

    worker = threading.Thread(target=encode)
    worker.start()
    started.wait()
    time.sleep(0)  # let the worker reach the tokenizer
    ran_meanwhile = 0
    while not done.is_set():
        ran_meanwhile += 1
        time.sleep(0.0005)
    worker.join()
    assert ran_meanwhile > 0
