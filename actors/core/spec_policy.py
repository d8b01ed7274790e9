"""The draft-length policy: how many draft slots (K) a step runs, 0 for no speculation.

A speculative step verifies K drafts per decoding row in one wider forward. Whether that
pays depends on how many drafts each row gets accepted and on what the wider forward costs
at the step's batch size: at batch 1 the extra tokens are nearly free, at batch 128 they
are not. The policy weighs both each step, from two ingredients.

Acceptance, per request. `Request.spec_accept_rates[j - 1]` estimates the chance that the
request's draft j is accepted when it has a slot for it: an exponential moving average
(weight ACCEPT_RATE_WEIGHT) of "at least j drafts were accepted", updated for j = 1..s
after each speculative step that gave it s slots (`record_acceptance`). A slot without a
draft counts as a rejection: it cost a token and emitted nothing. A request that has not
yet had a draft accepted in its latest speculative step (new, or probing again after a
back-off, actors/core/spec_scheduling.py) is estimated at the probe prior
PROBE_ACCEPT_RATE ** j instead. Expected accepted drafts with k slots: the sum of the
first k estimates.

Cost, per step. A step of n query tokens costs, in units of a one-token decode step,

    cost(n) = 1 + n / KNEE_TOKENS + SPEC_STEP_OVERHEAD (speculative steps only)

KNEE_TOKENS is where the extra tokens double a decode step's time: decode reads every
weight once per step whatever its token count, so tokens are nearly free until the step
becomes compute-bound, around the accelerator's FLOP/byte ridge (about 150-300 tokens on
an H100 or H200 in bf16; a small model's per-step overheads push it higher). The KV a
row attends to is read once for its K + 1 queries, so only the token count enters.
SPEC_STEP_OVERHEAD is the speculative tail's fixed part (sampling K + 1 rows per request,
acceptance, proposing). In a step that is pure decode (every running row decoding, no
prefill chunk expected) every row runs K + 1 tokens, the rows without drafts padded
(gpu/spec_decode/uniform_graphs.py); otherwise a row runs 1 + its slots.

Choice. K = the k in 0..K_max that maximises expected emitted tokens per cost,

    rate(k) = (num_rows + sum over drafting rows of expected accepted(min(k, cap))) / cost

where a row's cap is the slots it may take (max_tokens, back-off: `num_draft_slots`); k > 0
must beat rate(0) by MIN_SPEEDUP, or the step runs plain. Nothing here decides a token:
every verified position emits what the plain sampler would (gpu/spec_decode/spec_step.py),
so any K gives the same outputs, greedy and seeded alike; only the speed differs.
"""

from __future__ import annotations

from collections.abc import Sequence

KNEE_TOKENS = 256.0
"""Query tokens that double a decode step's cost (see the module doc)."""
SPEC_STEP_OVERHEAD = 0.05
"""Fixed cost of a speculative step's tail, in decode steps."""
MIN_SPEEDUP = 0.05
"""Predicted gain below which a step does not speculate (the model is rough)."""
PROBE_ACCEPT_RATE = 0.7
"""Acceptance assumed for draft 1 of a request without a recent accepted draft; draft j
is assumed accepted with PROBE_ACCEPT_RATE ** j."""
ACCEPT_RATE_WEIGHT = 0.25
"""Weight of the newest step in a request's acceptance averages."""


def probe_rate(position: int) -> float:
    """The prior acceptance of draft `position` (1-based)."""
    return PROBE_ACCEPT_RATE**position


def record_acceptance(rates: list[float], num_slots: int, num_accepted: int) -> None:
    """Fold one speculative step (num_slots slots, num_accepted drafts accepted) into a
    request's per-position acceptance averages, in place."""
    for index in range(num_slots):
        if index == len(rates):
            rates.append(probe_rate(index + 1))
        hit = 1.0 if num_accepted > index else 0.0
        rates[index] += ACCEPT_RATE_WEIGHT * (hit - rates[index])


def expected_accepted(rates: Sequence[float], num_slots: int) -> float:
    """Expected accepted drafts with `num_slots` slots: the first num_slots estimates
    (positions past `rates` at the probe prior)."""
    return sum(
        rates[index] if index < len(rates) else probe_rate(index + 1) for index in range(num_slots)
    )


def step_cost(num_tokens: int, speculative: bool) -> float:
    """A step of num_tokens query tokens, in one-token decode steps (see the module doc)."""
    return 1.0 + num_tokens / KNEE_TOKENS + (SPEC_STEP_OVERHEAD if speculative else 0.0)


def choose_draft_len(
    drafting: Sequence[tuple[int, Sequence[float]]],
    num_decoding: int,
    num_other_tokens: int,
    max_draft_len: int,
    uniform: bool,
) -> int:
    """The step's K (0: plain). drafting: (cap, acceptance estimates) of each row that may
    take slots; num_decoding: rows that decode (drafting or not); num_other_tokens: prefill
    tokens in the step; uniform: a pure-decode step, every decoding row padded to K + 1."""
    if not drafting or max_draft_len < 1:
        return 0
    num_rows = max(num_decoding, len(drafting))
    best_len = 0
    best_rate = num_rows / step_cost(num_rows + num_other_tokens, False) * (1.0 + MIN_SPEEDUP)
    for draft_len in range(1, max_draft_len + 1):
        gain = sum(expected_accepted(rates, min(draft_len, cap)) for cap, rates in drafting)
        if uniform:
            num_tokens = num_rows * (1 + draft_len)
        else:
            num_tokens = num_rows + sum(min(draft_len, cap) for cap, _ in drafting)
        rate = (num_rows + gain) / step_cost(num_tokens + num_other_tokens, True)
        if rate > best_rate:
            best_len, best_rate = draft_len, rate
    return best_len
