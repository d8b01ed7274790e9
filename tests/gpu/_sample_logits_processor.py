"""A sample custom logits processor, loaded by the tests as
`tests.gpu._sample_logits_processor:ForceOrBanTokens`.

Per-request arguments (the request's `vllm_xargs`):
- `force_token_id`: int, the only token the request may produce;
- `ban_token_ids`: list of ints, tokens the request may never produce.
Requests without them are left alone.
"""

from __future__ import annotations

import torch

from actors.protocol.logits_processors import (
    BatchUpdate,
    LogitsProcessor,
    LogitsProcessorConfig,
    MoveDirectionality,
)


class ForceOrBanTokens(LogitsProcessor):
    @classmethod
    def validate_params(cls, sampling_params) -> None:
        args = sampling_params.extra_args or {}
        force = args.get("force_token_id")
        if force is not None and (
            isinstance(force, bool) or not isinstance(force, int) or force < 0
        ):
            raise ValueError(f"force_token_id must be a non-negative integer, got {force!r}")
        banned = args.get("ban_token_ids")
        if banned is not None and not (
            isinstance(banned, list) and all(isinstance(t, int) and t >= 0 for t in banned)
        ):
            raise ValueError(f"ban_token_ids must be a list of token ids, got {banned!r}")

    def __init__(
        self, config: LogitsProcessorConfig, device: torch.device, is_pin_memory: bool
    ) -> None:
        self.vocab_size = config.vocab_size
        self.rules: dict[int, tuple[int | None, tuple[int, ...]]] = {}
        """batch index -> (forced token, banned tokens), only for requests with rules."""
        self.updates: list[BatchUpdate | None] = []
        """Every update received (the tests inspect them)."""

    def is_argmax_invariant(self) -> bool:
        return False

    def update_state(self, batch_update: BatchUpdate | None) -> None:
        self.updates.append(batch_update)
        if batch_update is None:
            return
        for index in batch_update.removed:
            self.rules.pop(index, None)
        for index, params, _prompt, _output in batch_update.added:
            args = params.extra_args or {}
            force, banned = args.get("force_token_id"), tuple(args.get("ban_token_ids", ()))
            if force is not None or banned:
                self.rules[index] = (force, banned)
            else:
                self.rules.pop(index, None)
        for source, target, direction in batch_update.moved:
            moving = self.rules.pop(source, None)
            if direction is MoveDirectionality.SWAP:
                staying = self.rules.pop(target, None)
                if staying is not None:
                    self.rules[source] = staying
            else:
                self.rules.pop(target, None)
            if moving is not None:
                self.rules[target] = moving

    def apply(self, logits: torch.Tensor) -> torch.Tensor:
        for index, (force, banned) in self.rules.items():
            if force is not None and force < self.vocab_size:
                kept = logits[index, force].clone()
                logits[index] = float("-inf")
                logits[index, force] = kept
            for token in banned:
                if token < self.vocab_size:
                    logits[index, token] = float("-inf")
        return logits
