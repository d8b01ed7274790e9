"""Seeded Gumbel-max sampling: one token per logit row, in a single pass over the logits.

For logit row i with request row r = idx_mapping[i] and t = temperature[r]:
- t == 0 (greedy): the argmax of logits[i];
- otherwise: argmax over v of logits[i, v] / t + g(seed[r], positions[i], v), where
  g = -log(-log(u)) is standard Gumbel noise, which makes the argmax a draw from
  softmax(logits[i] / t). The division is skipped when the caller already applied
  the temperature (apply_temperature=False).

u is a pure function of (seed, position, token id): a 32-bit integer hash ("lowbias32",
C. Wellons) computed identically in Triton (uint32) and in torch (int64, masked to 32
bits), mapped to u = ((h >> 9) + 0.5) / 2**23, which is exact in float32 and lies in
(0, 1). So a draw does not depend on the batch it runs in, nor on its place there.
Ties go to the smallest token id. The Triton kernel writes one (max, argmax) per
1024-token block; a second tiny kernel picks the best block. On the CPU,
`gumbel_sample_cpu` gives the reference's draws bit for bit while computing the noise of
only the tokens that can still win (kernels/_gumbel_cpu.py: 150 rows of a 49152-token
vocabulary at temperature 1 in ~50 ms instead of ~600 on one thread).

With `thresholds` ([num_rows], from kernels/sampling_thresholds.py), tokens whose score
(after the temperature) is below their row's threshold cannot be drawn: min-p, top-k and
top-p filtering happen here, without writing the logits.
"""

import torch

from kernels._checks import check_logits, check_tensor, check_triton_device, need_triton
from kernels._gumbel_cpu import draw_cpu
from kernels._gumbel_hash import gumbel_noise_ref
from kernels._triton import HAS_TRITON, tl, triton

_BLOCK_SIZE = 1024

if HAS_TRITON:

    @triton.jit
    def _mix32(x):
        # x is uint32: products wrap modulo 2**32 and shifts are logical.
        x = x ^ (x >> 16)
        x = x * 0x7FEB352D
        x = x ^ (x >> 15)
        x = x * 0x846CA68B
        x = x ^ (x >> 16)
        return x

    @triton.jit
    def _step_key(seed, position):
        # seed and position are int64 scalars; each 32-bit half goes through one mix.
        key = _mix32((seed & 0xFFFFFFFF).to(tl.uint32) ^ 0x6A09E667)
        key = _mix32(key ^ ((seed >> 32) & 0xFFFFFFFF).to(tl.uint32))
        key = _mix32(key ^ (position & 0xFFFFFFFF).to(tl.uint32))
        key = _mix32(key ^ ((position >> 32) & 0xFFFFFFFF).to(tl.uint32))
        return key

    @triton.jit
    def _gumbel_noise(key, token_ids):
        hashed = _mix32(key ^ (token_ids.to(tl.uint32) * 0x9E3779B9))
        uniform = ((hashed >> 9).to(tl.float32) + 0.5) * (1.0 / 8388608.0)
        return -tl.log(-tl.log(uniform))

    @triton.jit
    def _gumbel_block_argmax_kernel(
        logits_ptr,
        logits_stride,
        idx_mapping_ptr,
        temperature_ptr,
        seed_ptr,
        positions_ptr,
        block_max_ptr,
        block_argmax_ptr,
        thresholds_ptr,
        vocab_size,
        num_blocks,
        APPLY_TEMPERATURE: tl.constexpr,
        HAS_THRESHOLDS: tl.constexpr,
        BLOCK_SIZE: tl.constexpr,
    ):
        row = tl.program_id(0).to(tl.int64)
        block = tl.program_id(1)
        req = tl.load(idx_mapping_ptr + row)
        temperature = tl.load(temperature_ptr + req)
        token_ids = block * BLOCK_SIZE + tl.arange(0, BLOCK_SIZE)
        in_vocab = token_ids < vocab_size
        scores = tl.load(
            logits_ptr + row * logits_stride + token_ids, mask=in_vocab, other=float("-inf")
        )
        if temperature != 0.0:
            if APPLY_TEMPERATURE:
                scores = tl.math.div_rn(scores, temperature)
            if HAS_THRESHOLDS:
                scores = tl.where(scores >= tl.load(thresholds_ptr + row), scores, float("-inf"))
            key = _step_key(tl.load(seed_ptr + req), tl.load(positions_ptr + row))
            scores = scores + _gumbel_noise(key, token_ids)
        elif HAS_THRESHOLDS:
            scores = tl.where(scores >= tl.load(thresholds_ptr + row), scores, float("-inf"))
        best = tl.argmax(scores, 0, tie_break_left=True)
        tl.store(block_max_ptr + row * num_blocks + block, tl.max(scores, 0))
        tl.store(block_argmax_ptr + row * num_blocks + block, block * BLOCK_SIZE + best)

    @triton.jit
    def _best_block_kernel(
        block_max_ptr,
        block_argmax_ptr,
        sampled_ptr,
        num_blocks,
        NUM_BLOCKS_POW2: tl.constexpr,
    ):
        row = tl.program_id(0).to(tl.int64)
        blocks = tl.arange(0, NUM_BLOCKS_POW2)
        block_max = tl.load(
            block_max_ptr + row * num_blocks + blocks, mask=blocks < num_blocks, other=float("-inf")
        )
        best_block = tl.argmax(block_max, 0, tie_break_left=True)
        token_id = tl.load(block_argmax_ptr + row * num_blocks + best_block)
        tl.store(sampled_ptr + row, token_id.to(tl.int64))


def _check_args(
    logits: torch.Tensor,
    idx_mapping: torch.Tensor,
    temperature: torch.Tensor,
    seed: torch.Tensor,
    positions: torch.Tensor,
    thresholds: torch.Tensor | None,
) -> None:
    num_rows, _ = check_logits(logits)
    device = logits.device
    check_tensor("idx_mapping", idx_mapping, torch.int32, 1, device, (num_rows,))
    check_tensor("temperature", temperature, torch.float32, 1, device)
    check_tensor("seed", seed, torch.int64, 1, device, (temperature.shape[0],))
    check_tensor("positions", positions, torch.int64, 1, device, (num_rows,))
    if thresholds is not None:
        check_tensor("thresholds", thresholds, torch.float32, 1, device, (num_rows,))


def gumbel_sample_ref(
    logits: torch.Tensor,  # [num_rows, vocab_size] float32, not modified
    idx_mapping: torch.Tensor,  # [num_rows] int32, logit row -> request row
    temperature: torch.Tensor,  # [max_num_reqs] float32, 0 = greedy
    seed: torch.Tensor,  # [max_num_reqs] int64
    positions: torch.Tensor,  # [num_rows] int64, position of the token being sampled
    apply_temperature: bool = True,
    thresholds: torch.Tensor | None = None,  # [num_rows] float32: scores below are not drawn
) -> torch.Tensor:  # [num_rows] int64
    """Torch reference of `gumbel_sample`."""
    _check_args(logits, idx_mapping, temperature, seed, positions, thresholds)
    rows = idx_mapping.long()
    row_temperature = temperature[rows]
    is_greedy = row_temperature == 0.0
    scores = logits
    if apply_temperature:
        scores = scores / torch.where(is_greedy, 1.0, row_temperature)[:, None]
    if thresholds is not None:
        scores = scores.masked_fill(scores < thresholds[:, None], float("-inf"))
    if logits.shape[0] == 0 or bool(is_greedy.all()):
        return scores.argmax(dim=-1)
    noised = scores + gumbel_noise_ref(seed[rows], positions, logits.shape[1])
    return torch.where(is_greedy[:, None], scores, noised).argmax(dim=-1)


def gumbel_sample_triton(
    logits: torch.Tensor,  # [num_rows, vocab_size] float32, not modified
    idx_mapping: torch.Tensor,  # [num_rows] int32
    temperature: torch.Tensor,  # [max_num_reqs] float32
    seed: torch.Tensor,  # [max_num_reqs] int64
    positions: torch.Tensor,  # [num_rows] int64
    apply_temperature: bool = True,
    thresholds: torch.Tensor | None = None,  # [num_rows] float32
    block_size: int = _BLOCK_SIZE,
) -> torch.Tensor:  # [num_rows] int64
    """Triton launcher of `gumbel_sample`: (row, vocab block) programs, then a block argmax."""
    need_triton("gumbel_sample_triton")
    _check_args(logits, idx_mapping, temperature, seed, positions, thresholds)
    check_triton_device("gumbel_sample_triton", logits.device)
    num_rows, vocab_size = logits.shape
    sampled = torch.empty(num_rows, dtype=torch.int64, device=logits.device)
    if num_rows == 0:
        return sampled
    num_blocks = triton.cdiv(vocab_size, block_size)
    block_max = torch.empty((num_rows, num_blocks), dtype=torch.float32, device=logits.device)
    block_argmax = torch.empty((num_rows, num_blocks), dtype=torch.int32, device=logits.device)
    _gumbel_block_argmax_kernel[(num_rows, num_blocks)](
        logits,
        logits.stride(0),
        idx_mapping,
        temperature,
        seed,
        positions,
        block_max,
        block_argmax,
        logits if thresholds is None else thresholds,
        vocab_size,
        num_blocks,
        APPLY_TEMPERATURE=apply_temperature,
        HAS_THRESHOLDS=thresholds is not None,
        BLOCK_SIZE=block_size,
    )
    _best_block_kernel[(num_rows,)](
        block_max,
        block_argmax,
        sampled,
        num_blocks,
        NUM_BLOCKS_POW2=triton.next_power_of_2(num_blocks),
    )
    return sampled


def gumbel_sample_cpu(
    logits: torch.Tensor,  # [num_rows, vocab_size] float32, not modified
    idx_mapping: torch.Tensor,  # [num_rows] int32, logit row -> request row
    temperature: torch.Tensor,  # [max_num_reqs] float32, 0 = greedy
    seed: torch.Tensor,  # [max_num_reqs] int64
    positions: torch.Tensor,  # [num_rows] int64, position of the token being sampled
    apply_temperature: bool = True,
    thresholds: torch.Tensor | None = None,  # [num_rows] float32: scores below are not drawn
) -> torch.Tensor:  # [num_rows] int64
    """`gumbel_sample_ref`'s draws, bit for bit, with noise for the few tokens of each row
    that can win (kernels/_gumbel_cpu.py)."""
    _check_args(logits, idx_mapping, temperature, seed, positions, thresholds)
    rows = idx_mapping.long()
    row_temperature = temperature[rows]
    is_greedy = row_temperature == 0.0
    scores = logits
    # x / 1 is x: rows at temperature 0 or 1 need no division
    if apply_temperature and not bool(((row_temperature == 1.0) | is_greedy).all()):
        scores = scores / torch.where(is_greedy, 1.0, row_temperature)[:, None]
    if thresholds is not None:
        scores = scores.masked_fill(scores < thresholds[:, None], float("-inf"))
    return draw_cpu(scores, is_greedy, seed[rows], positions)


def gumbel_sample(
    logits: torch.Tensor,  # [num_rows, vocab_size] float32, not modified
    idx_mapping: torch.Tensor,  # [num_rows] int32, logit row -> request row
    temperature: torch.Tensor,  # [max_num_reqs] float32, 0 = greedy
    seed: torch.Tensor,  # [max_num_reqs] int64
    positions: torch.Tensor,  # [num_rows] int64, position of the token being sampled
    apply_temperature: bool = True,
    thresholds: torch.Tensor | None = None,  # [num_rows] float32: scores below are not drawn
) -> torch.Tensor:  # [num_rows] int64
    """Sample one token per row (see the module doc); greedy rows take the argmax."""
    if HAS_TRITON and logits.is_cuda:
        return gumbel_sample_triton(
            logits, idx_mapping, temperature, seed, positions, apply_temperature, thresholds
        )
    if logits.device.type == "cpu":
        return gumbel_sample_cpu(
            logits, idx_mapping, temperature, seed, positions, apply_temperature, thresholds
        )
    return gumbel_sample_ref(
        logits, idx_mapping, temperature, seed, positions, apply_temperature, thresholds
    )
