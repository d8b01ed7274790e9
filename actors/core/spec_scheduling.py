"""How the scheduler plans speculative (ngram) decoding rows and corrects them afterwards.

The drafts are proposed on the device, after the previous step's tokens are known there,
so the scheduler never sees them. It plans with an upper bound instead: a decoding row
that speculates runs its last token plus K draft slots (fewer near max_tokens or the
token budget), and counts every slot as an output placeholder and as computed, so its
KV blocks cover every position the row can reach. The runner fills the slots with the
row's drafts (slots without a draft run a filler token whose logits nobody reads) and
emits the accepted drafts plus one token: between 1 and 1 + slots tokens.

When the step's result arrives the row is corrected: placeholders drop by 1 + slots and
`num_computed_tokens` by the rejected slots (1 + slots - emitted). A step scheduled in
between was planned on the upper bound, so its positions are only shifted: the device
reads its own computed count, and the correction makes the scheduler's mirror exact again
once every step in flight has reported. The KV slots of rejected positions are reused: the
next step computes those positions again and overwrites them. Their blocks stay with the
request (the request grows into them), so nothing is freed early and no block table
shrinks under an in-flight step.

A request whose slots emitted nothing (no draft matched, or every draft was rejected)
pauses its speculation for a number of steps that doubles with each such run, up to
MAX_BACKOFF_STEPS: where drafts do not pay (text that repeats nothing, random weights)
the wider forward is paid about once every MAX_BACKOFF_STEPS steps. An isolated miss of a
request whose drafts are mostly accepted (measured acceptance of its first draft still at
least KEEP_ACCEPTING_RATE) pauses nothing. The pause holds only where it saves something:
a pure-decode step that speculates runs every row at K + 1 tokens anyway, so there a
pausing row takes its slots too, and an accepted draft ends its pause early. Until one of its
speculative steps has emitted a draft (a new request, or one whose latest speculative step
reported nothing accepted), a request speculates in one step at a time: with two steps in
flight, the step after a probe is planned before the probe reports, and would pay the
wider forward again on the same unconfirmed bet.

Rows that do not speculate: requests with penalties (their output counts would have to
see the drafts) and requests with a structured output (the grammar would have to advance
over the drafts). They decode one token per step next to speculating rows. Whole steps
run without draft slots when a request with a grammar runs (the speculative step applies
no grammar mask) or one whose prompt logprobs are due could be in it (it scores no
prompt): the scheduler alone decides what a step runs, and the runners refuse a step that
breaks these rules.

How many slots a step runs (K, 0 for none) is the draft-length policy's choice
(actors/core/spec_policy.py): each request's measured acceptance against what the wider
forward costs at the step's batch size. A pure-decode step that speculates runs every row
at K + 1 tokens on the device (rows with fewer slots padded, their padding writing no KV:
gpu/spec_decode/uniform_graphs.py), so the padding needs no block here: the scheduler
counts, reserves and corrects only a row's own slots.
"""

from __future__ import annotations

import sys
from collections.abc import Collection, Iterable

from actors.core.request import Request, RequestStatus
from actors.core.spec_policy import choose_draft_len, record_acceptance
from actors.protocol.messages import StepOutput


def speculates(request: Request) -> bool:
    """Whether `request` may run draft slots (see the module doc)."""
    params = request.sampling_params
    return (
        params.presence_penalty == 0.0
        and params.frequency_penalty == 0.0
        and params.repetition_penalty == 1.0
        and params.structured_output is None
        and request.prompt_embeds is None  # drafts would match its placeholder tokens
    )


MAX_BACKOFF_STEPS = 64
"""Longest pause in a request's speculation after its drafts kept failing."""

KEEP_ACCEPTING_RATE = 0.5
"""Measured acceptance of a request's first draft (actors/core/spec_policy.py) from which
a speculative step that emitted no draft does not pause its speculation."""

PROBE_PENDING = sys.maxsize
"""spec_resume_step of a request whose unconfirmed speculative step has not reported."""


def start_speculating(request: Request) -> None:
    """`request` runs draft slots in the step being committed: unless its latest reported
    speculative step emitted a draft, it runs none again until this one reports."""
    if not request.spec_accepting:
        request.spec_resume_step = PROBE_PENDING


def num_draft_slots(request: Request, num_speculative_tokens: int, token_budget: int) -> int:
    """Draft slots a running request could take, backing off or not: 0 unless it is
    decoding (one token left to compute) and speculates; never more outputs than
    max_tokens allows, nor more tokens than the budget holds (the last token comes first)."""
    if num_speculative_tokens == 0:
        return 0
    if request.num_tokens_with_placeholders - request.num_computed_tokens != 1:
        return 0
    if not speculates(request):
        return 0
    num_outputs_left = request.max_total_tokens - request.num_tokens_with_placeholders
    return max(0, min(num_speculative_tokens, num_outputs_left - 1, token_budget - 1))


def blocks_speculation(request: Request) -> bool:
    """Whether `request`, while unfinished, may keep whole steps from speculating (see
    `wanted_draft_slots`): it has a structured output (its grammar may still be compiling)
    or wants prompt logprobs."""
    params = request.sampling_params
    return params.structured_output is not None or params.prompt_logprobs is not None


def wanted_draft_slots(
    running: Collection[Request],
    blockers: Iterable[Request],
    num_speculative_tokens: int,
    step_id: int,
    token_budget: int,
    block_size: int,
    prefill_expected: bool = False,
) -> list[int] | None:
    """The draft slots each of `running` takes in step `step_id` (`num_draft_slots` unless
    it backs off, before the token budget, cut to the policy's K), or None when the step
    runs none: one of the unfinished `blockers` (`blocks_speculation`) may sample under a
    grammar or score its prompt in it, or the policy finds speculation does not pay
    (actors/core/spec_policy.py).
    prefill_expected: waiting requests may join the step (it is not pure decode)."""
    for request in blockers:
        if (
            request.grammar is not None
            or request.status is not RequestStatus.RUNNING
            or request.num_computed_tokens < request.num_prompt_tokens
        ):
            return None  # a grammar row, or a prompt to score (now or once admitted)
    wanted, free_rides, drafting = [], [], []
    num_decoding = num_other_tokens = 0
    for request in running:
        eligible = num_draft_slots(request, num_speculative_tokens, num_speculative_tokens + 1)
        backing_off = step_id < request.spec_resume_step
        num_slots = 0 if backing_off else eligible
        wanted.append(num_slots)
        free_rides.append(min(eligible, _room(request, block_size)) if backing_off else 0)
        num_pending = request.num_tokens_with_placeholders - request.num_computed_tokens
        if num_pending == 1:
            num_decoding += 1
        else:
            num_other_tokens += max(num_pending, 0)
        if num_slots:
            # Measured rates once a speculative step of the request accepted a draft; the
            # probe prior before (a new request, or one probing again after a back-off).
            drafting.append(
                (num_slots, request.spec_accept_rates if request.spec_accepting else ())
            )
    num_other_tokens = min(num_other_tokens, token_budget)
    uniform = num_other_tokens == 0 and not prefill_expected
    draft_len = choose_draft_len(
        drafting, num_decoding, num_other_tokens, num_speculative_tokens, uniform
    )
    if not draft_len:
        return None
    if uniform:
        # Every row of a padded step runs K + 1 tokens: slots cost the rows backing off
        # nothing more, and tell them early when their drafts start to pay; but only within
        # the blocks they hold (a new block could cost another request its place).
        wanted = [n + free for n, free in zip(wanted, free_rides)]
    return [min(n, draft_len) for n in wanted]


def _room(request: Request, block_size: int) -> int:
    """Positions past its next token that `request`'s blocks already hold."""
    return max(0, len(request.block_ids) * block_size - request.num_computed_tokens - 1)


def correct_after_step(
    request: Request, num_slots: int, num_emitted: int, next_step_id: int
) -> None:
    """Resolve a speculating row's placeholders once its step reported `num_emitted`
    tokens (its outputs were appended already; `next_step_id` is the next step the
    scheduler will build), and back off: slots that
    emitted nothing (no draft, or none accepted) cost a wider forward for nothing, so the
    request runs without them for 1, 2, 4, ... MAX_BACKOFF_STEPS steps after each such run
    in a row. Tokens never depend on this, only the speed does."""
    if num_slots:
        record_acceptance(request.spec_accept_rates, num_slots, num_emitted - 1)
        # One miss among accepted drafts is not a change of text: measured acceptance
        # still above KEEP_ACCEPTING_RATE keeps the request speculating without a pause.
        request.spec_accepting = num_emitted > 1 or (
            request.spec_accepting and request.spec_accept_rates[0] >= KEEP_ACCEPTING_RATE
        )
        if request.spec_accepting:
            request.spec_backoff_steps = 0
        else:
            request.spec_backoff_steps = min(
                max(1, 2 * request.spec_backoff_steps), MAX_BACKOFF_STEPS
            )
        request.spec_resume_step = next_step_id + request.spec_backoff_steps
    request.num_output_placeholders -= 1 + num_slots
    if request.status is RequestStatus.RUNNING:
        # A preempted request restarts from 0 computed tokens: nothing to roll back.
        request.num_computed_tokens -= 1 + num_slots - num_emitted


def emitted_counts(out: StepOutput, draft_slots: dict[str, int]) -> list[int] | None:
    """Tokens each request of `out` emitted; None when they do not add up or a request
    emitted more than its last token plus its draft slots."""
    if out.num_sampled_tokens is None:  # one each, which any row's slots allow
        counts = [1] * len(out.request_ids)
        return counts if len(counts) == len(out.sampled_token_ids) else None
    counts = out.num_sampled_tokens.tolist()
    if len(counts) != len(out.request_ids) or sum(counts) != len(out.sampled_token_ids):
        return None
    for request_id, count in zip(out.request_ids, counts):
        if not 1 <= count <= 1 + draft_slots.get(request_id, 0):
            return None
    return counts
