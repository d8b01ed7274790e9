"""Custom logits processors: the plugin API, in the shape of vLLM's batch-level processors.

A processor is a class loaded at startup with `--logits-processors module:Class[,...]`.
The engine builds one instance per class and drives it every step:

1. `update_state(batch_update)`: how the batch changed since the previous step (None when
   it did not). Apply `removed`, then `added`, then `moved`. A batch index is a row of the
   logits tensor `apply` receives next; it stays the request's until a later update
   removes or moves it.
   - removed: indices whose request left the batch (finished, aborted, preempted, or not
     scheduled this step; a request that comes back is added again);
   - added: (index, sampling_params, prompt_token_ids, output_token_ids). The output list
     is the request's live list of generated tokens: it grows as tokens are sampled, so a
     processor can keep a reference instead of asking again. Per-request arguments are in
     `sampling_params.extra_args` (the request's `vllm_xargs`);
   - moved: (from_index, to_index, MoveDirectionality). UNIDIRECTIONAL moves the request
     at from_index to to_index (which it replaces) and leaves from_index empty; SWAP
     exchanges the two.
2. `apply(logits)`: logits is [batch_size, vocab_size] float32, one row per batch index;
   return the processed tensor (in place or new). Only rows of requests the processor
   acts on should change.

`is_argmax_invariant()` returning True promises that `apply` never changes any row's
argmax (e.g. it only reshapes the distribution); the engine then skips the processor on
steps where every request is greedy. `validate_params(sampling_params)` (classmethod) runs
when a request arrives: raising ValueError refuses it with HTTP 400.

Where it runs: on the V1 runner, on the model's float32 logits before tandem's built-in
sampling parameters (logit bias, penalties, temperature, min-p, top-k/top-p); logprobs
stay those of the raw logits. A processor is constructed with
`(config: LogitsProcessorConfig, device: torch.device, is_pin_memory: bool)`.

Loading (`load_logits_processor_classes`) imports only the named modules, and this module
imports nothing heavy: the engine core loads the classes at startup (an entry that does not
import stops it there) and builds the instances (gpu/runner_v1/logits_processors.py);
every API server loads them too, to run `validate_params` on each request. A processor
module that imports torch at the top makes the API servers import it: keep such imports
inside the methods if the front end should stay light.
"""

from __future__ import annotations

import enum
import functools
import importlib
from abc import ABC, abstractmethod
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

from actors.protocol.sampling_params import SamplingParams, SamplingParamsError

if TYPE_CHECKING:
    import torch


class MoveDirectionality(enum.Enum):
    UNIDIRECTIONAL = enum.auto()
    """from_index's request moves to to_index; from_index becomes empty."""
    SWAP = enum.auto()
    """The requests at the two indices trade places."""


AddedRequest = tuple[int, SamplingParams, list[int], list[int]]
"""(index, sampling_params, prompt_token_ids, output_token_ids: the live output list)."""
RemovedRequest = int
MovedRequest = tuple[int, int, MoveDirectionality]


@dataclass(frozen=True, slots=True)
class BatchUpdate:
    batch_size: int
    """Rows of the next `apply`'s logits."""
    removed: Sequence[RemovedRequest]
    added: Sequence[AddedRequest]
    moved: Sequence[MovedRequest]


@dataclass(frozen=True, slots=True)
class LogitsProcessorConfig:
    """What a processor may need to size its state."""

    vocab_size: int
    max_num_seqs: int
    """Most requests in one batch."""
    max_model_len: int
    model: str
    """The --model the server runs."""


class LogitsProcessor(ABC):
    """Base class of custom logits processors (see the module doc)."""

    @classmethod
    def validate_params(cls, sampling_params: SamplingParams) -> None:
        """Raise ValueError when the request's arguments (e.g. its extra_args) are invalid
        for this processor; the request is then refused with HTTP 400."""

    @abstractmethod
    def __init__(
        self, config: LogitsProcessorConfig, device: torch.device, is_pin_memory: bool
    ) -> None: ...

    @abstractmethod
    def is_argmax_invariant(self) -> bool:
        """True if `apply` never changes the argmax of any row."""

    @abstractmethod
    def update_state(self, batch_update: BatchUpdate | None) -> None:
        """Called before every `apply`; None when the batch did not change."""

    @abstractmethod
    def apply(self, logits: torch.Tensor) -> torch.Tensor:
        """logits: [batch_size, vocab_size] float32; returns the processed logits."""


class LogitsProcessorLoadError(ValueError):
    """A --logits-processors entry that cannot be used; the message names it."""


def parse_logits_processor_specs(text: str) -> tuple[str, ...]:
    """'a.b:C, d:E' -> ('a.b:C', 'd:E'), each checked to have the module:Class form."""
    specs = tuple(part.strip() for part in text.split(",") if part.strip())
    for spec in specs:
        check_spec(spec)
    return specs


def check_spec(spec: str) -> None:
    module, sep, name = spec.partition(":")
    if not sep or not module or not name or ":" in name:
        raise LogitsProcessorLoadError(
            f"--logits-processors entry {spec!r} must have the form module:Class "
            "(e.g. my_package.processors:BanTokens)"
        )


@functools.lru_cache(maxsize=16)
def load_logits_processor_classes(specs: tuple[str, ...]) -> tuple[type[LogitsProcessor], ...]:
    """Import every 'module:Class' and check that it is a LogitsProcessor subclass."""
    return tuple(_load_one(spec) for spec in specs)


def _load_one(spec: str) -> type[LogitsProcessor]:
    check_spec(spec)
    module_name, _, qualname = spec.partition(":")
    try:
        target: object = importlib.import_module(module_name)
    except Exception as exc:  # noqa: BLE001 - any import failure is the user's module
        raise LogitsProcessorLoadError(
            f"--logits-processors: cannot import module {module_name!r} "
            f"({type(exc).__name__}: {exc})"
        ) from None
    for attribute in qualname.split("."):
        if not hasattr(target, attribute):
            raise LogitsProcessorLoadError(
                f"--logits-processors: module {module_name!r} has no {qualname!r}"
            )
        target = getattr(target, attribute)
    if not (isinstance(target, type) and issubclass(target, LogitsProcessor)):
        raise LogitsProcessorLoadError(
            f"--logits-processors: {spec} is not a subclass of "
            "actors.protocol.logits_processors.LogitsProcessor"
        )
    return target


def validate_request_params(specs: Sequence[str], params: SamplingParams) -> None:
    """Let every configured processor check the request; a refusal becomes a
    SamplingParamsError on 'vllm_xargs' (HTTP 400)."""
    if not specs:
        return
    for cls in load_logits_processor_classes(tuple(specs)):
        try:
            cls.validate_params(params)
        except ValueError as exc:
            raise SamplingParamsError("vllm_xargs", str(exc)) from None
