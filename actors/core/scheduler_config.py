"""The scheduler's limits."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class SchedulerConfig:
    max_num_seqs: int
    """Requests holding a runner row (running) at once."""
    max_num_batched_tokens: int
    """Tokens computed per step, prefill and decode together."""
    max_model_len: int
    """Prompt plus output tokens of one request."""
    block_size: int
    """Tokens per KV block."""
    max_steps_in_flight: int = 1
    """Steps scheduled before the oldest one's results arrive (2 overlaps CPU and GPU)."""
    step_groups: int = 1
    """Pipeline parallelism's batch queue: with N > 1 the running requests split into N
    groups that take turns, so N steps are in flight, one per pipeline stage, and no request
    runs in a step while its previous step's token is still on the way (a stage waits for a
    step's tokens only where that step's requests run again). 1: a step may hold requests
    whose previous step is in flight (their tokens reach the inputs on the device)."""
    num_speculative_tokens: int = 0
    """Draft slots per decoding row (ngram speculative decoding); 0: no speculation."""
    prompt_embeds_hidden_size: int | None = None
    """Width of the rows a request's prompt embeddings must have; None: requests with
    prompt embeddings are refused (--enable-prompt-embeds is off)."""

    def __post_init__(self) -> None:
        for name in (
            "max_num_seqs",
            "max_num_batched_tokens",
            "max_model_len",
            "block_size",
            "max_steps_in_flight",
            "step_groups",
        ):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise ValueError(
                    f"SchedulerConfig.{name} must be a positive integer, got {value!r}"
                )
        if self.max_model_len < 2:
            raise ValueError(
                f"SchedulerConfig.max_model_len must be at least 2 (one prompt and "
                f"one output token), got {self.max_model_len}"
            )
        if not isinstance(self.num_speculative_tokens, int) or self.num_speculative_tokens < 0:
            raise ValueError(
                "SchedulerConfig.num_speculative_tokens must be an integer >= 0, "
                f"got {self.num_speculative_tokens!r}"
            )
