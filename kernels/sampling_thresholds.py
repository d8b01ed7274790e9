"""Per-row thresholds of min-p, top-k and top-p, found without sorting the vocabulary.

For logit row i with request row r = idx_mapping[i], let y = logits[i] / temperature[r]
(correctly rounded; untouched when the temperature is 0 or 1). Then, in this order:
- min-p (min_p[r] > 0): survivors are the tokens with y >= max(y) + log(min_p);
- top-k (0 < top_k[r] < vocab): the k largest survivors by rank;
- top-p (top_p[r] < 1): of those, in descending order, token j is kept iff the softmax mass
  (over the top-k survivors) ranked before it is < p; the most likely token always is.
The kept set is {y >= threshold[i]} and the result is that threshold (-inf: nothing is
filtered). Tokens equal to it are all kept, so ties at the boundary stay or go together
and the set depends on the values alone. Nothing is written back: the Gumbel kernel drops
the tokens below the threshold as it samples.

The reference composes the sort-based ops (kernels/temperature.py, kernels/min_p.py,
kernels/top_k_top_p.py); on the CPU, `sampling_thresholds_cpu` gives its results bit for
bit with torch.topk in place of the sort where a row's top-k allows
(kernels/_threshold_cpu.py). The Triton version searches for the threshold
(kernels/_threshold_search.py, kernels/_threshold_bins.py): a statistics pass (max, mean,
spread, and for top-p alone the total mass; min-p alone ends here;
kernels/_threshold_stats.py), then histogram passes of 126 bins that narrow a bracket
around the answer until it holds at most 1024 tokens (one or two for top-p, three for p
near 1), and a pass that copies those out to be resolved exactly in registers
(kernels/_threshold_candidates.py). A small top-k and top-p alone skip the histograms:
their first pass copies out the tokens where a normal fit of the statistics puts the
answer (kernels/_threshold_guess.py), which holds it on typical rows, and they search by
histogram only when it does not. A fixed sequence of launches (so that it can be captured
in a CUDA graph) carries most rows to the end; a last kernel finishes any row that needs
more passes (ties, extreme spreads), alone. Every pass splits a row in fixed 8192-token
chunks and sums them in chunk order, so a row's threshold does not depend on the batch it
is in.

Masses are float32 sums in another order than the reference's cumulative sum, so a row
whose p falls within float32 rounding of a cumulative mass may keep one token more or less.
"""

import torch

from kernels import _threshold_bins as bins
from kernels import _threshold_search as search
from kernels import _threshold_stats as first_pass
from kernels._checks import check_logits, check_tensor, check_triton_device, need_triton
from kernels._threshold_buffers import SearchBuffers
from kernels._threshold_cpu import thresholds_cpu
from kernels._triton import HAS_TRITON, tl, triton
from kernels.min_p import apply_min_p_ref
from kernels.temperature import apply_temperature_ref
from kernels.top_k_top_p import top_k_top_p_thresholds

CHUNK = 8192
BLOCK = 512
NUM_GRAPHED_ROUNDS = 4
MAX_FINISH_ROUNDS = 64
ROUND_LAUNCHES: tuple[tuple[bool, bool, bool], ...] = ((False, True, False), (False, False, True))
"""A round's pass launches, each running the kinds of pass it names (pivot counts,
histograms, copy-outs; kernels/_threshold_bins.chunk_pass) for the rows that ask for
them, the others exiting at once: one launch per kind keeps each pass to its own
registers. A kind no launch runs (pivots: restarts and histograms that make no progress,
rare) is left to the finishing kernel."""

if HAS_TRITON:

    @triton.jit
    def _round_kernel(
        logits_ptr,
        logits_stride,
        idx_mapping_ptr,
        temperature_ptr,
        partials_ptr,
        bin_counts_ptr,
        candidates_ptr,
        state_f_ptr,
        state_i_ptr,
        pivots_ptr,
        vocab_size,
        PIVOTS: tl.constexpr,
        HISTOGRAMS: tl.constexpr,
        COPIES: tl.constexpr,
        CHUNK: tl.constexpr,
        BLOCK: tl.constexpr,
    ):
        """The chunks of the rows whose next pass is of a kind this launch runs."""
        bins.chunk_pass(
            logits_ptr,
            logits_stride,
            partials_ptr,
            bin_counts_ptr,
            candidates_ptr,
            state_f_ptr,
            state_i_ptr,
            pivots_ptr,
            tl.program_id(0),
            tl.program_id(1),
            tl.num_programs(1),
            temperature_ptr,
            idx_mapping_ptr,
            vocab_size,
            PIVOTS,
            HISTOGRAMS,
            COPIES,
            CHUNK,
            BLOCK,
        )

    @triton.jit
    def _decide_kernel(
        state_f_ptr,
        state_i_ptr,
        pivots_ptr,
        partials_ptr,
        bin_counts_ptr,
        candidates_ptr,
        num_chunks,
        CHUNKS_P2: tl.constexpr,
        PIVOTS: tl.constexpr,
    ):
        bins.decide(
            state_f_ptr,
            state_i_ptr,
            pivots_ptr,
            partials_ptr,
            bin_counts_ptr,
            candidates_ptr,
            tl.program_id(0),
            num_chunks,
            CHUNKS_P2,
            PIVOTS,
        )

    @triton.jit
    def _finish_kernel(
        logits_ptr,
        logits_stride,
        idx_mapping_ptr,
        temperature_ptr,
        partials_ptr,
        bin_counts_ptr,
        candidates_ptr,
        state_f_ptr,
        state_i_ptr,
        pivots_ptr,
        thresholds_ptr,
        vocab_size,
        num_chunks,
        max_rounds,
        CHUNK: tl.constexpr,
        BLOCK: tl.constexpr,
        CHUNKS_P2: tl.constexpr,
    ):
        """Rows the fixed rounds did not finish: the same passes, by one program."""
        row = tl.program_id(0)
        phase_ptr = state_i_ptr + row * search.ROW_I + search.I_PHASE
        rounds = 0
        while (tl.load(phase_ptr, volatile=True) != search.DONE) & (rounds < max_rounds):
            for chunk in range(0, num_chunks):
                bins.chunk_pass(
                    logits_ptr,
                    logits_stride,
                    partials_ptr,
                    bin_counts_ptr,
                    candidates_ptr,
                    state_f_ptr,
                    state_i_ptr,
                    pivots_ptr,
                    row,
                    chunk,
                    num_chunks,
                    temperature_ptr,
                    idx_mapping_ptr,
                    vocab_size,
                    True,
                    True,
                    True,
                    CHUNK,
                    BLOCK,
                )
            tl.debug_barrier()
            bins.decide(
                state_f_ptr,
                state_i_ptr,
                pivots_ptr,
                partials_ptr,
                bin_counts_ptr,
                candidates_ptr,
                row,
                num_chunks,
                CHUNKS_P2,
                True,
            )
            tl.debug_barrier()
            rounds += 1
        threshold = tl.load(state_f_ptr + row * search.ROW_F + search.F_THRESHOLD)
        # A row still unresolved (a bug, never seen) keeps its min-p survivors.
        unresolved = tl.load(phase_ptr, volatile=True) != search.DONE
        floor = tl.load(state_f_ptr + row * search.ROW_F + search.F_FLOOR)
        tl.store(thresholds_ptr + row, tl.where(unresolved, floor, threshold))


def _check_args(
    logits: torch.Tensor,
    idx_mapping: torch.Tensor,
    temperature: torch.Tensor,
    top_k: torch.Tensor,
    top_p: torch.Tensor,
    min_p: torch.Tensor,
) -> None:
    num_rows, _ = check_logits(logits)
    device = logits.device
    check_tensor("idx_mapping", idx_mapping, torch.int32, 1, device, (num_rows,))
    check_tensor("temperature", temperature, torch.float32, 1, device)
    num_reqs = temperature.shape[0]
    check_tensor("top_k", top_k, torch.int32, 1, device, (num_reqs,))
    check_tensor("top_p", top_p, torch.float32, 1, device, (num_reqs,))
    check_tensor("min_p", min_p, torch.float32, 1, device, (num_reqs,))


def sampling_thresholds_ref(
    logits: torch.Tensor,  # [num_rows, vocab_size] float32, not modified
    idx_mapping: torch.Tensor,  # [num_rows] int32, logit row -> request row
    temperature: torch.Tensor,  # [max_num_reqs] float32
    top_k: torch.Tensor,  # [max_num_reqs] int32, 0 = off
    top_p: torch.Tensor,  # [max_num_reqs] float32, 1 = off
    min_p: torch.Tensor,  # [max_num_reqs] float32, 0 = off
) -> torch.Tensor:  # [num_rows] float32
    """Torch reference of `sampling_thresholds`: temperature, min-p, then the sort-based
    top-k/top-p threshold over the min-p survivors."""
    _check_args(logits, idx_mapping, temperature, top_k, top_p, min_p)
    if logits.shape[0] == 0:
        return torch.empty(0, dtype=torch.float32, device=logits.device)
    scaled = logits.clone()
    apply_temperature_ref(scaled, idx_mapping, temperature)
    floor = scaled.amax(dim=-1) + torch.log(min_p[idx_mapping.long()])
    apply_min_p_ref(scaled, idx_mapping, min_p)
    top = top_k_top_p_thresholds(scaled, idx_mapping, top_k, top_p, scaled.shape[1])
    return torch.maximum(floor, top)


def sampling_thresholds_cpu(
    logits: torch.Tensor,  # [num_rows, vocab_size] float32, not modified
    idx_mapping: torch.Tensor,  # [num_rows] int32, logit row -> request row
    temperature: torch.Tensor,  # [max_num_reqs] float32
    top_k: torch.Tensor,  # [max_num_reqs] int32, 0 = off
    top_p: torch.Tensor,  # [max_num_reqs] float32, 1 = off
    min_p: torch.Tensor,  # [max_num_reqs] float32, 0 = off
) -> torch.Tensor:  # [num_rows] float32
    """`sampling_thresholds_ref`'s thresholds, bit for bit, sorting only the rows that need
    a full sort (kernels/_threshold_cpu.py)."""
    _check_args(logits, idx_mapping, temperature, top_k, top_p, min_p)
    if logits.shape[0] == 0:
        return torch.empty(0, dtype=torch.float32, device=logits.device)
    return thresholds_cpu(logits, idx_mapping, temperature, top_k, top_p, min_p)


def sampling_thresholds_triton(
    logits: torch.Tensor,  # [num_rows, vocab_size] float32, rows contiguous
    idx_mapping: torch.Tensor,  # [num_rows] int32
    temperature: torch.Tensor,  # [max_num_reqs] float32
    top_k: torch.Tensor,  # [max_num_reqs] int32
    top_p: torch.Tensor,  # [max_num_reqs] float32
    min_p: torch.Tensor,  # [max_num_reqs] float32
    chunk: int = CHUNK,
) -> torch.Tensor:  # [num_rows] float32
    """Triton launcher: 3 + (1 + len(ROUND_LAUNCHES)) * NUM_GRAPHED_ROUNDS launches of
    fixed shape (see the module doc); no host sync, so it can be captured in a CUDA graph."""
    need_triton("sampling_thresholds_triton")
    _check_args(logits, idx_mapping, temperature, top_k, top_p, min_p)
    check_triton_device("sampling_thresholds_triton", logits.device)
    if logits.shape[0] == 0:
        return torch.empty(0, dtype=torch.float32, device=logits.device)
    thresholds, _ = _launch(
        logits,
        idx_mapping,
        (idx_mapping, temperature, top_k, top_p, min_p),
        chunk,
        MAX_FINISH_ROUNDS,
    )
    return thresholds


def _launch(
    logits: torch.Tensor,  # [num_rows, vocab_size] float32, num_rows > 0
    idx_mapping: torch.Tensor,  # [num_rows] int32
    filters: tuple[torch.Tensor, ...],  # idx_mapping, temperature, top_k, top_p, min_p
    chunk: int,
    max_finish_rounds: int,
    num_rounds: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:  # thresholds [num_rows], int state [num_rows, NUM_I]
    """The launch sequence, with num_rounds graphed rounds (NUM_GRAPHED_ROUNDS by default);
    the int state tells tests how far each row got before the finishing kernel (phase,
    restarts)."""
    num_rows, vocab_size = logits.shape
    num_chunks = triton.cdiv(vocab_size, chunk)
    buffers = SearchBuffers.allocate(num_rows, num_chunks, logits.device)
    _launch_first_pass(logits, filters, buffers, chunk)
    for _ in range(NUM_GRAPHED_ROUNDS if num_rounds is None else num_rounds):
        _launch_round(logits, idx_mapping, filters[1], buffers, chunk)
    thresholds = torch.empty(num_rows, dtype=torch.float32, device=logits.device)
    _finish_kernel[(num_rows,)](
        logits,
        logits.stride(0),
        idx_mapping,
        filters[1],
        *buffers.round_args(),
        thresholds,
        vocab_size,
        num_chunks,
        max_finish_rounds,
        CHUNK=chunk,
        BLOCK=BLOCK,
        CHUNKS_P2=triton.next_power_of_2(num_chunks),
    )
    return thresholds, buffers.state_i


def _launch_first_pass(
    logits: torch.Tensor,  # [num_rows, vocab_size] float32
    filters: tuple[torch.Tensor, ...],  # idx_mapping, temperature, top_k, top_p, min_p
    buffers: SearchBuffers,
    chunk: int,
) -> None:
    """Per-chunk statistics, then each row's plan (its first bracket) from them."""
    (num_rows, vocab_size), num_chunks = logits.shape, buffers.stats.shape[1]
    first_pass.stats_kernel[(num_rows, num_chunks)](
        logits,
        logits.stride(0),
        *filters,
        buffers.stats,
        vocab_size,
        CHUNK=chunk,
        BLOCK=BLOCK,
        NUM_STATS=first_pass.NUM_CHUNK_STATS,
    )
    first_pass.plan_kernel[(num_rows,)](
        *filters,
        buffers.stats,
        buffers.state_f,
        buffers.state_i,
        vocab_size,
        num_chunks,
        CHUNKS_P2=triton.next_power_of_2(num_chunks),
        NUM_STATS=first_pass.NUM_CHUNK_STATS,
    )


def _launch_round(
    logits: torch.Tensor,  # [num_rows, vocab_size] float32
    idx_mapping: torch.Tensor,  # [num_rows] int32
    temperature: torch.Tensor,  # per request row, float32
    buffers: SearchBuffers,
    chunk: int,
) -> None:
    """One graphed round: the passes over the chunks (ROUND_LAUNCHES), then each row's
    decision on its bracket."""
    (num_rows, vocab_size), num_chunks = logits.shape, buffers.stats.shape[1]
    for with_pivots, with_histograms, with_copies in ROUND_LAUNCHES:
        _round_kernel[(num_rows, num_chunks)](
            logits,
            logits.stride(0),
            idx_mapping,
            temperature,
            *buffers.round_args(),
            vocab_size,
            PIVOTS=with_pivots,
            HISTOGRAMS=with_histograms,
            COPIES=with_copies,
            CHUNK=chunk,
            BLOCK=BLOCK,
        )
    _decide_kernel[(num_rows,)](
        buffers.state_f,
        buffers.state_i,
        buffers.pivots,
        buffers.partials,
        buffers.bin_counts,
        buffers.candidates,
        num_chunks,
        CHUNKS_P2=triton.next_power_of_2(num_chunks),
        PIVOTS=any(kinds[0] for kinds in ROUND_LAUNCHES),
    )


def sampling_thresholds(
    logits: torch.Tensor,  # [num_rows, vocab_size] float32, not modified
    idx_mapping: torch.Tensor,  # [num_rows] int32, logit row -> request row
    temperature: torch.Tensor,  # [max_num_reqs] float32
    top_k: torch.Tensor,  # [max_num_reqs] int32, 0 = off
    top_p: torch.Tensor,  # [max_num_reqs] float32, 1 = off
    min_p: torch.Tensor,  # [max_num_reqs] float32, 0 = off
) -> torch.Tensor:  # [num_rows] float32, -inf where a row filters nothing
    """Each row's smallest kept (temperature-scaled) logit under min-p, top-k and top-p
    (see the module doc): Triton on CUDA, the sort-based reference otherwise."""
    if HAS_TRITON and logits.is_cuda:
        return sampling_thresholds_triton(logits, idx_mapping, temperature, top_k, top_p, min_p)
    if logits.device.type == "cpu":
        return sampling_thresholds_cpu(logits, idx_mapping, temperature, top_k, top_p, min_p)
    return sampling_thresholds_ref(logits, idx_mapping, temperature, top_k, top_p, min_p)
