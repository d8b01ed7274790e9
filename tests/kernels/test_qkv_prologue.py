"""qkv_prologue: per-head q/k norm, rotary and the KV write, against float64 math and
between the Triton kernel and the reference."""

from __future__ import annotations

import pytest
import torch

from kernels.qkv_prologue import qkv_prologue, qkv_prologue_ref, qkv_prologue_triton
from tests.kernels._fused_tolerance import assert_matches_reference
from tests.kernels._triton_interpreter import assert_interpreted, triton_vs_reference_tests

EPS = 1e-6
NUM_BLOCKS, BLOCK_SIZE = 8, 4


def _case(
    num_tokens: int,
    num_heads: int,
    num_kv_heads: int,
    head_dim: int,
    dtype: torch.dtype,
    qk_norm: bool,
    device: str = "cpu",
    seed: int = 0,
) -> dict:
    generator = torch.Generator().manual_seed(seed)
    width = (num_heads + 2 * num_kv_heads) * head_dim
    inv_freq = 1.0 / (10000 ** (torch.arange(0, head_dim, 2).double() / head_dim))
    angles = torch.arange(128).double()[:, None] * inv_freq[None, :]
    slots = torch.randperm(NUM_BLOCKS * BLOCK_SIZE, generator=generator)[:num_tokens]
    slots[1::4] = -1  # padding tokens write nothing
    norm = (
        (lambda: torch.randn(head_dim, generator=generator).to(dtype).to(device))
        if qk_norm
        else (lambda: None)
    )
    return dict(
        qkv=torch.randn(num_tokens, width, generator=generator).to(dtype).to(device),
        positions=torch.randint(0, 128, (num_tokens,), generator=generator).to(device),
        cos_cache=angles.cos().float().to(device),
        sin_cache=angles.sin().float().to(device),
        q_norm_weight=norm(),
        k_norm_weight=norm(),
        eps=EPS,
        kv_cache=torch.randn(2, NUM_BLOCKS, BLOCK_SIZE, num_kv_heads, head_dim, generator=generator)
        .to(dtype)
        .to(device),
        slot_mapping=slots.to(device),
        num_heads=num_heads,
        num_kv_heads=num_kv_heads,
        head_dim=head_dim,
    )


def _rotate64(x: torch.Tensor, positions: torch.Tensor, case: dict) -> torch.Tensor:
    cos = case["cos_cache"].double()[positions][:, None, :]
    sin = case["sin_cache"].double()[positions][:, None, :]
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)


def _norm64(x: torch.Tensor, weight: torch.Tensor | None) -> torch.Tensor:
    if weight is None:
        return x
    return weight.double() * x / torch.sqrt(x.pow(2).mean(-1, keepdim=True) + EPS)


@pytest.mark.parametrize("qk_norm", [True, False])
def test_reference_matches_float64_math_and_writes_only_real_slots(qk_norm: bool) -> None:
    case = _case(9, 4, 2, 16, torch.float32, qk_norm)
    cache_before = case["kv_cache"].clone()
    query = qkv_prologue_ref(**case)
    qkv = case["qkv"].double().view(9, 8, 16)
    positions = case["positions"]
    expected_q = _rotate64(_norm64(qkv[:, :4], case["q_norm_weight"]), positions, case)
    expected_k = _rotate64(_norm64(qkv[:, 4:6], case["k_norm_weight"]), positions, case)
    torch.testing.assert_close(query.double(), expected_q, rtol=1e-5, atol=1e-5)
    flat = case["kv_cache"].view(2, NUM_BLOCKS * BLOCK_SIZE, 2, 16)
    written = torch.zeros(NUM_BLOCKS * BLOCK_SIZE, dtype=torch.bool)
    for token, slot in enumerate(case["slot_mapping"].tolist()):
        if slot >= 0:
            written[slot] = True
            torch.testing.assert_close(
                flat[0, slot].double(), expected_k[token], rtol=1e-5, atol=1e-5
            )
            assert torch.equal(flat[1, slot], case["qkv"][token, 96:].view(2, 16))
    before = cache_before.view(2, NUM_BLOCKS * BLOCK_SIZE, 2, 16)
    assert torch.equal(flat[:, ~written], before[:, ~written])


def test_bad_arguments_name_the_culprit() -> None:
    case = _case(3, 4, 2, 16, torch.float32, True)
    with pytest.raises(ValueError, match="qkv rows must hold"):
        qkv_prologue(**{**case, "num_heads": 3})
    with pytest.raises(ValueError, match="positions"):
        qkv_prologue(**{**case, "positions": case["positions"][:2]})
    with pytest.raises(ValueError, match="go together"):
        qkv_prologue(**{**case, "k_norm_weight": None})
    with pytest.raises(ValueError, match="kv_cache must be"):
        qkv_prologue(**{**case, "kv_cache": case["kv_cache"].half()})


def _compare(num_tokens: int, shapes: list[tuple[int, int, int]], device: str) -> None:
    if device == "cpu":
        from kernels import qkv_prologue as module

        assert_interpreted(module._qkv_prologue_kernel)
    for dtype in (torch.float32, torch.bfloat16, torch.float16):
        for num_heads, num_kv_heads, head_dim in shapes:
            for qk_norm in (True, False):
                case = _case(
                    num_tokens,
                    num_heads,
                    num_kv_heads,
                    head_dim,
                    dtype,
                    qk_norm,
                    device,
                    seed=num_heads + head_dim,
                )
                expected_cache, actual_cache = case["kv_cache"].clone(), case["kv_cache"].clone()
                expected = qkv_prologue_ref(**{**case, "kv_cache": expected_cache})
                actual = qkv_prologue_triton(**{**case, "kv_cache": actual_cache})
                assert_matches_reference(actual, expected)
                assert_matches_reference(actual_cache, expected_cache)


test_triton_matches_reference_in_interpreter, test_triton_matches_reference_on_cuda = (
    triton_vs_reference_tests(
        _compare,
        interpreted={"num_tokens": 6, "shapes": [(4, 2, 16), (3, 1, 8)], "device": "cpu"},
        on_cuda={"num_tokens": 29, "shapes": [(16, 8, 128), (9, 3, 64)], "device": "cuda"},
    )
)
