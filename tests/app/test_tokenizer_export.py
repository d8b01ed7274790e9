"""`tandem export-tokenizer`: transformers loads the directory and tokenizes, decodes and
renders the chat template exactly as tandem does."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import transformers

from app.cli import main
from app.tokenizer import Tokenizer
from app.tokenizer_export import export_tokenizer, tokenizer_info
from app.tokenizer_loader import load_tokenizer
from tests._embedded_model import needs_embedded_model

TEXTS = [
    "Hello world! 123 4567",
    "ünïcødé and emoji 😀 ok",
    "<|im_start|>user\nhi<|im_end|>\n",
    "  leading, trailing  \n\ttabs",
    "x=1;\ny = [1, 2]",
]
CHAT = [
    {"role": "system", "content": "Be brief."},
    {"role": "user", "content": "Hi"},
    {"role": "assistant", "content": "Hello!"},
    {"role": "user", "content": "Bye"},
]


def _assert_same(tokenizer: Tokenizer, directory: Path) -> None:
    hf = transformers.AutoTokenizer.from_pretrained(str(directory))
    for text in TEXTS:
        with_specials = tokenizer.encode(text, add_special_tokens=True)
        assert hf.encode(text) == with_specials, text
        assert hf.encode(text, add_special_tokens=False) == tokenizer.encode(text), text
        assert hf.decode(with_specials) == tokenizer.decode(with_specials)
        assert hf.decode(with_specials, skip_special_tokens=True) == tokenizer.decode(
            with_specials, skip_special_tokens=True
        )
    if tokenizer.chat_template:
        assert hf.apply_chat_template(
            CHAT, tokenize=False, add_generation_prompt=True
        ) == tokenizer.apply_chat_template(CHAT, add_generation_prompt=True)
    assert hf.eos_token_id == tokenizer.eos_token_id


@needs_embedded_model
def test_the_embedded_gguf_tokenizer_round_trips_through_the_cli(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["export-tokenizer", "--model", "default", str(tmp_path)]) == 0
    assert "tokenizer_config.json" in capsys.readouterr().out
    tokenizer = load_tokenizer("default")
    _assert_same(tokenizer, tmp_path)
    generation = json.loads((tmp_path / "generation_config.json").read_text())
    assert generation["eos_token_id"] == tokenizer.eos_token_id


@needs_embedded_model
def test_bos_insertion_becomes_a_post_processor(tmp_path: Path) -> None:
    base = load_tokenizer("default")
    with_bos = Tokenizer(
        base.raw,
        bos_token_id=base.bos_token_id,
        eos_token_id=base.eos_token_id,
        extra_eos_token_ids=[0],
        add_bos_token=True,
        chat_template=base.chat_template,
    )
    export_tokenizer(with_bos, str(tmp_path), {"temperature": 0.2})
    _assert_same(with_bos, tmp_path)
    generation = json.loads((tmp_path / "generation_config.json").read_text())
    assert generation == {
        "temperature": 0.2,
        "eos_token_id": [base.eos_token_id, 0],
        "bos_token_id": base.bos_token_id,
    }


@needs_embedded_model
def test_tokenizer_info_carries_what_remote_tokenizers_read() -> None:
    tokenizer = load_tokenizer("default")
    info = tokenizer_info(tokenizer, 4096)
    assert info["eos_token"] == "<|im_end|>" and info["bos_token"] == "<|im_start|>"
    assert info["model_max_length"] == 4096 and info["chat_template"] == tokenizer.chat_template
    assert info["added_tokens_decoder"]["2"] == "<|im_end|>"
    json.dumps(info)  # served as JSON


def test_a_model_without_tokenizer_is_a_clear_error(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["export-tokenizer", "--model", "dummy:qwen3-0.6b", str(tmp_path)]) == 2
    assert "has no tokenizer" in capsys.readouterr().err
