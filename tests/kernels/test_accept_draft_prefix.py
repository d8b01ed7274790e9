"""accept_draft_prefix: drafts accepted while they equal the sampled token, then one more;
-1 drafts and rows without drafts; the CUDA kernel against the reference."""

from __future__ import annotations

import torch

from kernels.rejection_sample import accept_draft_prefix
from tests.kernels._triton_interpreter import cuda_test


def test_accepts_the_matching_prefix_then_emits_the_sampled_token() -> None:
    # request 0: 3 logit rows (2 drafts), request 1: 1 row, request 2: 3 rows but one draft.
    cu = torch.tensor([0, 3, 4, 7], dtype=torch.int32)
    drafts = torch.tensor([[4, 5], [-1, -1], [8, -1]], dtype=torch.int32)
    sampled = torch.tensor([4, 6, 1, 9, 8, 3, 3])
    output, accepted = accept_draft_prefix(cu, drafts, sampled)
    assert accepted.tolist() == [1, 0, 1]
    assert output.tolist() == [[4, 6, -1], [9, -1, -1], [8, 3, -1]]


@cuda_test
def test_cuda_kernel_matches_the_reference() -> None:
    generator = torch.Generator().manual_seed(3)
    num_reqs, k = 300, 5
    counts = torch.randint(1, k + 2, (num_reqs,), generator=generator)
    cu = torch.cat([torch.zeros(1, dtype=torch.int64), counts.cumsum(0)]).to(torch.int32)
    sampled = torch.randint(0, 4, (int(cu[-1]),), generator=generator)
    drafts = torch.randint(-1, 4, (num_reqs, k), generator=generator, dtype=torch.int32)
    expected = accept_draft_prefix(cu, drafts, sampled)
    got = accept_draft_prefix(cu.cuda(), drafts.cuda(), sampled.cuda())
    assert torch.equal(got[0].cpu(), expected[0]) and torch.equal(got[1].cpu(), expected[1])
