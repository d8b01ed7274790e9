"""The offline API's chat prompt for a gpt-oss model: rendered in harmony, as token ids, so
that text the user wrote stays text even where it spells a special token."""

from __future__ import annotations

import os

import pytest

from app.harmony.vocab import ENCODINGS_BASE_ENV
from app.llm import LLM
from app.tokenizer import Tokenizer
from app.tokenizer_loader import load_tokenizer
from tests._gpt_oss_tokenizer import gpt_oss_model_dir

USER_TEXT = "Say <|start|> and <|end|> literally, please."


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory: pytest.TempPathFactory) -> Tokenizer:
    root = tmp_path_factory.mktemp("gpt-oss")
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv(ENCODINGS_BASE_ENV, "")
        patch.delenv(ENCODINGS_BASE_ENV)
        patch.setenv("TANDEM_CACHE_DIR", os.fspath(root / "cache"))
        loaded = load_tokenizer(gpt_oss_model_dir(root))
    assert loaded is not None and loaded.harmony is not None
    return loaded


def _llm(tokenizer: Tokenizer) -> LLM:
    """An LLM with only its tokenizer: chat prompts need nothing else."""
    llm = LLM.__new__(LLM)
    llm.tokenizer = tokenizer
    return llm


def test_chat_prompt_is_harmony_token_ids(tokenizer: Tokenizer) -> None:
    llm = _llm(tokenizer)
    prompt_ids = llm.chat_prompt(USER_TEXT)
    assert isinstance(prompt_ids, list)
    text = tokenizer.decode(prompt_ids)
    assert text.startswith("<|start|>system<|message|>")
    assert text.endswith(f"<|start|>user<|message|>{USER_TEXT}<|end|><|start|>assistant")
    start_id = tokenizer.token_to_id("<|start|>")
    assert prompt_ids.count(start_id) == 3  # system, user, assistant: none from the user
    assert llm.apply_chat_template(USER_TEXT) == text


def test_other_models_keep_their_chat_template(tokenizer: Tokenizer) -> None:
    plain = Tokenizer(tokenizer.raw, chat_template="{{ messages[0]['content'] }}!")
    llm = _llm(plain)
    assert llm.chat_prompt("hi") == llm.apply_chat_template("hi") == "hi!"
