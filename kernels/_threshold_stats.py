"""First passes of the sort-free threshold search (kernels/sampling_thresholds.py).

A statistics launch sums each chunk of a row (max, min, sum, sum of squares, count of the
finite values and, for top-p alone, the mass against the chunk's max); a planning launch
reduces them in chunk order and sets each row's search state (kernels/_threshold_search.py):
min-p alone is done, top-k and top-p alone start from a guess (kernels/_threshold_guess.py)
or a first histogram whose span the statistics choose.
"""

from kernels import _threshold_guess as guess
from kernels import _threshold_search as search
from kernels._triton import HAS_TRITON, tl, triton

NUM_CHUNK_STATS = 8  # columns per chunk of the statistics pass (six are written)
TOP_P_BINS_SPAN = 12.0
"""Top-p's first histogram spans ln(num_tokens) + this below the max: all the tokens below
it together hold less than e^-12 of the max token's mass, so any p short of 1 - 6e-6 cuts
inside the span (the rest share one bin and take more passes)."""
TOP_K_BINS_STDS = 6.0
"""Top-k's first histogram spans the max down to this many standard deviations below the mean."""

if HAS_TRITON:
    _P_SPAN, _K_STDS = tl.constexpr(TOP_P_BINS_SPAN), tl.constexpr(TOP_K_BINS_STDS)

    @triton.jit
    def _row_filters(
        idx_mapping_ptr, temperature_ptr, top_k_ptr, top_p_ptr, min_p_ptr, row, vocab_size
    ):
        req = tl.load(idx_mapping_ptr + row)
        top_k = tl.load(top_k_ptr + req)
        top_p = tl.load(top_p_ptr + req)
        min_p = tl.load(min_p_ptr + req)
        has_k = (top_k > 0) & (top_k < vocab_size)
        has_p = top_p < 1.0
        has_min_p = min_p > 0.0
        return tl.load(temperature_ptr + req), top_k, top_p, min_p, has_k, has_p, has_min_p

    @triton.jit
    def _guesses_top_p(has_k, has_p, has_min_p):
        """Top-p alone (over every finite token) starts from a guess and needs the row's mass."""
        return has_p & ~has_k & ~has_min_p

    @triton.jit
    def _chunk_stats(
        logits_row, out, temperature, start, end, BLOCK: tl.constexpr, WITH_MASS: tl.constexpr
    ):
        """Store a chunk's max, min, sum, sum of squares and count of its finite values and
        (WITH_MASS) the sum of exp(y - the chunk's max): per lane, each value's exp against
        the lane's running max, the sum rescaled when the max grows (one exp a value)."""
        run_max = tl.full([BLOCK], float("-inf"), tl.float32)
        run_min = tl.full([BLOCK], float("inf"), tl.float32)
        run_sum = tl.zeros([BLOCK], tl.float32)
        run_sq = tl.zeros([BLOCK], tl.float32)
        run_num = tl.zeros([BLOCK], tl.float32)
        run_mass = tl.zeros([BLOCK], tl.float32)
        for offset in range(start, end, BLOCK):
            cols = offset + tl.arange(0, BLOCK)
            y = search.scaled(
                tl.load(logits_row + cols, mask=cols < end, other=float("-inf")), temperature
            )
            finite = (y > float("-inf")) & (y < float("inf"))
            if WITH_MASS:
                gap = tl.exp(-tl.abs(y - run_max))
                run_mass = tl.where(
                    finite, tl.where(y > run_max, run_mass * gap + 1.0, run_mass + gap), run_mass
                )
            run_max = tl.maximum(run_max, tl.where(finite, y, float("-inf")))
            run_min = tl.minimum(run_min, tl.where(finite, y, float("inf")))
            run_sum += tl.where(finite, y, 0.0)
            run_sq += tl.where(finite, y * y, 0.0)
            run_num += finite.to(tl.float32)
        chunk_max = tl.max(run_max, axis=0)
        tl.store(out, chunk_max)
        tl.store(out + 1, tl.min(run_min, axis=0))
        tl.store(out + 2, tl.sum(run_sum, axis=0))
        tl.store(out + 3, tl.sum(run_sq, axis=0))
        tl.store(out + 4, tl.sum(run_num, axis=0))
        if WITH_MASS:
            tl.store(
                out + 5,
                tl.sum(
                    tl.where(run_mass > 0.0, run_mass * tl.exp(run_max - chunk_max), 0.0), axis=0
                ),
            )

    @triton.jit
    def stats_kernel(
        logits_ptr,
        logits_stride,
        idx_mapping_ptr,
        temperature_ptr,
        top_k_ptr,
        top_p_ptr,
        min_p_ptr,
        stats_ptr,
        vocab_size,
        CHUNK: tl.constexpr,
        BLOCK: tl.constexpr,
        NUM_STATS: tl.constexpr,
    ):
        row = tl.program_id(0)
        chunk = tl.program_id(1)
        temperature, _, _, _, has_k, has_p, has_min_p = _row_filters(
            idx_mapping_ptr, temperature_ptr, top_k_ptr, top_p_ptr, min_p_ptr, row, vocab_size
        )
        logits_row = logits_ptr + row.to(tl.int64) * logits_stride
        start = chunk * CHUNK
        end = tl.minimum(start + CHUNK, vocab_size)
        out = stats_ptr + (row * tl.num_programs(1) + chunk) * NUM_STATS
        if _guesses_top_p(has_k, has_p, has_min_p):
            _chunk_stats(logits_row, out, temperature, start, end, BLOCK, True)
        elif has_k | has_p | has_min_p:
            _chunk_stats(logits_row, out, temperature, start, end, BLOCK, False)

    @triton.jit
    def plan_kernel(
        idx_mapping_ptr,
        temperature_ptr,
        top_k_ptr,
        top_p_ptr,
        min_p_ptr,
        stats_ptr,
        state_f_ptr,
        state_i_ptr,
        vocab_size,
        num_chunks,
        CHUNKS_P2: tl.constexpr,
        NUM_STATS: tl.constexpr,
    ):
        row = tl.program_id(0)
        _, top_k, top_p, min_p, has_k, has_p, has_min_p = _row_filters(
            idx_mapping_ptr, temperature_ptr, top_k_ptr, top_p_ptr, min_p_ptr, row, vocab_size
        )
        state_f = state_f_ptr + row * search.ROW_F
        state_i = state_i_ptr + row * search.ROW_I
        tl.store(state_i + search.I_NUM_CANDIDATES, 0)
        tl.store(state_i + search.I_ROUND, 0)
        tl.store(state_i + search.I_RESTARTED, 0)
        tl.store(state_i + search.I_GUESSED, 0)
        tl.store(state_i + search.I_ACTION, search.NONE)
        tl.store(state_i + search.I_PHASE, search.DONE)
        tl.store(state_f + search.F_THRESHOLD, float("-inf"))
        if has_k | has_p | has_min_p:
            chunks = tl.arange(0, CHUNKS_P2)
            in_range = chunks < num_chunks
            stats = stats_ptr + (row * num_chunks + chunks) * NUM_STATS
            maxima = tl.load(stats, mask=in_range, other=float("-inf"))
            row_max = tl.max(maxima, axis=0)
            row_min = tl.min(tl.load(stats + 1, mask=in_range, other=float("inf")), axis=0)
            num_finite = tl.maximum(
                tl.sum(tl.load(stats + 4, mask=in_range, other=0.0), axis=0), 1.0
            )
            mean = tl.sum(tl.load(stats + 2, mask=in_range, other=0.0), axis=0) / num_finite
            mean_sq = tl.sum(tl.load(stats + 3, mask=in_range, other=0.0), axis=0) / num_finite
            std = tl.sqrt(tl.maximum(mean_sq - mean * mean, 0.0))
            floor = tl.where(has_min_p, row_max + tl.log(min_p), float("-inf"))
            # Every survivor is > lo: the float just below the smallest one.
            lo = search.from_key(search.float_key(tl.maximum(floor, row_min)) - 1)
            phase = tl.where(has_k, search.SEARCH_K, tl.where(has_p, search.SEARCH_P, search.DONE))
            tl.store(state_f + search.F_MAX, row_max)
            tl.store(state_f + search.F_FLOOR, floor)
            tl.store(state_f + search.F_TOP_P, top_p)
            tl.store(state_f + search.F_TARGET, tl.where(has_k, top_k.to(tl.float32), -1.0))
            tl.store(state_f + search.F_THRESHOLD, floor)
            tl.store(state_i + search.I_TOP_K, top_k)
            tl.store(state_i + search.I_HAS_P, has_p.to(tl.int32))
            tl.store(state_i + search.I_PHASE, phase)
            if (phase != search.DONE) & (row_max > float("-inf")):
                tl.store(state_f + search.F_START, lo)
                p_bins_lo = row_max - (tl.log(num_finite) + _P_SPAN)
                if phase == search.SEARCH_K:
                    guess.start_top_k(
                        state_f,
                        state_i,
                        lo,
                        row_max,
                        mean - _K_STDS * std,
                        top_k,
                        num_finite,
                        mean,
                        std,
                    )
                elif _guesses_top_p(has_k, has_p, has_min_p):
                    chunk_mass = tl.load(stats + 5, mask=in_range, other=0.0)
                    mass = tl.sum(
                        tl.where(chunk_mass > 0.0, chunk_mass * tl.exp(maxima - row_max), 0.0),
                        axis=0,
                    )
                    guess.start_top_p(
                        state_f, state_i, lo, row_max, p_bins_lo, top_p, mass, num_finite, mean, std
                    )
                else:
                    search.start_histogram(state_f, state_i, lo, row_max, p_bins_lo)
            else:
                tl.store(state_i + search.I_PHASE, search.DONE)
