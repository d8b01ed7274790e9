"""vLLM's speculative decoding counters (vllm/v1/spec_decode/metrics.py), with its names
and meanings, fed from each step's SpecDecodeStats (by the front end that records steps):

    vllm:spec_decode_num_drafts                 requests that verified >= 1 draft token
    vllm:spec_decode_num_draft_tokens           draft tokens verified
    vllm:spec_decode_num_accepted_tokens        draft tokens accepted
    vllm:spec_decode_num_accepted_tokens_per_pos  accepted, by draft position (label
                                                position = 0 .. K - 1)

The acceptance rate is num_accepted_tokens / num_draft_tokens; the mean acceptance length
is 1 + num_accepted_tokens / num_drafts.
"""

from __future__ import annotations

from typing import Any

from prometheus_client import CollectorRegistry, Counter


class SpecDecodeMetrics:
    def __init__(self, model_name: str, registry: CollectorRegistry) -> None:
        def counter(name: str, documentation: str) -> Any:
            return Counter(name, documentation, ["model_name"], registry=registry).labels(
                model_name=model_name
            )

        self.model_name = model_name
        self._num_drafts = counter("vllm:spec_decode_num_drafts", "Number of spec decoding drafts.")
        self._num_draft_tokens = counter(
            "vllm:spec_decode_num_draft_tokens", "Number of draft tokens."
        )
        self._num_accepted_tokens = counter(
            "vllm:spec_decode_num_accepted_tokens", "Number of accepted tokens."
        )
        self._per_pos = Counter(
            "vllm:spec_decode_num_accepted_tokens_per_pos",
            "Accepted tokens per draft position.",
            ["model_name", "position"],
            registry=registry,
        )

    def observe(self, stats: Any) -> None:
        """One step's actors.protocol.messages.SpecDecodeStats."""
        self._num_drafts.inc(stats.num_drafts)
        self._num_draft_tokens.inc(stats.num_draft_tokens)
        self._num_accepted_tokens.inc(stats.num_accepted_tokens)
        for position, count in enumerate(stats.num_accepted_tokens_per_pos):
            self._per_pos.labels(model_name=self.model_name, position=str(position)).inc(count)
