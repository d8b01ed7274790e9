"""Sends one planned soak request and judges what came back.

Outcomes: 'completed' (read to the end and correct), 'client_aborted' (the client hung up
first, as planned), 'rejected' (a malformed request refused with the expected 4xx),
'refused' (429/503 with Retry-After: overload, not an error of the server) and 'failed'
(anything else: a 5xx, a wrong status, a broken stream, a wrong finish_reason or token
count, a hang). A soak passes only with no 'failed' outcome.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass
from typing import Any, Literal

import anyio
import httpx

from benchmarks.soak_workload import PlannedRequest
from benchmarks.stream_client import sse_lines

Outcome = Literal["completed", "client_aborted", "rejected", "refused", "failed"]
REQUEST_TIMEOUT_S = 300.0
"""A request still unanswered after this long counts as a hang."""


@dataclass(frozen=True, slots=True)
class RequestOutcome:
    index: int
    plan: str
    outcome: Outcome
    status: int | None
    detail: str = ""
    """Why it failed (empty otherwise)."""
    num_output_tokens: int = 0
    finish_reasons: tuple[str, ...] = ()
    elapsed_s: float = 0.0


class _Invalid(Exception):
    """The response broke a rule; the message says which."""


async def send(client: httpx.AsyncClient, planned: PlannedRequest) -> RequestOutcome:
    started = time.monotonic()
    try:
        with anyio.fail_after(REQUEST_TIMEOUT_S):
            outcome = await _send(client, planned)
    except TimeoutError:
        outcome = _outcome(planned, "failed", None, f"no answer within {REQUEST_TIMEOUT_S:g} s")
    except _Invalid as exc:
        outcome = _outcome(planned, "failed", 200, str(exc))
    except httpx.HTTPError as exc:
        outcome = _outcome(planned, "failed", None, f"{type(exc).__name__}: {exc}")
    return RequestOutcome(**{**_fields(outcome), "elapsed_s": time.monotonic() - started})


def _fields(outcome: RequestOutcome) -> dict[str, Any]:
    return {name: getattr(outcome, name) for name in RequestOutcome.__slots__}


def _outcome(
    planned: PlannedRequest,
    outcome: Outcome,
    status: int | None,
    detail: str = "",
    num_output_tokens: int = 0,
    finish_reasons: tuple[str, ...] = (),
) -> RequestOutcome:
    return RequestOutcome(
        planned.index, planned.plan, outcome, status, detail, num_output_tokens, finish_reasons
    )


async def _send(client: httpx.AsyncClient, planned: PlannedRequest) -> RequestOutcome:
    content = planned.raw_body if planned.raw_body is not None else json.dumps(planned.body)
    headers = {"Content-Type": "application/json", **planned.headers}
    request = client.build_request("POST", planned.path, content=content, headers=headers)
    events = [0]
    if planned.plan != "disconnect":
        return await _read(client, request, planned, events)
    with anyio.move_on_after(planned.disconnect_after_s) as reading:
        outcome = await _read(client, request, planned, events)
    if reading.cancelled_caught:
        return _outcome(planned, "client_aborted", None, _aborted_after(events[0]))
    return outcome


def _aborted_after(num_events: int) -> str:
    return f"after {num_events} events" if num_events else "before any output"


async def _read(
    client: httpx.AsyncClient, request: httpx.Request, planned: PlannedRequest, events: list[int]
) -> RequestOutcome:
    """`events[0]` counts the stream's data events as they arrive."""
    response = await client.send(request, stream=True)
    try:
        status = response.status_code
        if status != 200 or planned.plan == "malformed":
            await response.aread()
            return _judge_status(planned, response)
        if planned.stream:
            return await _read_stream(response, planned, events)
        await response.aread()
        return _judge_json(planned, response.json())
    finally:
        await response.aclose()


def _judge_status(planned: PlannedRequest, response: httpx.Response) -> RequestOutcome:
    status = response.status_code
    if status in (429, 503) and response.headers.get("retry-after"):
        return _outcome(planned, "refused", status)
    if planned.plan == "malformed" and status == planned.expected_status:
        try:
            error = response.json()["error"]
            ok = error["code"] == status and isinstance(error["message"], str)
        except (ValueError, KeyError, TypeError):
            ok = False
        if ok:
            return _outcome(planned, "rejected", status)
        return _outcome(
            planned, "failed", status, f"not an OpenAI error body: {response.text[:200]}"
        )
    return _outcome(
        planned, "failed", status, f"expected {planned.expected_status}: {response.text[:300]}"
    )


async def _read_stream(
    response: httpx.Response, planned: PlannedRequest, events: list[int]
) -> RequestOutcome:
    if not response.headers.get("content-type", "").startswith("text/event-stream"):
        raise _Invalid(f"stream with content-type {response.headers.get('content-type')}")
    chunks: list[dict[str, Any]] = []
    done = False
    async for line in sse_lines(response):
        if not line.startswith("data: "):
            continue
        if done:
            raise _Invalid("data after [DONE]")
        if line == "data: [DONE]":
            done = True
            continue
        chunk = json.loads(line[len("data: ") :])
        if "error" in chunk:
            raise _Invalid(f"error event: {chunk['error']}")
        chunks.append(chunk)
        events[0] = len(chunks)
        limit = planned.disconnect_after_events
        if planned.plan == "disconnect" and limit is not None and len(chunks) >= limit:
            return _outcome(planned, "client_aborted", 200, _aborted_after(len(chunks)))
    if not done:
        raise _Invalid("the stream ended without [DONE]")
    return _judge_stream(planned, chunks)


def _judge_stream(planned: PlannedRequest, chunks: list[dict[str, Any]]) -> RequestOutcome:
    body = planned.body or {}
    finish: dict[int, str] = {}
    for chunk in chunks:
        for choice in chunk["choices"]:
            reason = choice.get("finish_reason")
            if reason is not None:
                if choice["index"] in finish:
                    raise _Invalid(f"choice {choice['index']} finished twice")
                finish[choice["index"]] = reason
    n = body.get("n", 1)
    if sorted(finish) != list(range(n)):
        raise _Invalid(f"finish_reason for choices {sorted(finish)}, expected {n} choices")
    usage = chunks[-1].get("usage") if chunks else None
    if not usage or chunks[-1]["choices"]:
        raise _Invalid("the last chunk is not the usage chunk (include_usage was set)")
    num_tokens = usage["completion_tokens"]
    reasons = tuple(finish[i] for i in range(n))
    _check_counts(body, reasons, [num_tokens] if n == 1 else None, num_tokens)
    return _outcome(planned, "completed", 200, num_output_tokens=num_tokens, finish_reasons=reasons)


def _judge_json(planned: PlannedRequest, response: dict[str, Any]) -> RequestOutcome:
    body = planned.body or {}
    choices = sorted(response["choices"], key=lambda c: c["index"])
    n = body.get("n", 1)
    if [c["index"] for c in choices] != list(range(n)):
        raise _Invalid(f"choice indices {[c['index'] for c in choices]}, expected {n}")
    counts = [len(c["token_ids"]) for c in choices]
    reasons = tuple(c["finish_reason"] for c in choices)
    total = response["usage"]["completion_tokens"]
    if total != sum(counts):
        raise _Invalid(f"usage.completion_tokens {total} != {sum(counts)} tokens returned")
    _check_counts(body, reasons, counts, total)
    for choice in choices:
        text = choice["message"]["content"] if "message" in choice else choice["text"]
        stop = body.get("stop") or ()
        stop_reason = choice.get("stop_reason")
        if isinstance(stop_reason, str) and stop_reason not in stop:
            raise _Invalid(f"stop_reason {stop_reason!r} is not a stop string")
        # Stop strings count only after min_tokens, so earlier text may hold one.
        if not body.get("min_tokens") and any(s in (text or "") for s in stop):
            raise _Invalid(f"a stop string is in the output {text!r}")
        _check_logprobs(body, choice, counts[choice["index"]])
    return _outcome(planned, "completed", 200, num_output_tokens=total, finish_reasons=reasons)


def _check_counts(
    body: dict[str, Any], reasons: tuple[str, ...], counts: list[int] | None, total: int
) -> None:
    """finish_reason and token counts agree with max_tokens, min_tokens and ignore_eos.
    `counts` per choice when known (else only the total is checked)."""
    max_tokens, n = body["max_tokens"], body.get("n", 1)
    if any(r not in ("stop", "length") for r in reasons):
        raise _Invalid(f"finish_reasons {reasons}")
    if body.get("ignore_eos") and not body.get("stop") and any(r != "length" for r in reasons):
        raise _Invalid(f"ignore_eos without stop strings finished with {reasons}")
    if not total <= n * max_tokens:
        raise _Invalid(f"{total} output tokens for n={n} x max_tokens={max_tokens}")
    if all(r == "length" for r in reasons) and total != n * max_tokens:
        raise _Invalid(f"finish_reason length but {total} tokens for n={n} x {max_tokens}")
    for count, reason in zip(counts or (), reasons):
        if reason == "length" and count != max_tokens:
            raise _Invalid(f"finish_reason length after {count} of {max_tokens} tokens")
        if reason == "stop" and count < body.get("min_tokens", 0):
            raise _Invalid(f"stopped after {count} tokens, min_tokens {body['min_tokens']}")


def _check_logprobs(body: dict[str, Any], choice: dict[str, Any], count: int) -> None:
    wanted = body.get("logprobs")
    if wanted is None or wanted is False:
        return
    logprobs = choice.get("logprobs")
    if logprobs is None:
        raise _Invalid("logprobs were asked for but are missing")
    entries = logprobs["content"] if "content" in logprobs else logprobs["tokens"]
    if len(entries) != count:
        raise _Invalid(f"{len(entries)} logprob entries for {count} tokens")
