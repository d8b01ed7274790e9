"""The scheduler's per-request state."""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import Any

from actors.protocol.messages import EngineRequest, PromptEmbeds
from actors.protocol.prompt_embeds import ITEM_BYTES
from actors.protocol.sampling_params import SamplingParams


class RequestStatus(enum.Enum):
    WAITING_FOR_GRAMMAR = "waiting_for_grammar"
    """Its structured output's grammar is compiling; it joins the waiting queue after."""
    WAITING = "waiting"
    RUNNING = "running"
    PREEMPTED = "preempted"
    FINISHED_STOPPED = "stop"
    FINISHED_LENGTH = "length"
    FINISHED_ABORTED = "abort"
    FINISHED_ERROR = "error"

    @property
    def is_finished(self) -> bool:
        # By value: hashing a member runs Enum.__hash__ in Python, and this is asked per
        # request per step.
        return self._value_ in _FINISHED_REASONS

    @property
    def finish_reason(self) -> str | None:
        """OpenAI-style finish reason ('stop', 'length', 'abort', 'error'), None if unfinished."""
        return self.value if self in _FINISHED else None

    @classmethod
    def from_finish_reason(cls, reason: str) -> RequestStatus:
        status = _BY_REASON.get(reason)
        if status is None:
            raise ValueError(
                f"unknown finish reason {reason!r}; expected one of {sorted(_BY_REASON)}"
            )
        return status


_FINISHED = frozenset(
    {
        RequestStatus.FINISHED_STOPPED,
        RequestStatus.FINISHED_LENGTH,
        RequestStatus.FINISHED_ABORTED,
        RequestStatus.FINISHED_ERROR,
    }
)
_BY_REASON = {status.value: status for status in _FINISHED}
_FINISHED_REASONS = frozenset(_BY_REASON)


@dataclass(eq=False, slots=True)
class Request:
    request_id: str
    prompt_token_ids: tuple[int, ...]
    sampling_params: SamplingParams
    arrival_time: float
    max_model_len: int
    priority: int = 0
    eos_token_ids: tuple[int, ...] = ()
    cache_salt: str | None = None
    client_index: int = 0
    """The front end that owns the request."""
    num_prompt_tokens: int = 0
    """len(prompt_token_ids), kept apart: the per-step counts below read it for every
    running request, and the prompt tuple would be one more object to load each time."""
    max_total_tokens: int = 0
    """Prompt plus max_tokens, capped at max_model_len (fixed at arrival)."""
    min_tokens: int = 0
    """Outputs before a stop token counts (SamplingParams.min_tokens)."""
    stop_tokens: dict[int, int | None] = field(default_factory=dict)
    """Tokens that end the request with 'stop' once min_tokens outputs exist: each of
    stop_token_ids maps to itself (the finish names it), each EOS (unless ignore_eos) to
    None; EOS wins a token that is both. One lookup per sampled token."""
    output_token_ids: list[int] = field(default_factory=list)
    num_computed_tokens: int = 0
    """Tokens whose KV is computed or scheduled (advanced when a step is scheduled)."""
    num_output_placeholders: int = 0
    """Output tokens scheduled to be sampled whose values have not arrived yet."""
    num_cached_tokens: int = -1
    """Prefix-cache hit on first admission (-1 until then)."""
    num_preemptions: int = 0
    block_ids: list[int] = field(default_factory=list)
    status: RequestStatus = RequestStatus.WAITING
    queued_time: float = 0.0
    """time.monotonic() when the scheduler queued the request."""
    first_scheduled_time: float | None = None
    grammar: Any = None
    """The actors.core.grammar.GrammarMatcher of a request with a structured output."""
    spec_backoff_steps: int = 0
    """Speculative decoding: steps without draft slots after its latest run of drafts
    emitted nothing beyond its last token (actors/core/spec_scheduling.py)."""
    spec_resume_step: int = 0
    """The step id from which it may run draft slots again."""
    spec_accepting: bool = False
    """Whether its latest reported speculative step emitted a draft."""
    spec_accept_rates: list[float] = field(default_factory=list)
    """Per draft position, the average of its drafts' acceptance (actors/core/spec_policy.py)."""
    prompt_embeds: PromptEmbeds | None = None
    """The prompt's embedding rows; its prompt_token_ids are then placeholders."""

    @classmethod
    def from_engine_request(
        cls, request: EngineRequest, max_model_len: int, queued_time: float
    ) -> Request:
        num_prompt_tokens = len(request.prompt_token_ids)
        if num_prompt_tokens == 0:
            raise ValueError(f"request {request.request_id!r} has an empty prompt")
        if num_prompt_tokens >= max_model_len:
            raise ValueError(
                f"request {request.request_id!r}: prompt of {num_prompt_tokens} "
                f"tokens leaves no room for output within max_model_len "
                f"{max_model_len}"
            )
        params = request.sampling_params
        cache_salt = request.cache_salt
        if request.prompt_embeds is not None:
            _check_embeds_request(request)
            cache_salt = embeds_cache_salt(request.prompt_embeds, cache_salt)
        max_total_tokens = (
            max_model_len
            if params.max_tokens is None
            else min(num_prompt_tokens + params.max_tokens, max_model_len)
        )
        return cls(
            request_id=request.request_id,
            prompt_token_ids=tuple(request.prompt_token_ids),
            sampling_params=params,
            arrival_time=request.arrival_time,
            max_model_len=max_model_len,
            priority=request.priority,
            eos_token_ids=request.eos_token_ids,
            cache_salt=cache_salt,
            client_index=request.client_index,
            num_prompt_tokens=num_prompt_tokens,
            max_total_tokens=max_total_tokens,
            min_tokens=params.min_tokens,
            stop_tokens=_stop_tokens(params, request.eos_token_ids),
            queued_time=queued_time,
            prompt_embeds=request.prompt_embeds,
        )

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    @property
    def num_tokens(self) -> int:
        """Prompt plus known output tokens."""
        return self.num_prompt_tokens + len(self.output_token_ids)

    @property
    def num_tokens_with_placeholders(self) -> int:
        return self.num_prompt_tokens + len(self.output_token_ids) + self.num_output_placeholders

    @property
    def all_token_ids(self) -> tuple[int, ...]:
        return self.prompt_token_ids + tuple(self.output_token_ids)

    @property
    def is_finished(self) -> bool:
        return self.status.is_finished


def embeds_cache_salt(embeds: PromptEmbeds, cache_salt: str | None) -> str:
    """The prefix-cache salt of a prompt given as embeddings: its blocks' token ids are
    placeholders, so the rows' digest joins every block's hash. Only a request with the
    same rows (and salt) shares those blocks; no token prompt can, unless its client sends
    this very string, which needs the rows' digest (the rows themselves, in effect)."""
    salt = "" if cache_salt is None else " " + cache_salt
    return f"\x00prompt-embeds {embeds.digest.hex()}{salt}"


def _check_embeds_request(request: EngineRequest) -> None:
    embeds = request.prompt_embeds
    assert embeds is not None
    if embeds.num_tokens != len(request.prompt_token_ids):
        raise ValueError(
            f"request {request.request_id!r}: {embeds.num_tokens} embedding rows for "
            f"{len(request.prompt_token_ids)} prompt positions"
        )
    if len(embeds.data) != embeds.num_tokens * embeds.hidden_size * ITEM_BYTES.get(embeds.dtype, 0):
        raise ValueError(f"request {request.request_id!r}: malformed prompt embeddings")
    if request.sampling_params.prompt_logprobs is not None:
        raise ValueError(
            f"request {request.request_id!r}: prompt logprobs are not computed for "
            "prompt embeddings"
        )


def _stop_tokens(params: SamplingParams, eos_token_ids: tuple[int, ...]) -> dict[int, int | None]:
    stop_tokens: dict[int, int | None] = {token_id: token_id for token_id in params.stop_token_ids}
    if not params.ignore_eos:
        stop_tokens.update(dict.fromkeys(eos_token_ids))
    return stop_tokens
