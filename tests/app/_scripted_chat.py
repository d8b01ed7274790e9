"""A scripted engine behind the real OpenAI routes, and a chat stream read back: every
admitted request hands out the same fixed completion, one token per read (with made-up
logprobs when asked), so what the routes make of a known output can be checked streamed
and not.

    state = scripted_state(settings, tokenizer, vocab_size, grammar_checker)
    state.admission.script = [token ids]       # the completion
    state.admission.texts = [their texts]      # default: "<id>" per token
    with routes_client(state) as client:
        chunks = stream_chunks(client, "model-name", messages=[...])
        joined_deltas(chunks)                   # reasoning, content, calls, finish
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from starlette.applications import Starlette
from starlette.testclient import TestClient

from actors.frontend.admission import AdmissionLimits
from actors.frontend.admitted_group import AdmittedGroup
from actors.frontend.output_stream import LogprobEntry, RequestStream, StreamDelta, TopLogprob
from app.endpoints import exception_handlers
from app.routes_openai import openai_routes
from app.serve_settings import ServeSettings
from app.server_state import ServerState
from app.tokenizer import Tokenizer


class ScriptedStream(RequestStream):
    """Hands out one scripted (token id, text) step per read, then finishes at the last
    one (a "stop" names the last token as its stop reason)."""

    def __init__(
        self,
        request_id: str,
        num_prompt_tokens: int,
        steps: list[tuple[int, str]],
        finish_reason: str,
        logprobs: bool,
    ) -> None:
        super().__init__(request_id, num_prompt_tokens)
        self._steps = list(steps)
        self._scripted_finish = finish_reason
        self._with_logprobs = logprobs

    async def get(self) -> StreamDelta | None:
        if self._steps:
            token, text = self._steps.pop(0)
            finish_reason = None if self._steps else self._scripted_finish
            self.push(
                [token],
                text,
                [scripted_logprob(token)] if self._with_logprobs else None,
                finish_reason=finish_reason,
                stop_reason=token if finish_reason == "stop" else None,
            )
        return await super().get()


def scripted_logprob(token_id: int) -> LogprobEntry:
    """A distinct, recognisable entry per token: logprob -token_id / 1e6."""
    token = f"t{token_id}"
    other = TopLogprob(token_id + 1, f"t{token_id + 1}", tuple(b"x"), -20.0)
    return LogprobEntry(token_id, token, tuple(token.encode()), -token_id / 1e6, 1, (other,))


class ScriptedAdmission:
    def __init__(self) -> None:
        self.limits = AdmissionLimits(max_num_running=8)
        self.script: list[int] = []
        self.texts: list[str] | None = None
        self.finish_reason = "stop"
        self.requests: list[Any] = []

    async def admit(self, requests: list[Any], params: Any) -> AdmittedGroup:
        self.requests += requests
        texts = self.texts if self.texts is not None else [f"<{t}>" for t in self.script]
        steps = list(zip(self.script, texts, strict=True))
        streams: list[RequestStream] = [
            ScriptedStream(
                r.request_id,
                len(r.prompt_token_ids),
                steps,
                self.finish_reason,
                params.logprobs is not None,
            )
            for r in requests
        ]
        return AdmittedGroup(lambda ids, abort=False: None, streams)


def scripted_state(
    settings: ServeSettings, tokenizer: Tokenizer, vocab_size: int, grammar_checker: Any
) -> ServerState:
    """A serving state whose engine is a ScriptedAdmission (`state.admission`) and whose
    structured-output specs are checked by `grammar_checker`."""
    state = ServerState(settings)
    state.tokenizer = tokenizer
    state.eos_token_ids = tokenizer.eos_token_ids
    state.max_model_len, state.vocab_size = 4096, vocab_size
    state.admission = ScriptedAdmission()  # type: ignore[assignment]
    state.grammar_checker = grammar_checker
    state.phase = "serving"
    return state


@contextmanager
def routes_client(state: ServerState) -> Iterator[TestClient]:
    """A client of the OpenAI routes served from `state`."""
    app = Starlette(routes=openai_routes(), exception_handlers=exception_handlers())
    app.state.tandem = state
    with TestClient(app) as client:
        yield client


def stream_chunks(client: TestClient, model: str, **body: Any) -> list[dict[str, Any]]:
    """The chunks of a streamed chat completion (a 200 that ends with [DONE])."""
    with client.stream(
        "POST", "/v1/chat/completions", json={"model": model, "stream": True, **body}
    ) as response:
        assert response.status_code == 200
        raw = b"".join(response.iter_bytes()).decode()
    events = [e.removeprefix("data: ") for e in raw.strip().split("\n\n")]
    assert events[-1] == "[DONE]"
    return [json.loads(e) for e in events[:-1]]


def joined_deltas(chunks: list[dict[str, Any]], index: int = 0) -> dict[str, Any]:
    """Choice `index`'s deltas put together as the openai SDK accumulates them."""
    reasoning, content, calls, finish = "", "", {}, None
    for chunk in chunks:
        for choice in chunk["choices"]:
            if choice["index"] != index:
                continue
            delta = choice["delta"]
            # vLLM's `reasoning` and DeepSeek's `reasoning_content` always carry the same text
            assert delta.get("reasoning") == delta.get("reasoning_content"), delta
            reasoning += delta.get("reasoning_content") or ""
            content += delta.get("content") or ""
            for entry in delta.get("tool_calls") or []:
                call = calls.setdefault(entry["index"], {"id": None, "name": None, "arguments": ""})
                call["id"] = entry.get("id") or call["id"]
                call["name"] = entry["function"].get("name") or call["name"]
                call["arguments"] += entry["function"]["arguments"]
            finish = choice["finish_reason"] or finish
    return {"reasoning": reasoning, "content": content, "calls": calls, "finish": finish}
