"""gpt-oss's harmony format: the offline vocabulary, model detection, and prompts rendered
from OpenAI messages, compared with the conversation built directly in openai-harmony."""

from __future__ import annotations

import json
import os

import pytest
from openai_harmony import (
    Author,
    ChannelConfig,
    Conversation,
    DeveloperContent,
    Message,
    ReasoningEffort,
    Role,
    SystemContent,
    ToolDescription,
)

from actors.protocol.model_source import ModelLoadError
from app.harmony.model import HarmonyFormat, is_gpt_oss
from app.harmony.render import HarmonyRequestError, render_prompt
from app.harmony.vocab import (
    ENCODINGS_BASE_ENV,
    O200K_SHA256,
    VOCAB_FILE_NAME,
    VocabMismatch,
    provide_vocab_file,
    tiktoken_vocab_bytes,
)
from app.tokenizer import Tokenizer
from app.tokenizer_loader import load_tokenizer
from tests._gpt_oss_tokenizer import FIXTURE_DIR, gpt_oss_model_dir, gpt_oss_tokenizer_dir

TODAY = "2025-08-05"
WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Current weather in a city",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string"}},
            "required": ["city"],
        },
    },
}


def _unset_encodings_base(patch: pytest.MonkeyPatch) -> None:
    """Unset for the test, and restored after it even when the code under test sets it."""
    patch.setenv(ENCODINGS_BASE_ENV, "")
    patch.delenv(ENCODINGS_BASE_ENV)


@pytest.fixture(scope="module")
def vocab() -> dict[str, int]:
    tokenizer = Tokenizer.from_hf_dir(gpt_oss_tokenizer_dir())
    return tokenizer.raw.get_vocab(with_added_tokens=False)


@pytest.fixture(scope="module")
def harmony(vocab: dict[str, int], tmp_path_factory: pytest.TempPathFactory) -> HarmonyFormat:
    with pytest.MonkeyPatch.context() as patch:
        _unset_encodings_base(patch)
        return HarmonyFormat.from_vocab(vocab, str(tmp_path_factory.mktemp("harmony")))


def test_vocab_file_is_byte_exact_o200k(vocab: dict[str, int]) -> None:
    import hashlib
    import lzma

    data = tiktoken_vocab_bytes(vocab)
    assert hashlib.sha256(data).hexdigest() == O200K_SHA256
    assert data == lzma.decompress((FIXTURE_DIR / (VOCAB_FILE_NAME + ".xz")).read_bytes())


def test_foreign_vocab_is_refused(vocab: dict[str, int]) -> None:
    swapped = dict(vocab)
    a, b = (
        next(t for t, i in vocab.items() if i == 1000),
        next(t for t, i in vocab.items() if i == 1001),
    )
    swapped[a], swapped[b] = 1001, 1000
    with pytest.raises(VocabMismatch, match="not o200k_base"):
        tiktoken_vocab_bytes(swapped)
    with pytest.raises(VocabMismatch, match="no token of id 5"):
        tiktoken_vocab_bytes({t: i for t, i in vocab.items() if i != 5})


def test_vocab_file_written_once_and_reused(
    vocab: dict[str, int], tmp_path: os.PathLike[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    _unset_encodings_base(monkeypatch)
    directory = provide_vocab_file(vocab, os.path.join(tmp_path, "cache"))
    path = os.path.join(directory, VOCAB_FILE_NAME)
    first = os.stat(path).st_mtime_ns
    assert provide_vocab_file(vocab, directory) == directory
    assert os.stat(path).st_mtime_ns == first  # a verified file is not written again
    monkeypatch.setenv(ENCODINGS_BASE_ENV, directory)
    assert provide_vocab_file(vocab, os.path.join(tmp_path, "elsewhere")) == directory


def test_gpt_oss_detection(tmp_path: os.PathLike[str]) -> None:
    model_dir = gpt_oss_model_dir(tmp_path)
    assert is_gpt_oss(model_dir)
    assert is_gpt_oss("dummy:gpt-oss-20b") and is_gpt_oss("dummy:gpt-oss-120b")
    assert not is_gpt_oss("dummy:smollm2-135m")
    assert not is_gpt_oss(gpt_oss_tokenizer_dir())  # a tokenizer alone is not a model
    other = os.path.join(tmp_path, "llama")
    os.makedirs(other)
    with open(os.path.join(other, "config.json"), "w") as f:
        json.dump({"model_type": "llama"}, f)
    assert not is_gpt_oss(other)


def test_tokenizer_of_gpt_oss_model_carries_harmony(
    tmp_path: os.PathLike[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    _unset_encodings_base(monkeypatch)
    monkeypatch.setenv("TANDEM_CACHE_DIR", os.path.join(tmp_path, "cache"))
    model_dir = gpt_oss_model_dir(tmp_path)
    tokenizer = load_tokenizer(model_dir)
    assert isinstance(tokenizer.harmony, HarmonyFormat)
    assert set(tokenizer.harmony.stop_token_ids) == {
        tokenizer.token_to_id("<|return|>"),
        tokenizer.token_to_id("<|call|>"),
    }
    text = "Hello, wörld! 12345 <|start|>"
    assert tokenizer.harmony.encoding.encode(text, allowed_special="all") == tokenizer.encode(text)
    plain = load_tokenizer("dummy:gpt-oss-20b", gpt_oss_tokenizer_dir())
    assert isinstance(plain.harmony, HarmonyFormat)  # dummy preset + --tokenizer
    assert load_tokenizer(gpt_oss_tokenizer_dir()).harmony is None  # no config.json: not gpt-oss


def test_gpt_oss_model_with_foreign_tokenizer_fails_to_load(tmp_path: os.PathLike[str]) -> None:
    model_dir = gpt_oss_model_dir(tmp_path)
    with open(os.path.join(model_dir, "tokenizer.json")) as f:
        data = json.load(f)
    data["model"]["vocab"] = dict(list(data["model"]["vocab"].items())[:1000])
    data["model"]["merges"] = []
    with open(os.path.join(model_dir, "tokenizer.json"), "w") as f:
        json.dump(data, f)
    with pytest.raises(ModelLoadError, match="o200k_harmony"):
        load_tokenizer(model_dir)


def _system(effort: ReasoningEffort | None = None, tools: bool = False) -> Message:
    content = SystemContent.new().with_conversation_start_date(TODAY)
    if effort is not None:
        content = content.with_reasoning_effort(effort)
    if not tools:
        content = content.with_channel_config(ChannelConfig.require_channels(["analysis", "final"]))
    return Message.from_role_and_content(Role.SYSTEM, content)


def _expected(harmony: HarmonyFormat, messages: list[Message]) -> list[int]:
    return harmony.encoding.render_conversation_for_completion(
        Conversation.from_messages(messages), Role.ASSISTANT
    )


def _render(harmony: HarmonyFormat, messages: list[dict], **kwargs: object) -> list[int]:
    return render_prompt(harmony.encoding, messages, today=TODAY, **kwargs)


def test_system_and_user(harmony: HarmonyFormat) -> None:
    ids = _render(
        harmony,
        [{"role": "system", "content": "Answer in French."}, {"role": "user", "content": "Hi"}],
    )
    developer = DeveloperContent.new().with_instructions("Answer in French.")
    assert ids == _expected(
        harmony,
        [
            _system(),
            Message.from_role_and_content(Role.DEVELOPER, developer),
            Message.from_role_and_content(Role.USER, "Hi"),
        ],
    )
    text = harmony.encoding.decode(ids)
    assert "Current date: 2025-08-05" in text and "# Instructions\n\nAnswer in French." in text
    assert "Valid channels: analysis, final." in text and text.endswith("<|start|>assistant")


def test_developer_instructions_and_parts(harmony: HarmonyFormat) -> None:
    ids = _render(
        harmony,
        [
            {"role": "developer", "content": "Be brief."},
            {
                "role": "user",
                "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}],
            },
        ],
    )
    developer = DeveloperContent.new().with_instructions("Be brief.")
    assert ids == _expected(
        harmony,
        [
            _system(),
            Message.from_role_and_content(Role.DEVELOPER, developer),
            Message.from_role_and_content(Role.USER, "a\nb"),
        ],
    )


def test_tools(harmony: HarmonyFormat) -> None:
    ids = _render(harmony, [{"role": "user", "content": "Weather in Paris?"}], tools=[WEATHER])
    function = WEATHER["function"]
    developer = DeveloperContent.new().with_function_tools(
        [ToolDescription.new(function["name"], function["description"], function["parameters"])]
    )
    assert ids == _expected(
        harmony,
        [
            _system(tools=True),
            Message.from_role_and_content(Role.DEVELOPER, developer),
            Message.from_role_and_content(Role.USER, "Weather in Paris?"),
        ],
    )
    text = harmony.encoding.decode(ids)
    assert "type get_weather = (_: {" in text and "commentary channel: 'functions'" in text


@pytest.mark.parametrize(
    ("effort", "expected"), [("low", ReasoningEffort.LOW), ("high", ReasoningEffort.HIGH)]
)
def test_reasoning_effort(harmony: HarmonyFormat, effort: str, expected: ReasoningEffort) -> None:
    ids = _render(harmony, [{"role": "user", "content": "Hi"}], reasoning_effort=effort)
    assert ids == _expected(
        harmony, [_system(expected), Message.from_role_and_content(Role.USER, "Hi")]
    )
    assert f"Reasoning: {effort}" in harmony.encoding.decode(ids)


def test_unknown_reasoning_effort(harmony: HarmonyFormat) -> None:
    with pytest.raises(HarmonyRequestError, match="low, medium, high") as caught:
        _render(harmony, [{"role": "user", "content": "Hi"}], reasoning_effort="extreme")
    assert caught.value.param == "reasoning_effort"


def test_multi_turn_with_tool_call_and_result(harmony: HarmonyFormat) -> None:
    messages = [
        {"role": "user", "content": "What is 2+2?"},
        {"role": "assistant", "content": "4", "reasoning_content": "Easy sum."},
        {"role": "user", "content": "Weather in Paris?"},
        {
            "role": "assistant",
            "content": None,
            "reasoning_content": "Need the tool.",
            "tool_calls": [
                {
                    "id": "call_1",
                    "type": "function",
                    "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'},
                }
            ],
        },
        {"role": "tool", "tool_call_id": "call_1", "content": '{"temp_c": 21}'},
    ]
    ids = _render(harmony, messages, tools=[WEATHER])
    function = WEATHER["function"]
    developer = DeveloperContent.new().with_function_tools(
        [ToolDescription.new(function["name"], function["description"], function["parameters"])]
    )
    tool_author = Author.new(Role.TOOL, "functions.get_weather")
    expected = [
        _system(tools=True),
        Message.from_role_and_content(Role.DEVELOPER, developer),
        Message.from_role_and_content(Role.USER, "What is 2+2?"),
        Message.from_role_and_content(Role.ASSISTANT, "4").with_channel("final"),
        Message.from_role_and_content(Role.USER, "Weather in Paris?"),
        Message.from_role_and_content(Role.ASSISTANT, "Need the tool.").with_channel("analysis"),
        Message.from_role_and_content(Role.ASSISTANT, '{"city": "Paris"}')
        .with_channel("commentary")
        .with_recipient("functions.get_weather")
        .with_content_type("json"),
        Message.from_author_and_content(tool_author, '{"temp_c": 21}').with_channel("commentary"),
    ]
    assert ids == _expected(harmony, expected)
    text = harmony.encoding.decode(ids)
    # The finished turn's analysis is dropped; the open turn's stays.
    assert "Easy sum." not in text and "Need the tool." in text
    assert "<|start|>functions.get_weather" in text


def test_tool_message_without_matching_call(harmony: HarmonyFormat) -> None:
    messages = [
        {"role": "user", "content": "Hi"},
        {"role": "tool", "tool_call_id": "call_missing", "content": "42"},
    ]
    with pytest.raises(HarmonyRequestError, match="call_missing") as caught:
        _render(harmony, messages)
    assert caught.value.param == "messages.1.tool_call_id"
