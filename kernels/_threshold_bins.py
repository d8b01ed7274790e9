"""Histogram passes of the sort-free threshold search, and the per-pass dispatch.

A histogram pass counts a row's tokens in its bracket (lo, hi] per bin: NUM_BINS - 2 even
bins over (bins_lo, hi] (bin 0 at the top) and one more for the bracket below bins_lo.
Counts are exact integers, so top-k reads the k-th token's bin off them directly. Top-p
needs masses, which a bin holds only within bounds (count times exp of its edges); the
bins where the cumulative mass may cross the target, given those bounds and the pass's
exact total, become the new bracket. Bin edges are turned back into exact float bounds by
bisection over the same bin function, so the new bracket holds exactly the counted tokens.
The next pass sums the exact mass above the new bracket and the search restarts (once) if
the answer is not in it, so the bounds decide only how many passes it takes.
"""

from kernels import _threshold_candidates as candidates
from kernels import _threshold_search as search
from kernels._triton import HAS_TRITON, tl, triton

if HAS_TRITON:
    MASS_MARGIN = tl.constexpr(1e-3)  # relative slack on the mass bounds (float sums, exp)

    @triton.jit
    def bin_of(y, lo, hi, inv_width):
        """The bin of y: 0 at hi, BINS - 2 for the bracket's lowest part, BINS - 1 outside
        (lo, hi]. Non-increasing in y, in float arithmetic too."""
        bins = tl.minimum(tl.floor((hi - y) * inv_width), search.BINS - 2).to(tl.int32)
        return tl.where((y > lo) & (y <= hi), bins, search.BINS - 1)

    @triton.jit
    def histogram_chunk_pass(
        logits_row,
        partials_ptr,
        bins_ptr,
        temperature,
        row_max,
        lo,
        hi,
        inv_width,
        start,
        end,
        BLOCK: tl.constexpr,
    ):
        """This chunk's token count per bin, and its totals (as a pivot pass stores them).
        (Skipping the histogram in blocks with no token in the even bins made the pass
        slower: the test costs a reduction per block, and a first pass finds tokens there
        in every block; benchmarks/NOTES.md, "Threshold round launches".)"""
        counts = tl.zeros([search.BINS], tl.int32)
        in_cnt, in_mass, in_min, in_max, up_cnt, up_mass = search.zero_totals(BLOCK)
        for offset in range(start, end, BLOCK):
            cols = offset + tl.arange(0, BLOCK)
            y, inside, above, mass = search.bracket_block(
                logits_row, cols, end, temperature, row_max, lo, hi
            )
            counts += tl.histogram(bin_of(y, lo, hi, inv_width), search.BINS)
            in_cnt, in_mass, in_min, in_max, up_cnt, up_mass = search.add_totals(
                in_cnt, in_mass, in_min, in_max, up_cnt, up_mass, y, inside, above, mass
            )
        tl.store(bins_ptr + tl.arange(0, search.BINS), counts)
        search.store_totals(partials_ptr, in_cnt, in_mass, in_min, in_max, up_cnt, up_mass)

    @triton.jit
    def bin_floor(lo, hi, inv_width, first_bin):
        """The largest float x in [lo, hi] with x == lo or bin_of(x) >= first_bin: the tokens
        of the bins before first_bin are exactly those above it."""
        lo_key = search.float_key(lo).to(tl.int64)
        hi_key = search.float_key(hi).to(tl.int64)
        for _ in range(33):
            mid = lo_key + (hi_key - lo_key + 1) // 2
            ok = bin_of(search.from_key(mid), lo, hi, inv_width) >= first_bin
            lo_key = tl.where(ok, mid, lo_key)
            hi_key = tl.where(ok, hi_key, mid - 1)
        return search.from_key(lo_key)

    @triton.jit
    def mass_bins(counts, need, lo, hi, inv_width, row_max, mass_in):
        """First and last bin where the cumulative mass (from the top) may reach `need`,
        bounding each bin's mass by its edges and the bins' sum by the exact total."""
        b = tl.arange(0, search.BINS)
        width = 1.0 / inv_width
        top = tl.minimum(hi - (b.to(tl.float32) - 0.01) * width, hi)
        bottom = tl.where(
            b >= search.BINS - 2, lo, tl.maximum(hi - (b.to(tl.float32) + 1.01) * width, lo)
        )
        upper = counts * tl.exp(top - row_max)
        lower = counts * tl.exp(bottom - row_max)
        cum_upper = tl.cumsum(upper, axis=0)
        cum_lower = tl.cumsum(lower, axis=0)
        # the mass of bins <= b at most, and of bins < b at least
        most = tl.minimum(cum_upper, mass_in - (tl.sum(lower, axis=0) - cum_lower))
        least_before = tl.maximum(
            cum_lower - lower, mass_in - (tl.sum(upper, axis=0) - (cum_upper - upper))
        )
        last_real = search.BINS - 2
        first = tl.min(tl.where(most >= need * (1.0 - MASS_MARGIN), b, last_real), axis=0)
        past = tl.min(
            tl.where(
                (least_before >= need * (1.0 + MASS_MARGIN)) & (b <= last_real), b, last_real + 1
            ),
            axis=0,
        )
        return first, tl.maximum(past - 1, first)

    @triton.jit
    def narrow_by_bins(
        state_f,
        state_i,
        pivots_ptr,
        bins_ptr,
        num_chunks,
        phase,
        target,
        cnt_in,
        mass_in,
        cnt_above,
        mass_above,
        CHUNKS_P2: tl.constexpr,
    ):
        chunks = tl.arange(0, CHUNKS_P2)
        b = tl.arange(0, search.BINS)
        rows = bins_ptr + chunks[:, None] * search.BINS + b[None, :]
        counts = tl.sum(tl.load(rows, mask=(chunks < num_chunks)[:, None], other=0), axis=0)
        counts = tl.where(b < search.BINS - 1, counts, 0).to(tl.float32)
        lo = tl.load(state_f + search.F_LO)
        hi = tl.load(state_f + search.F_HI)
        inv_width = tl.load(state_f + search.F_INV_WIDTH)
        if phase == search.SEARCH_K:
            cum = tl.cumsum(counts, axis=0)
            first = tl.min(tl.where(cum >= target - cnt_above, b, search.BINS - 2), axis=0)
            last = first
        else:
            first, last = mass_bins(
                counts,
                target - mass_above,
                lo,
                hi,
                inv_width,
                tl.load(state_f + search.F_MAX),
                mass_in,
            )
        new_hi = tl.where(first > 0, bin_floor(lo, hi, inv_width, first), hi)
        new_lo = tl.where(last < search.BINS - 2, bin_floor(lo, hi, inv_width, last + 1), lo)
        new_cnt_in = tl.sum(tl.where((b >= first) & (b <= last), counts, 0.0), axis=0)
        new_cnt_above = cnt_above + tl.sum(tl.where(b < first, counts, 0.0), axis=0)
        search.set_bracket(
            state_f,
            state_i,
            pivots_ptr,
            phase,
            target,
            new_lo,
            new_hi,
            new_cnt_above,
            new_cnt_in,
            new_cnt_in < cnt_in,
            search.HISTOGRAM,
        )

    @triton.jit
    def decide_after_counts(
        state_f, state_i, pivots_ptr, partials_ptr, bins_ptr, num_chunks, CHUNKS_P2: tl.constexpr
    ):
        """After a pivot or histogram pass: settle the phase, check that the answer lies in
        the bracket, then narrow it."""
        cnt_in, mass_in, min_in, max_in, cnt_above, mass_above = search.reduce_totals(
            partials_ptr, num_chunks, CHUNKS_P2
        )
        phase, target = search.settle_phase(state_f, state_i, cnt_in, mass_in, mass_above)
        use_mass = phase == search.SEARCH_P
        weight_above = tl.where(use_mass, mass_above, cnt_above)
        weight_in = tl.where(use_mass, mass_in, cnt_in)
        misplaced = (weight_above >= target) | (weight_above + weight_in < target)
        tl.store(state_i + search.I_PHASE, phase)
        tl.store(state_f + search.F_TARGET, target)
        if phase == search.DONE:  # min-p survivors (or everything) kept
            tl.store(state_f + search.F_THRESHOLD, tl.load(state_f + search.F_FLOOR))
        elif misplaced & (tl.load(state_i + search.I_RESTARTED) == 0):
            search.restart(state_f, state_i, pivots_ptr)
        elif (min_in == max_in) | (cnt_in <= 0.0):  # one value left in the bracket: the answer
            if phase == search.SEARCH_K:
                search.resolve_top_k(state_f, state_i, pivots_ptr, max_in, cnt_above, mass_above)
            else:
                tl.store(
                    state_f + search.F_THRESHOLD,
                    tl.where(cnt_in > 0.0, max_in, tl.load(state_f + search.F_FLOOR)),
                )
                tl.store(state_i + search.I_PHASE, search.DONE)
        elif tl.load(state_i + search.I_ACTION) == search.HISTOGRAM:
            narrow_by_bins(
                state_f,
                state_i,
                pivots_ptr,
                bins_ptr,
                num_chunks,
                phase,
                target,
                cnt_in,
                mass_in,
                cnt_above,
                mass_above,
                CHUNKS_P2,
            )
        else:
            search.narrow_by_pivots(
                state_f,
                state_i,
                pivots_ptr,
                partials_ptr,
                num_chunks,
                phase,
                target,
                cnt_in,
                cnt_above,
                mass_above,
                CHUNKS_P2,
            )

    @triton.jit
    def chunk_pass(
        logits_ptr,
        logits_stride,
        partials_ptr,
        bins_ptr,
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
        PIVOTS: tl.constexpr,
        HISTOGRAMS: tl.constexpr,
        COPIES: tl.constexpr,
        CHUNK: tl.constexpr,
        BLOCK: tl.constexpr,
    ):
        """One chunk of a row's pass, if its kind is one this launch runs (PIVOTS,
        HISTOGRAMS, COPIES: pivot counts, histograms, copy-outs). A launch compiled for
        fewer kinds keeps only their registers; a row whose kind it does not run waits."""
        state_f = state_f_ptr + row * search.ROW_F
        state_i = state_i_ptr + row * search.ROW_I
        action = tl.load(state_i + search.I_ACTION)
        is_copy = (action == search.COMPACT) | (action == search.COMPACT_ALL)
        wanted = (
            ((action == search.PIVOT) & PIVOTS)
            | ((action == search.HISTOGRAM) & HISTOGRAMS)
            | (is_copy & COPIES)
        )
        if (tl.load(state_i + search.I_PHASE) != search.DONE) & wanted:
            temperature = tl.load(temperature_ptr + tl.load(idx_mapping_ptr + row))
            logits_row = logits_ptr + row.to(tl.int64) * logits_stride
            start = chunk * CHUNK
            end = tl.minimum(start + CHUNK, vocab_size)
            lo = tl.load(state_f + search.F_LO)
            hi = tl.load(state_f + search.F_HI)
            row_max = tl.load(state_f + search.F_MAX)
            partials = partials_ptr + (row * num_chunks + chunk) * search.ROW_P
            if PIVOTS:
                if action == search.PIVOT:
                    search.pivot_chunk_pass(
                        logits_row,
                        partials,
                        temperature,
                        row_max,
                        lo,
                        hi,
                        pivots_ptr + row * search.PIVOTS,
                        start,
                        end,
                        BLOCK,
                    )
            if HISTOGRAMS:
                if action == search.HISTOGRAM:
                    histogram_chunk_pass(
                        logits_row,
                        partials,
                        bins_ptr + (row * num_chunks + chunk) * search.BINS,
                        temperature,
                        row_max,
                        lo,
                        hi,
                        tl.load(state_f + search.F_INV_WIDTH),
                        start,
                        end,
                        BLOCK,
                    )
            if COPIES:
                if is_copy:
                    top = tl.where(action == search.COMPACT_ALL, float("inf"), hi)
                    candidates.compact_chunk_pass(
                        logits_row,
                        partials,
                        candidates_ptr + row * search.CAP,
                        state_i + search.I_NUM_CANDIDATES,
                        temperature,
                        row_max,
                        lo,
                        top,
                        start,
                        end,
                        BLOCK,
                    )

    @triton.jit
    def decide(
        state_f_ptr,
        state_i_ptr,
        pivots_ptr,
        partials_ptr,
        bins_ptr,
        candidates_ptr,
        row,
        num_chunks,
        CHUNKS_P2: tl.constexpr,
        PIVOTS: tl.constexpr,
    ):
        """Act on the pass a row just made (PIVOTS: whether pivot passes ran; if not, a row
        waiting for one made none)."""
        state_f = state_f_ptr + row * search.ROW_F
        state_i = state_i_ptr + row * search.ROW_I
        action = tl.load(state_i + search.I_ACTION)
        partials = partials_ptr + row * num_chunks * search.ROW_P
        ran = (action != search.NONE) & ((action != search.PIVOT) | PIVOTS)
        if (tl.load(state_i + search.I_PHASE) != search.DONE) & ran:
            if (action == search.PIVOT) | (action == search.HISTOGRAM):
                decide_after_counts(
                    state_f,
                    state_i,
                    pivots_ptr + row * search.PIVOTS,
                    partials,
                    bins_ptr + row * num_chunks * search.BINS,
                    num_chunks,
                    CHUNKS_P2,
                )
            else:
                candidates.decide_after_compaction(
                    state_f,
                    state_i,
                    pivots_ptr + row * search.PIVOTS,
                    partials,
                    candidates_ptr + row * search.CAP,
                    num_chunks,
                    CHUNKS_P2,
                )
