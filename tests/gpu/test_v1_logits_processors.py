"""Custom logits processors on the V1 runner's side: the batch updates keep every batch
index on the request whose logits are that row (property test over random step
sequences), the per-request arguments reach `apply`, and argmax-invariant processors are
skipped for all-greedy batches."""

from __future__ import annotations

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from actors.protocol.logits_processors import (
    BatchUpdate,
    LogitsProcessor,
    LogitsProcessorConfig,
    MoveDirectionality,
)
from actors.protocol.sampling_params import SamplingParams
from gpu.runner_v1.logits_processors import LogitsProcessorBatch
from tests.gpu._sample_logits_processor import ForceOrBanTokens

CONFIG = LogitsProcessorConfig(vocab_size=16, max_num_seqs=8, max_model_len=64, model="test")


class _LayoutMirror(LogitsProcessor):
    """Applies each BatchUpdate literally, as the interface describes it, to a list of
    (request marker, live output list) per batch index."""

    def __init__(
        self, config: LogitsProcessorConfig, device: torch.device, is_pin_memory: bool
    ) -> None:
        self.slots: list[tuple[str, list[int]] | None] = []
        self.num_none_updates = 0

    def is_argmax_invariant(self) -> bool:
        return True

    def update_state(self, batch_update: BatchUpdate | None) -> None:
        if batch_update is None:
            self.num_none_updates += 1
            return
        size = max(
            [batch_update.batch_size, len(self.slots)]
            + [i + 1 for i, *_ in batch_update.added]
            + [max(a, b) + 1 for a, b, _ in batch_update.moved]
        )
        self.slots += [None] * (size - len(self.slots))
        for index in batch_update.removed:
            assert self.slots[index] is not None, "removed an empty index"
            self.slots[index] = None
        for index, params, _prompt, output in batch_update.added:
            assert self.slots[index] is None, "an add overwrote a request still in the batch"
            self.slots[index] = (params.extra_args["marker"], output)
        for source, target, direction in batch_update.moved:
            if direction is MoveDirectionality.SWAP:
                self.slots[source], self.slots[target] = self.slots[target], self.slots[source]
            else:
                self.slots[target], self.slots[source] = self.slots[source], None
        assert all(s is None for s in self.slots[batch_update.batch_size :])
        del self.slots[batch_update.batch_size :]

    def apply(self, logits: torch.Tensor) -> torch.Tensor:
        return logits


def _params(marker: str, **extra) -> SamplingParams:
    return SamplingParams(temperature=0.0, extra_args={"marker": marker, **extra})


_steps = st.lists(
    st.tuples(
        st.lists(st.integers(0, 9), max_size=8, unique=True),  # scheduled, in order
        st.lists(st.integers(0, 9), max_size=3, unique=True),
    ),  # preempted and re-added
    min_size=1,
    max_size=12,
)


@settings(max_examples=150, deadline=None)
@given(_steps)
def test_batch_indices_always_name_the_rows_requests(steps) -> None:
    mirror = _LayoutMirror(CONFIG, torch.device("cpu"), False)
    batch = LogitsProcessorBatch([mirror])
    generation = {rid: 0 for rid in range(10)}
    for rid in range(10):
        batch.add_request(str(rid), _params(f"{rid}.0"), [1, 2], [])
    for step, (scheduled, readded) in enumerate(steps):
        for rid in readded:  # a preemption: the same id comes back as a new request
            batch.remove_request(str(rid))
            generation[rid] += 1
            batch.add_request(str(rid), _params(f"{rid}.{generation[rid]}"), [1, 2], [step])
        ids = [str(r) for r in scheduled]
        batch.apply(torch.zeros(len(ids), 4), ids, all_greedy=False)
        assert [s[0] for s in mirror.slots] == [f"{r}.{generation[r]}" for r in scheduled]
        for rid in scheduled:
            batch.append_output(str(rid), 100 + step)
        # The output lists processors hold are the live ones.
        for (marker, output), rid in zip(mirror.slots, scheduled):
            assert output and output[-1] == 100 + step


def test_an_unchanged_batch_gets_none() -> None:
    mirror = _LayoutMirror(CONFIG, torch.device("cpu"), False)
    batch = LogitsProcessorBatch([mirror])
    for rid in "ab":
        batch.add_request(rid, _params(rid), [1], [])
    batch.apply(torch.zeros(2, 4), ["a", "b"], all_greedy=False)
    batch.apply(torch.zeros(2, 4), ["a", "b"], all_greedy=False)
    assert mirror.num_none_updates == 1
    batch.apply(torch.zeros(2, 4), ["b", "a"], all_greedy=False)
    assert mirror.num_none_updates == 1 and [s[0] for s in mirror.slots] == ["b", "a"]


def test_force_and_ban_reach_their_rows_only() -> None:
    processor = ForceOrBanTokens(CONFIG, torch.device("cpu"), False)
    batch = LogitsProcessorBatch([processor])
    batch.add_request("force", _params("f", force_token_id=3), [1], [])
    batch.add_request("ban", _params("b", ban_token_ids=[0, 5]), [1], [])
    batch.add_request("plain", SamplingParams(), [1], [])
    logits = torch.arange(3 * 16, dtype=torch.float32).reshape(3, 16).flip(1)  # argmax 0
    out = batch.apply(logits.clone(), ["plain", "ban", "force"], all_greedy=True)
    assert out.argmax(dim=1).tolist() == [0, 1, 3]
    assert torch.isinf(out[2]).sum() == 15 and torch.equal(out[0], logits[0])
    out = batch.apply(logits[:2].clone(), ["force", "plain"], all_greedy=True)  # "ban" left
    assert out.argmax(dim=1).tolist() == [3, 0]


def test_argmax_invariant_processors_skip_all_greedy_batches() -> None:
    class Shift(_LayoutMirror):
        def apply(self, logits: torch.Tensor) -> torch.Tensor:
            return logits + 1.0

    batch = LogitsProcessorBatch([Shift(CONFIG, torch.device("cpu"), False)])
    batch.add_request("a", _params("a"), [1], [])
    assert batch.apply(torch.zeros(1, 4), ["a"], all_greedy=True).sum() == 0
    assert batch.apply(torch.zeros(1, 4), ["a"], all_greedy=False).sum() == 4
