"""Tokenizer: a `tokenizers.Tokenizer` plus the special tokens and chat template a model
needs, built from GGUF metadata or a Hugging Face directory."""

from __future__ import annotations

import json
import os
import re
from collections.abc import Iterable, Mapping, Sequence
from typing import TYPE_CHECKING, Any

from tokenizers import Tokenizer as RawTokenizer

from app.byte_level import byte_decoder
from app.chat_template import CHATML_TEMPLATE, ChatTemplateError, RenderLimit, render_chat_template
from app.gguf_tokenizer import build_gguf_tokenizer

if TYPE_CHECKING:  # app.harmony builds on this module (its vocabulary reader)
    from app.harmony.model import HarmonyFormat

CHATML_START = "<|im_start|>"
_BYTE_FALLBACK_TOKEN = re.compile(r"<0x([0-9A-Fa-f]{2})>")


class Tokenizer:
    """Text <-> token ids. `encode` always keeps special tokens written in the text whole
    (chat prompts contain them); `add_special_tokens` only controls BOS/EOS insertion."""

    harmony: HarmonyFormat | None = None
    """The harmony chat format of a gpt-oss model (set by app.tokenizer_loader, which
    knows the model): chats are then rendered and parsed by it, not by `chat_template`.
    None for every other model."""

    def __init__(
        self,
        raw: RawTokenizer,
        *,
        bos_token_id: int | None = None,
        eos_token_id: int | None = None,
        extra_eos_token_ids: Iterable[int] = (),
        unk_token_id: int | None = None,
        pad_token_id: int | None = None,
        add_bos_token: bool = False,
        add_eos_token: bool = False,
        chat_template: str | None = None,
        harmony: HarmonyFormat | None = None,
    ) -> None:
        self.raw = raw
        self.harmony = harmony
        self.bos_token_id = bos_token_id
        self.eos_token_id = eos_token_id
        self.unk_token_id = unk_token_id
        self.pad_token_id = pad_token_id
        self.add_bos_token = add_bos_token
        self.add_eos_token = add_eos_token
        self.chat_template = chat_template
        eos_ids = [eos_token_id] if eos_token_id is not None else []
        self.eos_token_ids: tuple[int, ...] = tuple(dict.fromkeys([*eos_ids, *extra_eos_token_ids]))
        added = raw.get_added_tokens_decoder()
        self.special_token_ids: frozenset[int] = frozenset(
            token_id for token_id, token in added.items() if token.special
        )
        self._added_token_ids = frozenset(added)
        self._is_byte_level = "ByteLevel" in repr(raw.decoder)

    # construction

    @classmethod
    def from_gguf(cls, metadata: Mapping[str, Any]) -> Tokenizer:
        """From GGUF metadata (`tokenizer.ggml.*`). Raises ValueError if unsupported."""
        parts = build_gguf_tokenizer(dict(metadata))
        return cls(
            parts.raw,
            bos_token_id=parts.bos_token_id,
            eos_token_id=parts.eos_token_id,
            extra_eos_token_ids=parts.extra_eos_token_ids,
            unk_token_id=parts.unk_token_id,
            pad_token_id=parts.pad_token_id,
            add_bos_token=parts.add_bos_token,
            add_eos_token=parts.add_eos_token,
            chat_template=parts.chat_template,
        )

    @classmethod
    def from_hf_dir(
        cls, path: str | os.PathLike[str], generation_config: Mapping[str, Any] | None = None
    ) -> Tokenizer:
        """From `tokenizer.json` + `tokenizer_config.json` (+ `chat_template.jinja`).
        `generation_config` defaults to the directory's `generation_config.json`; its
        `eos_token_id`s join `eos_token_ids`."""
        path = os.fspath(path)
        return cls.from_json_file(os.path.join(path, "tokenizer.json"), generation_config)

    @classmethod
    def from_json_file(
        cls,
        tokenizer_json: str | os.PathLike[str],
        generation_config: Mapping[str, Any] | None = None,
    ) -> Tokenizer:
        """From a `tokenizer.json` file, with the `tokenizer_config.json` (special tokens,
        chat template) and `generation_config.json` found beside it, when there."""
        path = os.path.dirname(os.path.abspath(os.fspath(tokenizer_json)))
        raw = RawTokenizer.from_file(os.fspath(tokenizer_json))
        config = _read_json_object(os.path.join(path, "tokenizer_config.json"))
        if generation_config is None:
            generation_config = _read_json_object(os.path.join(path, "generation_config.json"))

        def token_id(key: str) -> int | None:
            content = config.get(key)
            if isinstance(content, Mapping):
                content = content.get("content")
            return raw.token_to_id(content) if isinstance(content, str) else None

        bos_id = token_id("bos_token")
        add_bos = config.get("add_bos_token")
        if add_bos is None:  # the post-processor decides (e.g. Llama 3's TemplateProcessing)
            add_bos = bos_id is not None and raw.encode("a").ids[:1] == [bos_id]
        return cls(
            raw,
            bos_token_id=bos_id,
            eos_token_id=token_id("eos_token"),
            extra_eos_token_ids=_as_id_list(generation_config.get("eos_token_id")),
            unk_token_id=token_id("unk_token"),
            pad_token_id=token_id("pad_token"),
            add_bos_token=bool(add_bos),
            add_eos_token=bool(config.get("add_eos_token", False)),
            chat_template=_chat_template(path, config),
        )

    # encoding and decoding

    @property
    def vocab_size(self) -> int:
        return self.raw.get_vocab_size(with_added_tokens=True)

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        # encode_batch, not encode: the same ids, but it lets go of the GIL while it works.
        # A long prompt is tokenized in a worker thread, and `encode` would stop the event
        # loop, and with it every stream the server sends, for the whole of it (a
        # 3,800-token chat on a 2-core Xeon: the loop waited up to 10 ms, with this 1-3 ms).
        ids = self.raw.encode_batch([text], add_special_tokens=False)[0].ids
        if add_special_tokens:
            if self.add_bos_token and self.bos_token_id is not None:
                ids.insert(0, self.bos_token_id)
            if self.add_eos_token and self.eos_token_id is not None:
                ids.append(self.eos_token_id)
        return ids

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = False) -> str:
        return self.raw.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def id_to_token(self, token_id: int) -> str:
        token = self.raw.id_to_token(token_id)
        if token is None:
            raise ValueError(
                f"token id {token_id} is outside the vocabulary (size {self.vocab_size})"
            )
        return token

    def token_bytes(self, token_id: int) -> bytes:
        """The bytes a token stands for in decoded text (for OpenAI logprobs `bytes`); a
        byte-level token may be part of a multi-byte character."""
        token = self.id_to_token(token_id)
        if token_id in self._added_token_ids:
            return token.encode("utf-8")
        if self._is_byte_level:
            return _byte_level_token_bytes(token)
        byte_match = _BYTE_FALLBACK_TOKEN.fullmatch(token)
        if byte_match:
            return bytes([int(byte_match.group(1), 16)])
        return token.replace("\u2581", " ").encode("utf-8")

    def token_to_id(self, token: str) -> int | None:
        return self.raw.token_to_id(token)

    def is_added_token(self, text: str) -> bool:
        """Whether `text` is one of the tokenizer's added tokens (a grammar can name those
        as tokens: `<think>`)."""
        token_id = self.raw.token_to_id(text)
        return token_id is not None and token_id in self._added_token_ids

    # chat

    def apply_chat_template(
        self,
        messages: list[dict[str, Any]],
        add_generation_prompt: bool = True,
        *,
        limit: RenderLimit | None = None,
        **template_kwargs: Any,
    ) -> str:
        """Render a conversation to the prompt text. Raises ChatTemplateError, and
        RenderedTooLong once the text passes `limit`."""
        template = self.chat_template
        if template is None:
            if self.raw.token_to_id(CHATML_START) is None:
                raise ChatTemplateError(
                    "this model has no chat template and does not use ChatML tokens; "
                    "use the completions API with a raw prompt instead"
                )
            template = CHATML_TEMPLATE
        context = {**self._special_token_strings(), **template_kwargs}
        return render_chat_template(
            template, messages, add_generation_prompt, limit=limit, **context
        )

    def _special_token_strings(self) -> dict[str, str]:
        named = {
            "bos_token": self.bos_token_id,
            "eos_token": self.eos_token_id,
            "unk_token": self.unk_token_id,
            "pad_token": self.pad_token_id,
        }
        return {name: self.id_to_token(i) for name, i in named.items() if i is not None}


def _read_json_object(path: str) -> dict[str, Any]:
    if not os.path.isfile(path):
        return {}
    with open(path, encoding="utf-8") as f:
        data = json.load(f)
    return data if isinstance(data, dict) else {}


def _as_id_list(value: Any) -> list[int]:
    if isinstance(value, int):
        return [value]
    if isinstance(value, list):
        return [v for v in value if isinstance(v, int)]
    return []


def _chat_template(path: str, config: Mapping[str, Any]) -> str | None:
    jinja_path = os.path.join(path, "chat_template.jinja")
    if os.path.isfile(jinja_path):
        with open(jinja_path, encoding="utf-8") as f:
            return f.read()
    template = config.get("chat_template")
    if isinstance(template, list):  # named templates: [{"name": "default", "template": ...}]
        named = {t.get("name"): t.get("template") for t in template if isinstance(t, Mapping)}
        template = named.get("default")
    return template if isinstance(template, str) and template else None


def _byte_level_token_bytes(token: str) -> bytes:
    decoder = byte_decoder()
    try:
        return bytes(decoder[ch] for ch in token)
    except KeyError:  # not a byte-level string after all
        return token.encode("utf-8")
