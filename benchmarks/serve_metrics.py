"""Latency and throughput of streamed requests, with `vllm bench serve`'s definitions.

Per request, timed from the moment it is sent:
- TTFT: the first SSE event that carries `choices` (a chat role chunk counts);
- ITL: the gap between consecutive choice-bearing events (several tokens in one chunk make
  one gap); pooled across requests;
- E2EL: the last choice-bearing event (the usage chunk does not count);
- TPOT: (E2EL - TTFT) / (output_tokens - 1), only when output_tokens > 1, with
  output_tokens taken from the usage chunk.
Throughput divides by the wall time of the whole run.
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass, field
from typing import Any

import numpy as np

PERCENTILES = (50.0, 99.0)


@dataclass(frozen=True, slots=True)
class RequestResult:
    success: bool
    prompt_tokens: int = 0
    output_tokens: int = 0
    cached_prompt_tokens: int = 0
    """Prompt tokens the server took from its prefix cache (usage.prompt_tokens_details)."""
    ttft_s: float = 0.0
    itl_s: tuple[float, ...] = ()
    e2el_s: float = 0.0
    finish_reason: str | None = None
    error: str = ""


@dataclass(slots=True)
class StreamTimeline:
    """Collects one streamed response's event times (seconds on one monotonic clock)."""

    sent_s: float
    first_choice_s: float | None = None
    last_choice_s: float | None = None
    itl_s: list[float] = field(default_factory=list)
    prompt_tokens: int | None = None
    output_tokens: int | None = None
    cached_prompt_tokens: int = 0
    finish_reason: str | None = None
    error: str = ""
    by_text: bool = False
    """Time the first token at the first chunk that carries text (not a role-only delta),
    and without a usage chunk count one token per text chunk: for servers that send no
    usage when streaming (llama-cpp-python's), measured the same way on both sides."""
    first_text_s: float | None = None
    num_text_chunks: int = 0

    def on_event(self, at_s: float, event: dict[str, Any]) -> None:
        if "error" in event:
            error = event["error"]
            self.error = str(error.get("message", error) if isinstance(error, dict) else error)
            return
        choices = event.get("choices")
        if choices:
            if self.first_choice_s is None:
                self.first_choice_s = at_s
            else:
                self.itl_s.append(at_s - self.last_choice_s)  # type: ignore[operator]
            self.last_choice_s = at_s
            self.finish_reason = choices[0].get("finish_reason") or self.finish_reason
            if _chunk_text(choices[0]):
                self.num_text_chunks += 1
                self.first_text_s = self.first_text_s if self.first_text_s is not None else at_s
        usage = event.get("usage")
        if usage:
            self.prompt_tokens = usage.get("prompt_tokens")
            self.output_tokens = usage.get("completion_tokens")
            details = usage.get("prompt_tokens_details") or {}
            self.cached_prompt_tokens = details.get("cached_tokens") or 0

    def result(self) -> RequestResult:
        if self.error:
            return RequestResult(success=False, error=self.error)
        if self.first_choice_s is None or self.last_choice_s is None:
            return RequestResult(success=False, error="the stream carried no choices")
        output_tokens, first_token_s = self.output_tokens, self.first_choice_s
        if self.by_text:
            output_tokens = output_tokens if output_tokens is not None else self.num_text_chunks
            first_token_s = self.first_text_s if self.first_text_s is not None else first_token_s
        if output_tokens is None:
            return RequestResult(success=False, error="the stream ended without a usage chunk")
        return RequestResult(
            success=True,
            prompt_tokens=self.prompt_tokens or 0,
            output_tokens=output_tokens,
            cached_prompt_tokens=self.cached_prompt_tokens,
            ttft_s=first_token_s - self.sent_s,
            itl_s=tuple(self.itl_s),
            e2el_s=self.last_choice_s - self.sent_s,
            finish_reason=self.finish_reason,
        )


def _chunk_text(choice: dict[str, Any]) -> str:
    delta = choice.get("delta")
    if isinstance(delta, dict):
        return str(delta.get("content") or delta.get("reasoning_content") or "")
    return str(choice.get("text") or "")


def tpot_s(result: RequestResult) -> float | None:
    if not result.success or result.output_tokens <= 1:
        return None
    return (result.e2el_s - result.ttft_s) / (result.output_tokens - 1)


def distribution_ms(
    values_s: list[float], percentiles: tuple[float, ...] = PERCENTILES
) -> dict[str, float | None]:
    """mean, median, std and the percentiles (numpy's linear interpolation, as vLLM), in ms."""
    if not values_s:
        return {
            "mean_ms": None,
            "median_ms": None,
            "std_ms": None,
            **{f"p{p:g}_ms": None for p in percentiles},
        }
    values_ms = np.asarray(values_s, dtype=np.float64) * 1e3
    figures: dict[str, float | None] = {
        "mean_ms": float(values_ms.mean()),
        "median_ms": float(np.median(values_ms)),
        "std_ms": float(values_ms.std()),
    }
    for p in percentiles:
        figures[f"p{p:g}_ms"] = float(np.percentile(values_ms, p))
    return figures


def summarize(
    results: list[RequestResult], duration_s: float, expected_output_tokens: int | None = None
) -> dict[str, Any]:
    """One load level's figures; failed requests count in `failed` and nowhere else."""
    done = [r for r in results if r.success]
    input_tokens = sum(r.prompt_tokens for r in done)
    output_tokens = sum(r.output_tokens for r in done)
    tpots = [t for t in map(tpot_s, done) if t is not None]
    figures: dict[str, Any] = {
        "completed": len(done),
        "failed": len(results) - len(done),
        "duration_s": duration_s,
        "total_input_tokens": input_tokens,
        "total_output_tokens": output_tokens,
        "total_cached_prompt_tokens": sum(r.cached_prompt_tokens for r in done),
        "request_throughput_req_s": len(done) / duration_s,
        "output_throughput_tok_s": output_tokens / duration_s,
        "total_token_throughput_tok_s": (input_tokens + output_tokens) / duration_s,
        "ttft": distribution_ms([r.ttft_s for r in done]),
        "tpot": distribution_ms(tpots),
        "itl": distribution_ms([gap for r in done for gap in r.itl_s]),
        "e2el": distribution_ms([r.e2el_s for r in done]),
        "mean_output_tokens": statistics.fmean(r.output_tokens for r in done) if done else None,
    }
    if expected_output_tokens is not None:
        figures["output_len_mismatches"] = sum(
            1 for r in done if r.output_tokens != expected_output_tokens
        )
    errors = sorted({r.error for r in results if not r.success})
    if errors:
        figures["errors"] = errors[:10]
    return figures
