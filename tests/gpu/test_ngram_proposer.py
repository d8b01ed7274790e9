"""The V1 CPU proposer drafts what the kernel reference's rule says, on histories built
piece by piece as a runner would (new request, then accepted tokens each step)."""

from __future__ import annotations

import random

import numpy as np
import pytest

from actors.protocol.speculative_config import SpeculativeConfig
from gpu.spec_decode.ngram_proposer import NgramProposer
from tests.kernels.test_ngram_propose import oracle


def _config(k: int, min_n: int, max_n: int) -> SpeculativeConfig:
    return SpeculativeConfig("ngram", k, min_n, max_n)


@pytest.mark.parametrize("seed", range(4))
def test_drafts_follow_the_rule_as_histories_grow(seed: int) -> None:
    rng = random.Random(seed)
    max_model_len, num_rows = 64, 8
    config = _config(rng.randint(1, 5), 1, rng.randint(1, 4))
    proposer = NgramProposer(config, num_rows, max_model_len)
    histories = {}
    for row in range(num_rows):
        histories[row] = [rng.randrange(5) for _ in range(rng.randrange(1, 20))]
        proposer.add_request(row, histories[row])
    for _ in range(8):
        rows = rng.sample(range(num_rows), rng.randint(1, num_rows))
        drafts, num_drafts = proposer.propose(np.asarray(rows, dtype=np.int32))
        for b, row in enumerate(rows):
            expected = oracle(
                histories[row],
                config.num_speculative_tokens,
                config.prompt_lookup_min,
                config.prompt_lookup_max,
                max_model_len,
            )
            assert drafts[b, : num_drafts[b]].tolist() == expected
            accepted = [rng.randrange(5) for _ in range(rng.randint(1, 3))]
            proposer.append(row, accepted)
            histories[row] += accepted


def test_the_context_limit_caps_drafts_as_without_narrowing() -> None:
    proposer = NgramProposer(_config(4, 2, 2), max_num_reqs=2, max_model_len=7)
    proposer.add_request(0, [1, 2, 3, 1, 2])  # 2 slots left: drafts stop at the limit
    proposer.add_request(1, [1, 2, 3])
    drafts, num_drafts = proposer.propose(np.array([0, 1], dtype=np.int32))
    assert num_drafts.tolist() == [2, 0]
    assert drafts[0].tolist() == [3, 1, -1, -1]


def test_a_reused_row_forgets_the_previous_request() -> None:
    proposer = NgramProposer(_config(2, 1, 1), max_num_reqs=1, max_model_len=16)
    proposer.add_request(0, [4, 5, 6, 4])
    assert proposer.propose(np.array([0]))[0][0].tolist() == [5, 6]
    proposer.add_request(0, [7, 8])
    assert proposer.propose(np.array([0]))[1].tolist() == [0]


def test_histories_longer_than_the_context_are_refused() -> None:
    proposer = NgramProposer(_config(2, 1, 1), max_num_reqs=1, max_model_len=4)
    proposer.add_request(0, [1, 2, 3])
    with pytest.raises(ValueError, match="more than max_model_len 4"):
        proposer.append(0, [4, 5])
