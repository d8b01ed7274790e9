"""benchmarks/fp8_quality.py's comparisons (the GPU run itself is a device benchmark)."""

from __future__ import annotations

import pytest

from benchmarks.fp8_quality import compare_greedy, compare_scores


def test_scores_compare_the_same_positions_and_count_top1_flips() -> None:
    reference = [[(-1.0, 5), (-2.0, 7)], [(-0.5, 3)]]
    arm = [[(-1.5, 5), (-2.0, 8)], [(-0.25, 3)]]
    compared = compare_scores(reference, arm)
    assert compared["positions"] == 3
    assert compared["logprob_abs_diff"] == {"mean": 0.25, "p99": 0.5, "max": 0.5}
    assert compared["top1_agreement"] == pytest.approx(2 / 3, abs=1e-5)
    with pytest.raises(ValueError):  # an arm that scored other positions is no comparison
        compare_scores(reference, [[(-1.0, 5)], [(-0.5, 3)]])


def test_greedy_agreement_is_the_common_prefix() -> None:
    compared = compare_greedy([[1, 2, 3], [4, 5, 6]], [[1, 2, 3], [4, 9, 6]])
    assert compared == {
        "greedy_common_prefix_mean": 2.0,
        "greedy_identical": 1,
        "greedy_prompts": 2,
    }
