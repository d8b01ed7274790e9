"""The runner side of custom logits processors: one instance per configured class, kept in
step with the batch.

The runner registers requests as they take and leave its rows (`add_request`,
`remove_request`), reports their sampled tokens (`append_output`), and each step hands
over the step's logits with the request ids of their rows. From the previous step's
layout and this one, `apply` derives the BatchUpdate (removed, then added, then moved,
as in actors/protocol/logits_processors.py), so batch index i always names the request
whose logits are row i.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from actors.protocol.logits_processors import (
    AddedRequest,
    BatchUpdate,
    LogitsProcessor,
    LogitsProcessorConfig,
    MoveDirectionality,
    MovedRequest,
    load_logits_processor_classes,
)
from actors.protocol.sampling_params import SamplingParams


@dataclass(eq=False, slots=True)
class _Entry:
    """One request as the processors know it; compared by identity, so a request re-added
    under the same id (after a preemption) is a new entry and is added again."""

    params: SamplingParams
    prompt_token_ids: list[int]
    output_token_ids: list[int] = field(default_factory=list)


class LogitsProcessorBatch:
    def __init__(self, processors: Sequence[LogitsProcessor]) -> None:
        self.processors = list(processors)
        self._entries: dict[str, _Entry] = {}
        self._layout: list[_Entry | None] = []

    @classmethod
    def load(
        cls, specs: Sequence[str], config: LogitsProcessorConfig, device: torch.device
    ) -> LogitsProcessorBatch:
        pin = device.type == "cuda"
        return cls(
            [
                proc_cls(config, device, pin)
                for proc_cls in load_logits_processor_classes(tuple(specs))
            ]
        )

    def add_request(
        self,
        request_id: str,
        params: SamplingParams,
        prompt_token_ids: Sequence[int],
        output_token_ids: Sequence[int],
    ) -> None:
        self._entries[request_id] = _Entry(params, list(prompt_token_ids), list(output_token_ids))

    def remove_request(self, request_id: str) -> None:
        self._entries.pop(request_id, None)

    def append_output(self, request_id: str, token_id: int) -> None:
        self._entries[request_id].output_token_ids.append(token_id)

    def apply(
        self,
        logits: torch.Tensor,  # [num_rows, vocab_size] float32, row i = request_ids[i]
        request_ids: Sequence[str],
        all_greedy: bool,
    ) -> torch.Tensor:  # [num_rows, vocab_size] float32, processed
        """Update every processor's state to this step's rows, then apply them in the
        configured order; argmax-invariant ones are skipped when every row is greedy."""
        if logits.shape[0] != len(request_ids):
            raise ValueError(f"{logits.shape[0]} logit rows for {len(request_ids)} requests")
        batch_update = self._batch_update([self._entries[r] for r in request_ids])
        for processor in self.processors:
            processor.update_state(batch_update)
        for processor in self.processors:
            if all_greedy and processor.is_argmax_invariant():
                continue
            logits = processor.apply(logits)
        return logits

    def _batch_update(self, new_layout: list[_Entry]) -> BatchUpdate | None:
        update, self._layout = diff_layouts(self._layout, new_layout)
        return update


def diff_layouts(
    old: Sequence[_Entry | None], new: Sequence[_Entry]
) -> tuple[BatchUpdate | None, list[_Entry | None]]:
    """The BatchUpdate that turns layout `old` into `new`, and the resulting layout (== new).
    Added requests only take empty indices, so no surviving request is overwritten; moves
    then put every survivor where `new` wants it."""
    wanted = {id(entry) for entry in new}
    removed = [i for i, e in enumerate(old) if e is not None and id(e) not in wanted]
    slots: list[_Entry | None] = [e if e is not None and id(e) in wanted else None for e in old]
    slots += [None] * max(0, len(new) - len(slots))
    present = {id(e) for e in slots if e is not None}
    free = (i for i in range(len(new)) if slots[i] is None)
    added: list[AddedRequest] = []
    for entry in new:
        if id(entry) not in present:
            index = next(free)
            slots[index] = entry
            added.append((index, entry.params, entry.prompt_token_ids, entry.output_token_ids))
    moved = _moves_into_place(slots, new)
    assert all(e is None for e in slots[len(new) :])
    layout = slots[: len(new)]
    if not (removed or added or moved) and len(old) == len(new):
        return None, layout
    return BatchUpdate(batch_size=len(new), removed=removed, added=added, moved=moved), layout


def _moves_into_place(slots: list[_Entry | None], new: Sequence[_Entry]) -> list[MovedRequest]:
    """Moves (applied to `slots` as they are listed) that leave new[j] at index j."""
    where = {id(e): i for i, e in enumerate(slots) if e is not None}
    moved: list[MovedRequest] = []
    for target, entry in enumerate(new):
        source = where[id(entry)]
        if source == target:
            continue
        occupant = slots[target]
        if occupant is None:
            moved.append((source, target, MoveDirectionality.UNIDIRECTIONAL))
            slots[source] = None
        else:
            moved.append((source, target, MoveDirectionality.SWAP))
            slots[source] = occupant
            where[id(occupant)] = source
        slots[target] = entry
        where[id(entry)] = target
    return moved
