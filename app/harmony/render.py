"""An OpenAI chat conversation rendered as harmony, gpt-oss's chat format, to token ids.

    system      openai-harmony's system message: identity, knowledge cutoff, today's date,
                `Reasoning: <effort>`, the valid channels (commentary only when the
                request has function tools, as vLLM renders it)
    developer   the request's leading system/developer messages as `# Instructions`, and
                its function tools (as the gpt-oss chat template renders them)
    user        as sent
    assistant   `reasoning_content` -> the analysis channel; `tool_calls` -> commentary
                messages to `functions.NAME` (JSON); text -> the final channel, or a
                commentary preamble when the message also calls tools
    tool        a message from `functions.NAME`, the name found through its tool_call_id

As harmony's documentation asks, the analysis of turns that ended in a final answer is
dropped (openai-harmony's renderer does so only when the conversation's last assistant
message is final; a turn still calling tools keeps its own analysis).
"""

from __future__ import annotations

import datetime
import json
from collections.abc import Mapping, Sequence
from typing import Any

from openai_harmony import (
    Author,
    ChannelConfig,
    Conversation,
    DeveloperContent,
    HarmonyEncoding,
    HarmonyError,
    Message,
    ReasoningEffort,
    Role,
    SystemContent,
    ToolDescription,
)

REASONING_EFFORTS = {
    "low": ReasoningEffort.LOW,
    "medium": ReasoningEffort.MEDIUM,
    "high": ReasoningEffort.HIGH,
}
INSTRUCTION_ROLES = ("system", "developer")
FUNCTIONS_NAMESPACE = "functions"
REASONING_FIELDS = ("reasoning_content", "reasoning")
"""Where an earlier assistant message carries its reasoning (vLLM's name, then OpenRouter's)."""


class HarmonyRequestError(ValueError):
    """The conversation cannot be rendered as harmony; `param` names the request field."""

    def __init__(self, message: str, param: str) -> None:
        super().__init__(message)
        self.param = param


def render_prompt(
    encoding: HarmonyEncoding,
    messages: Sequence[Mapping[str, Any]],
    tools: Sequence[Mapping[str, Any]] = (),
    reasoning_effort: str | None = None,
    *,
    today: str | None = None,
) -> list[int]:
    """The prompt's token ids, ending with the assistant's turn start. `tools`: checked
    function tools in OpenAI's shape (empty: none shown). `today` (YYYY-MM-DD) defaults to
    the server's date. Raises HarmonyRequestError."""
    effort = _reasoning_effort(reasoning_effort)
    leading, rest = _split_instructions(messages)
    harmony_messages = [_system_message(effort, bool(tools), today)]
    developer = _developer_content(leading, tools)
    if developer is not None:
        harmony_messages.append(Message.from_role_and_content(Role.DEVELOPER, developer))
    harmony_messages += _without_finished_analysis(_conversation(messages, rest))
    try:
        return encoding.render_conversation_for_completion(
            Conversation.from_messages(harmony_messages), Role.ASSISTANT
        )
    except HarmonyError as exc:
        raise HarmonyRequestError(f"cannot render the conversation: {exc}", "messages") from None


def _reasoning_effort(value: str | None) -> ReasoningEffort | None:
    if value is None:
        return None
    effort = REASONING_EFFORTS.get(value)
    if effort is None:
        raise HarmonyRequestError(
            f"reasoning_effort must be one of {', '.join(REASONING_EFFORTS)}; got {value!r}",
            "reasoning_effort",
        )
    return effort


def _system_message(effort: ReasoningEffort | None, has_tools: bool, today: str | None) -> Message:
    content = SystemContent.new().with_conversation_start_date(
        today or datetime.date.today().isoformat()
    )
    if effort is not None:
        content = content.with_reasoning_effort(effort)
    if not has_tools:
        channels = ChannelConfig.require_channels(["analysis", "final"])
        content = content.with_channel_config(channels)
    return Message.from_role_and_content(Role.SYSTEM, content)


def _split_instructions(messages: Sequence[Mapping[str, Any]]) -> tuple[list[str], int]:
    """The texts of the leading system/developer messages, and where the rest starts."""
    texts: list[str] = []
    for index, message in enumerate(messages):
        if message.get("role") not in INSTRUCTION_ROLES:
            return texts, index
        texts.append(_text(message, index))
    return texts, len(messages)


def _developer_content(
    instructions: list[str], tools: Sequence[Mapping[str, Any]]
) -> DeveloperContent | None:
    text = "\n\n".join(t for t in instructions if t)
    if not text and not tools:
        return None
    content = DeveloperContent.new()
    if text:
        content = content.with_instructions(text)
    if tools:
        content = content.with_function_tools([_tool_description(t) for t in tools])
    return content


def _tool_description(tool: Mapping[str, Any]) -> ToolDescription:
    function = tool["function"]
    return ToolDescription.new(
        function["name"], function.get("description") or "", function.get("parameters")
    )


def _conversation(messages: Sequence[Mapping[str, Any]], start: int) -> list[Message]:
    out: list[Message] = []
    call_names: dict[str, str] = {}
    """Tool-call id -> function name, for the tool messages that answer them."""
    for index in range(start, len(messages)):
        message = messages[index]
        role = message.get("role")
        if role in INSTRUCTION_ROLES:
            content = DeveloperContent.new().with_instructions(_text(message, index))
            out.append(Message.from_role_and_content(Role.DEVELOPER, content))
        elif role == "user":
            out.append(Message.from_role_and_content(Role.USER, _text(message, index)))
        elif role == "assistant":
            out += _assistant_messages(message, index, call_names)
        elif role == "tool":
            out.append(_tool_result(message, index, call_names))
        else:
            raise HarmonyRequestError(
                f"messages.{index}: unknown role {role!r}; expected system, developer, "
                "user, assistant or tool",
                f"messages.{index}.role",
            )
    return out


def _without_finished_analysis(messages: list[Message]) -> list[Message]:
    last_final = max((i for i, m in enumerate(messages) if m.channel == "final"), default=-1)
    return [m for i, m in enumerate(messages) if i > last_final or m.channel != "analysis"]


def _assistant_messages(
    message: Mapping[str, Any], index: int, call_names: dict[str, str]
) -> list[Message]:
    out = []
    reasoning = next((message[f] for f in REASONING_FIELDS if message.get(f)), None)
    if reasoning is not None:
        if not isinstance(reasoning, str):
            raise HarmonyRequestError(
                f"messages.{index}: reasoning_content must be a string", f"messages.{index}"
            )
        out.append(_assistant(reasoning, "analysis"))
    calls = message.get("tool_calls") or []
    text = _text(message, index)
    if text:
        out.append(_assistant(text, "commentary" if calls else "final"))
    for call in calls:
        function = call.get("function") or {}
        name, arguments = function.get("name"), function.get("arguments")
        if not isinstance(name, str) or not name:
            raise HarmonyRequestError(
                f"messages.{index}: each tool call needs its function's name",
                f"messages.{index}.tool_calls",
            )
        if not isinstance(arguments, str):
            arguments = json.dumps(arguments if arguments is not None else {})
        if call.get("id"):
            call_names[call["id"]] = name
        out.append(
            _assistant(arguments, "commentary")
            .with_recipient(f"{FUNCTIONS_NAMESPACE}.{name}")
            .with_content_type("json")
        )
    return out


def _assistant(text: str, channel: str) -> Message:
    return Message.from_role_and_content(Role.ASSISTANT, text).with_channel(channel)


def _tool_result(message: Mapping[str, Any], index: int, call_names: dict[str, str]) -> Message:
    call_id = message.get("tool_call_id")
    name = call_names.get(call_id) if call_id else None
    if name is None and not call_id and message.get("name") in call_names.values():
        name = message["name"]
    if name is None:
        raise HarmonyRequestError(
            f"messages.{index}: tool message answers tool call {call_id!r}, which no earlier "
            "assistant message made"
            if call_id
            else f"messages.{index}: tool message needs the tool_call_id of an earlier call",
            f"messages.{index}.tool_call_id",
        )
    author = Author.new(Role.TOOL, f"{FUNCTIONS_NAMESPACE}.{name}")
    return Message.from_author_and_content(author, _text(message, index)).with_channel("commentary")


def _text(message: Mapping[str, Any], index: int) -> str:
    content = message.get("content")
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    texts = []
    for part in content:
        if not isinstance(part, Mapping) or part.get("type") != "text":
            raise HarmonyRequestError(
                f"messages.{index}: only text content parts are supported", f"messages.{index}"
            )
        texts.append(str(part.get("text", "")))
    return "\n".join(texts)
