"""The noise of kernels/gumbel_sample.py in torch: the 32-bit hash of (seed, position, token
id) and its map to Gumbel noise, shared by the reference and the CPU path
(kernels/_gumbel_cpu.py).

The reference hashes in int64 masked to 32 bits, splitting each product so that int64
never overflows. The CPU path hashes the few tokens it needs in int32 instead, where a
product keeps its low 32 bits (two's complement) and a logical shift is an arithmetic one
masked; both give the same 32 bits, and tests/kernels/test_gumbel_cpu.py checks them
against each other.
"""

from __future__ import annotations

import functools

import torch

MASK32 = 0xFFFFFFFF
_MIX_FACTORS = (0x7FEB352D, 0x846CA68B)
TOKEN_FACTOR = 0x9E3779B9
NUM_UNIFORM_BITS = 23
"""The noise takes the hash's top 23 bits: one of 2**23 values."""


def mul32_ref(values: torch.Tensor, factor: int) -> torch.Tensor:
    # Low 32 bits of values * factor, split in 16-bit halves so int64 never overflows.
    low = values * (factor & 0xFFFF)
    high = ((values * (factor >> 16)) & 0xFFFF) << 16
    return (low + high) & MASK32


def mix32_ref(values: torch.Tensor) -> torch.Tensor:
    values = values ^ (values >> 16)
    values = mul32_ref(values, _MIX_FACTORS[0])
    values = values ^ (values >> 15)
    values = mul32_ref(values, _MIX_FACTORS[1])
    return values ^ (values >> 16)


def step_key_ref(
    seed: torch.Tensor,  # [num_rows] int64
    position: torch.Tensor,  # [num_rows] int64
) -> torch.Tensor:  # [num_rows] int64 in [0, 2**32)
    key = mix32_ref((seed & MASK32) ^ 0x6A09E667)
    key = mix32_ref(key ^ ((seed >> 32) & MASK32))
    key = mix32_ref(key ^ (position & MASK32))
    return mix32_ref(key ^ ((position >> 32) & MASK32))


def gumbel_noise_ref(
    seed: torch.Tensor,  # [num_rows] int64, one seed per logit row
    positions: torch.Tensor,  # [num_rows] int64
    vocab_size: int,
) -> torch.Tensor:  # [num_rows, vocab_size] float32
    """The Gumbel noise both implementations add (exposed for tests and analysis)."""
    keys = step_key_ref(seed.long(), positions.long())[:, None]
    token_ids = torch.arange(vocab_size, dtype=torch.int64, device=seed.device)
    hashed = mix32_ref(keys ^ mul32_ref(token_ids, TOKEN_FACTOR)[None, :])
    return noise_of_top_bits(hashed >> 9)


def noise_of_top_bits(top_bits: torch.Tensor) -> torch.Tensor:  # float32, same shape
    """Gumbel noise -log(-log(u)) of u = (top_bits + 0.5) / 2**23, top_bits an integer
    tensor in [0, 2**23): exact up to the two float32 logs."""
    uniform = (top_bits.to(torch.float32) + 0.5) * (1.0 / 8388608.0)
    return -torch.log(-torch.log(uniform))


def as_int32(values: torch.Tensor) -> torch.Tensor:
    """int64 values in [0, 2**32) -> int32 with the same 32 bits."""
    return torch.where(values >= 2**31, values - 2**32, values).to(torch.int32)


def _as_signed32(factor: int) -> int:
    return factor - 2**32 if factor >= 2**31 else factor


def mix32_int32_(values: torch.Tensor) -> torch.Tensor:  # [n] int32, mixed in place
    """`mix32_ref` on int32 bit patterns, in place (see the module doc)."""
    shifted = torch.empty_like(values)
    for shift, factor in ((16, _MIX_FACTORS[0]), (15, _MIX_FACTORS[1])):
        torch.bitwise_right_shift(values, shift, out=shifted)
        values.bitwise_xor_(shifted.bitwise_and_((1 << (32 - shift)) - 1))
        values.mul_(_as_signed32(factor))
    torch.bitwise_right_shift(values, 16, out=shifted)
    return values.bitwise_xor_(shifted.bitwise_and_(0xFFFF))


@functools.lru_cache(maxsize=8)
def token_factors_int32(vocab_size: int, device: torch.device) -> torch.Tensor:
    """[vocab_size] int32: the 32 bits of token_id * TOKEN_FACTOR, as the hash takes them."""
    token_ids = torch.arange(vocab_size, dtype=torch.int64, device=device)
    return as_int32(mul32_ref(token_ids, TOKEN_FACTOR))


@functools.lru_cache(maxsize=4)
def max_noise(device: torch.device) -> float:
    """The largest noise any hash gives (over all 2**23 top-bit values), computed with the
    same float32 logs as the noise itself, so that it bounds every draw exactly."""
    top_bits = torch.arange(1 << NUM_UNIFORM_BITS, dtype=torch.int32, device=device)
    return float(noise_of_top_bits(top_bits).max())
