"""Sampler end to end on CPU tensors, the references: seeds and batch invariance, the
distribution and its filters, penalties, bias and min_tokens, logprobs, and which ops run
(the CUDA sampler against these: test_sampler_cuda.py)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

import gpu.sampling.sampler as sampler_module
from actors.protocol.sampling_params import SamplingParams
from tests.gpu._sampler_cases import EOS, VOCAB, _logits, _run, _sampler

# ---- seeds and batch invariance ---------------------------------------------------------


def test_seeded_sampling_is_reproducible_and_depends_on_the_seed() -> None:
    logits = _logits(1).expand(50, VOCAB).contiguous()
    draws = {}
    for seed in (11, 11, 12):
        sampler = _sampler({4: SamplingParams(temperature=1.0, seed=seed)})
        draws.setdefault(seed, []).append(
            _run(sampler, logits, [4] * 50, range(50)).sampled_token_ids
        )
    assert torch.equal(draws[11][0], draws[11][1])
    assert not torch.equal(draws[11][0], draws[12][0])
    assert len(set(draws[11][0].tolist())) > 5  # fresh noise at each position


def test_unseeded_requests_use_the_default_seed() -> None:
    logits = _logits(30)
    first = _run(_sampler({0: SamplingParams()}), logits, [0] * 30, range(30)).sampled_token_ids
    again = _run(_sampler({0: SamplingParams()}), logits, [0] * 30, range(30)).sampled_token_ids
    assert torch.equal(first, again)


@pytest.mark.parametrize(
    "params",
    [
        SamplingParams(temperature=0.8, seed=99),
        SamplingParams(temperature=1.2, top_k=20, top_p=0.9, seed=99),
    ],
)
def test_a_draw_does_not_depend_on_batch_composition_or_order(params: SamplingParams) -> None:
    others = {
        row: SamplingParams(temperature=0.5 + row / 10, top_k=row, seed=row) for row in range(1, 16)
    }
    sampler = _sampler({0: params, **others})
    row_logits = _logits(1, seed=5, scale=2.0)
    alone = _run(sampler, row_logits, [0], [123]).sampled_token_ids.item()
    for place in (0, 7, 15):
        rows = [r for r in range(1, 16)]
        rows.insert(place, 0)
        batch_logits = _logits(16, seed=place, scale=2.0)
        batch_logits[place] = row_logits[0]
        positions = [500 + r for r in range(16)]
        positions[place] = 123
        assert _run(sampler, batch_logits, rows, positions).sampled_token_ids[place].item() == alone


# ---- the distribution -------------------------------------------------------------------


@pytest.mark.parametrize("temperature", [0.7, 1.0, 1.6])
def test_sampling_frequencies_match_softmax_over_temperature(temperature: float) -> None:
    num_draws = 20_000
    base = torch.tensor([[1.0, 0.5, 0.0, -0.5, 2.0, -1.0, 0.3, 1.5]])
    sampler = _sampler({0: SamplingParams(temperature=temperature, seed=2024)}, vocab_size=8)
    sampled = _run(
        sampler, base.expand(num_draws, 8).contiguous(), [0] * num_draws, range(num_draws)
    ).sampled_token_ids
    observed = torch.bincount(sampled, minlength=8).double()
    expected = torch.softmax(base[0].double() / temperature, dim=0) * num_draws
    chi_square = ((observed - expected) ** 2 / expected).sum().item()
    assert chi_square < 24.32  # 7 degrees of freedom, p = 0.001


def _allowed(
    logits: np.ndarray, temperature: float, top_k: int = 0, top_p: float = 1.0, min_p: float = 0.0
) -> set[int]:
    """The kept set by definition: min-p, then top-k, then top-p over the survivors."""
    scaled = logits / temperature
    probs = np.exp(scaled - scaled.max())
    probs /= probs.sum()
    keep = probs >= min_p * probs.max()
    order = [t for t in np.argsort(-scaled, kind="stable") if keep[t]]
    if top_k > 0:
        order = order[:top_k]
    mass = probs[order] / probs[order].sum()
    kept, mass_before = [], 0.0
    for token, p in zip(order, mass, strict=True):
        if mass_before >= top_p:
            break
        kept.append(int(token))
        mass_before += p
    return set(kept)


@pytest.mark.parametrize(
    "filters",
    [
        {"top_k": 5},
        {"top_p": 0.6},
        {"min_p": 0.3},
        {"top_k": 12, "top_p": 0.8, "min_p": 0.05},
    ],
)
def test_filters_never_emit_an_excluded_token(filters: dict[str, float]) -> None:
    num_draws, temperature = 3000, 0.9
    row_logits = _logits(1, seed=17, scale=1.5)
    sampler = _sampler({2: SamplingParams(temperature=temperature, seed=3, **filters)})
    sampled = _run(
        sampler, row_logits.expand(num_draws, VOCAB).contiguous(), [2] * num_draws, range(num_draws)
    ).sampled_token_ids
    allowed = _allowed(row_logits[0].numpy().astype(np.float64), temperature, **filters)
    assert 1 < len(allowed) < VOCAB
    assert set(sampled.tolist()) <= allowed
    assert len(set(sampled.tolist())) >= len(allowed) // 2  # filtering, not collapsing


# ---- penalties, bias, min_tokens ----------------------------------------------------------


def _hand_penalised(
    logits: np.ndarray,
    prompt: list[int],
    counts: np.ndarray,
    repetition: float,
    frequency: float,
    presence: float,
) -> np.ndarray:
    out = logits.astype(np.float64).copy()
    seen = counts > 0
    seen[prompt] = True
    out[seen & (out > 0)] /= repetition
    out[seen & (out <= 0)] *= repetition
    return out - frequency * counts - presence * (counts > 0)


def test_penalties_match_the_openai_formulas() -> None:
    outputs = {0: [9, 9, 4], 1: [4, 30, 30, 30], 2: []}
    params = {
        0: SamplingParams(temperature=0.0, repetition_penalty=1.8),
        1: SamplingParams(temperature=0.0, frequency_penalty=1.1, presence_penalty=0.6),
        2: SamplingParams(temperature=0.0, repetition_penalty=0.5, presence_penalty=-1.0),
    }
    sampler = _sampler(params, outputs=outputs)
    for trial in range(20):
        logits = _logits(3, seed=trial, scale=0.7)
        sampled = _run(sampler, logits, [0, 1, 2], [10, 10, 10]).sampled_token_ids
        for row, p in params.items():
            counts = np.bincount(np.asarray(outputs[row], dtype=np.int64), minlength=VOCAB)
            hand = _hand_penalised(
                logits[row].numpy(),
                [1, 2, 3],
                counts,
                p.repetition_penalty,
                p.frequency_penalty,
                p.presence_penalty,
            )
            assert sampled[row].item() == int(np.argmax(hand))


def test_recorded_samples_feed_the_frequency_penalty() -> None:
    sampler = _sampler({0: SamplingParams(temperature=0.0, frequency_penalty=2.0)})
    logits = torch.zeros(1, VOCAB)
    logits[0, 10], logits[0, 11] = 3.0, 2.0
    rows_gpu = torch.tensor([0], dtype=torch.int32)
    assert _run(sampler, logits, [0], [3]).sampled_token_ids.item() == 10
    sampler.state.record_sampled(rows_gpu, torch.tensor([10]), torch.tensor([True]))
    assert _run(sampler, logits, [0], [4]).sampled_token_ids.item() == 11  # 3 - 2 < 2
    sampler.state.record_sampled(rows_gpu, torch.tensor([11]), torch.tensor([False]))  # not real
    assert _run(sampler, logits, [0], [5]).sampled_token_ids.item() == 11


def test_penalties_and_bias_compose_with_sampling_like_hand_processed_logits() -> None:
    processed = SamplingParams(
        temperature=0.9,
        seed=8,
        presence_penalty=1.5,
        repetition_penalty=1.3,
        logit_bias=((5, 4.0), (6, -50.0)),
    )
    plain = SamplingParams(temperature=0.9, seed=8)
    sampler = _sampler({0: processed, 1: plain}, outputs={0: [20, 21, 21]})
    logits = _logits(1, seed=1).expand(200, VOCAB).contiguous()
    actual = _run(sampler, logits, [0] * 200, range(200)).sampled_token_ids
    biased = logits[0].numpy().astype(np.float64)
    biased[5] += 4.0
    biased[6] -= 50.0
    counts = np.bincount([20, 21, 21], minlength=VOCAB)
    hand = torch.tensor(
        _hand_penalised(biased, [1, 2, 3], counts, 1.3, 0.0, 1.5), dtype=torch.float32
    )
    expected = _run(
        sampler, hand.expand(200, VOCAB).contiguous(), [1] * 200, range(200)
    ).sampled_token_ids
    assert torch.equal(actual, expected)


def test_min_tokens_suppresses_eos_and_stop_ids_until_reached() -> None:
    logits = torch.full((1, VOCAB), -5.0)
    logits[0, EOS], logits[0, 9], logits[0, 12] = 10.0, 9.0, 8.0
    sampler = _sampler(
        {
            0: SamplingParams(temperature=0.0, min_tokens=2, stop_token_ids=(9,)),
            1: SamplingParams(temperature=0.0, min_tokens=2, stop_token_ids=(9,), ignore_eos=True),
            2: SamplingParams(temperature=1.0, min_tokens=3, seed=1),
        }
    )
    greedy = [_run(sampler, logits, [0], [5], [n]).sampled_token_ids.item() for n in range(4)]
    assert greedy == [12, 12, EOS, EOS]
    assert _run(sampler, logits, [1], [5], [0]).sampled_token_ids.item() == EOS  # EOS allowed
    draws = _run(sampler, logits.expand(300, VOCAB).contiguous(), [2] * 300, range(300), [2] * 300)
    assert EOS not in draws.sampled_token_ids.tolist()


def test_logit_bias_is_applied() -> None:
    logits = torch.zeros(2, VOCAB)
    logits[:, 3] = 5.0
    sampler = _sampler(
        {
            0: SamplingParams(temperature=0.0, logit_bias=((40, 6.0),)),
            1: SamplingParams(temperature=0.0, logit_bias=((3, -100.0), (50, 0.5))),
        }
    )
    assert _run(sampler, logits, [0, 1], [0, 0]).sampled_token_ids.tolist() == [40, 50]


# ---- logprobs -----------------------------------------------------------------------------


def test_logprobs_are_raw_log_softmax_at_the_sampled_and_top_ids(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    logits = _logits(6, scale=3.0)
    sampler = _sampler(
        {
            0: SamplingParams(
                temperature=0.5, seed=1, logprobs=4, top_k=3, logit_bias=((0, 20.0),)
            ),
            1: SamplingParams(temperature=0.0),
        }
    )
    expected_log_softmax = torch.log_softmax(logits, dim=-1)

    def forbidden(*args: object, **kwargs: object) -> None:
        raise AssertionError("the sampler must not build a full log-softmax")

    monkeypatch.setattr(torch, "log_softmax", forbidden)
    monkeypatch.setattr(torch.nn.functional, "log_softmax", forbidden)
    monkeypatch.setattr(torch.Tensor, "log_softmax", forbidden)
    out = _run(sampler, logits, [0, 1, 0, 1, 0, 0], range(6), max_num_logprobs=4)
    monkeypatch.undo()

    assert (
        out.logprob_token_ids is not None
        and out.logprobs is not None
        and out.sampled_ranks is not None
    )
    assert (out.sampled_token_ids[[0, 2, 4, 5]] == 0).all()  # the bias decides the draw...
    assert torch.equal(out.logprob_token_ids[:, 0], out.sampled_token_ids)
    assert torch.equal(out.logprob_token_ids[:, 1:], torch.topk(logits, 4).indices)
    torch.testing.assert_close(out.logprobs, expected_log_softmax.gather(1, out.logprob_token_ids))
    sampled_logits = logits.gather(1, out.sampled_token_ids[:, None])
    assert torch.equal(
        out.sampled_ranks, (logits > sampled_logits).sum(dim=1) + 1
    )  # ...not the raw rank


def test_no_logprobs_unless_asked() -> None:
    out = _run(_sampler({0: SamplingParams()}), _logits(2), [0, 0], [0, 1])
    assert out.logprobs is None and out.logprob_token_ids is None and out.sampled_ranks is None


# ---- which ops run -----------------------------------------------------------------------

OPS = ["apply_logit_bias", "apply_penalties", "sampling_thresholds"]


def _count_calls(monkeypatch: pytest.MonkeyPatch) -> dict[str, int]:
    calls = dict.fromkeys(OPS, 0)
    for name in OPS:
        real = getattr(sampler_module, name)

        def counted(
            *args: object, _name: str = name, _real: object = real, **kwargs: object
        ) -> object:
            calls[_name] += 1
            return _real(*args, **kwargs)  # type: ignore[operator]

        monkeypatch.setattr(sampler_module, name, counted)
    return calls


@pytest.mark.parametrize(
    ("params", "expected_ops"),
    [
        (SamplingParams(temperature=0.0), set()),
        (SamplingParams(temperature=0.0, top_k=5, top_p=0.5, min_p=0.2), set()),  # moot when greedy
        (SamplingParams(temperature=0.7), set()),  # the Gumbel kernel scales
        (SamplingParams(temperature=0.7, top_k=5), {"sampling_thresholds"}),
        (SamplingParams(temperature=0.7, top_p=0.5), {"sampling_thresholds"}),
        (SamplingParams(temperature=1.0, min_p=0.1), {"sampling_thresholds"}),
        (SamplingParams(temperature=0.0, presence_penalty=0.5), {"apply_penalties"}),
        (SamplingParams(temperature=0.0, min_tokens=1), {"apply_logit_bias"}),
        (
            SamplingParams(temperature=0.0, min_tokens=1, ignore_eos=True),
            set(),
        ),  # nothing to suppress
    ],
)
def test_only_the_ops_the_batch_needs_run(
    monkeypatch: pytest.MonkeyPatch, params: SamplingParams, expected_ops: set[str]
) -> None:
    calls = _count_calls(monkeypatch)
    sampler = _sampler({0: params, 1: SamplingParams(temperature=0.0), 9: SamplingParams(top_k=3)})
    _run(sampler, _logits(2), [0, 1], [0, 0])
    assert {name for name, count in calls.items() if count} == expected_ops


def test_a_greedy_batch_samples_the_logits_without_a_copy(monkeypatch: pytest.MonkeyPatch) -> None:
    seen: list[torch.Tensor] = []
    real = sampler_module.gumbel_sample
    monkeypatch.setattr(
        sampler_module,
        "gumbel_sample",
        lambda logits, *a, **k: seen.append(logits) or real(logits, *a, **k),
    )
    logits = _logits(3)
    out = _run(_sampler({0: SamplingParams(temperature=0.0)}), logits, [0, 0, 0], [0, 1, 2])
    assert seen[0] is logits and torch.equal(out.sampled_token_ids, logits.argmax(dim=1))


def test_bad_arguments_are_reported() -> None:
    sampler = _sampler({0: SamplingParams()})
    with pytest.raises(ValueError, match="vocab_size=64"):
        _run(sampler, torch.zeros(1, 10), [0], [0])
    with pytest.raises(ValueError, match="idx_mapping_np has 2 rows"):
        sampler(
            torch.zeros(1, VOCAB),
            torch.zeros(1, dtype=torch.int32),
            np.zeros(2, np.int32),
            torch.zeros(1, dtype=torch.int64),
            torch.zeros(1, dtype=torch.int32),
            None,
        )
