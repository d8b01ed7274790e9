"""Device functions of the sort-free threshold search (kernels/sampling_thresholds.py).

The search finds, per logit row, the value T where a cumulative weight taken in descending
value order first reaches a target: weight 1 per token for top-k (T = the k-th largest),
exp(y - max) per token for top-p (T = the value whose inclusive mass reaches p * Z). It
keeps a bracket (lo, hi] known to hold T and narrows it, one pass over the row at a time:
by a histogram of the bracket (kernels/_threshold_bins.py), or, where that makes no
progress, by counting against a few pivots. Every pass also sums the exact count and mass
of the tokens above hi, so a bracket chosen from bounds is checked, never trusted. Once
the bracket holds at most CAPACITY tokens they are copied out and resolved exactly in
registers (kernels/_threshold_candidates.py).

Per-row state lives in two small tables (columns below) so that a fixed sequence of
launches (a CUDA graph) can carry rows that need different numbers of passes.
"""

from kernels._triton import HAS_TRITON, tl, triton

NUM_PIVOTS = 8
NUM_BINS = 128  # per histogram pass: 126 even bins, one for the bracket below them, one outside
CAPACITY = 1024
NUM_F = 16  # float state columns per row
NUM_I = 8  # int state columns per row
NUM_PARTIALS = 2 * NUM_PIVOTS + 6  # per chunk: counts and masses above each pivot, then totals

if HAS_TRITON:
    _c = tl.constexpr
    # the sizes above, for kernels
    PIVOTS, CAP, ROW_F, ROW_I, ROW_P = (
        _c(NUM_PIVOTS),
        _c(CAPACITY),
        _c(NUM_F),
        _c(NUM_I),
        _c(NUM_PARTIALS),
    )
    BINS = _c(NUM_BINS)
    # float state columns
    F_MAX, F_FLOOR, F_TOP_P, F_LO, F_HI = _c(0), _c(1), _c(2), _c(3), _c(4)
    # (no columns for what lies above hi: every pass sums it afresh, see T_CNT_ABOVE)
    F_TARGET, F_THRESHOLD = _c(7), _c(8)
    F_START, F_INV_WIDTH = _c(9), _c(10)  # lo where the phase's search began; bins per unit
    F_BINS_LO = _c(11)  # where the histogram after a missed guess puts its lowest even bin
    # int state columns
    I_PHASE, I_ACTION, I_TOP_K, I_NUM_CANDIDATES, I_HAS_P, I_ROUND = (
        _c(0),
        _c(1),
        _c(2),
        _c(3),
        _c(4),
        _c(5),
    )
    I_RESTARTED, I_GUESSED = _c(6), _c(7)  # I_GUESSED: the pending copy is above a guessed cut
    # per-chunk totals after the per-pivot sums: tokens in (lo, hi] (count, mass, min, max),
    # then the count and mass of those above hi
    T_CNT_IN, T_MASS_IN, T_MIN_IN = (
        _c(2 * NUM_PIVOTS),
        _c(2 * NUM_PIVOTS + 1),
        _c(2 * NUM_PIVOTS + 2),
    )
    T_MAX_IN, T_CNT_ABOVE, T_MASS_ABOVE = (
        _c(2 * NUM_PIVOTS + 3),
        _c(2 * NUM_PIVOTS + 4),
        _c(2 * NUM_PIVOTS + 5),
    )
    # phases and actions
    DONE, SEARCH_K, SEARCH_P = _c(0), _c(1), _c(2)
    NONE, PIVOT, COMPACT, COMPACT_ALL, HISTOGRAM = _c(0), _c(1), _c(2), _c(3), _c(4)

    @triton.jit
    def scaled(x, temperature):
        """logits / temperature, correctly rounded, as the Gumbel kernel scales them."""
        if (temperature != 0.0) & (temperature != 1.0):
            x = tl.math.div_rn(x, temperature)
        return x

    @triton.jit
    def float_key(x):
        """An int32 that orders as the float32 x does."""
        bits = x.to(tl.int32, bitcast=True)
        return tl.where(bits >= 0, bits, bits ^ 0x7FFFFFFF)

    @triton.jit
    def from_key(key):
        bits = tl.where(key >= 0, key, key ^ 0x7FFFFFFF).to(tl.int32)
        return bits.to(tl.float32, bitcast=True)

    @triton.jit
    def linspace_pivots(lo, hi):
        """NUM_PIVOTS descending pivots strictly between lo and hi: evenly spaced in value,
        or in the float order (int keys) once the bracket is a few thousand floats wide."""
        j = tl.arange(0, PIVOTS)
        frac = (j + 1).to(tl.float32) / (PIVOTS + 1)
        by_value = hi - (hi - lo) * frac
        key_lo = float_key(lo).to(tl.int64)
        key_hi = float_key(hi).to(tl.int64)
        by_key = from_key(key_hi - ((key_hi - key_lo) * (j + 1)) // (PIVOTS + 1))
        return tl.where(key_hi - key_lo <= 4096, by_key, by_value)

    @triton.jit
    def bracket_block(logits_row, cols, end, temperature, row_max, lo, hi):
        """One block's scaled values, which of them are in (lo, hi] and which (finite) above
        hi, and their masses exp(y - row_max)."""
        y = scaled(tl.load(logits_row + cols, mask=cols < end, other=float("-inf")), temperature)
        return y, (y > lo) & (y <= hi), (y > hi) & (y < float("inf")), tl.exp(y - row_max)

    @triton.jit
    def zero_totals(BLOCK: tl.constexpr):
        zeros = tl.zeros([BLOCK], tl.float32)
        return (
            zeros,
            zeros,
            tl.full([BLOCK], float("inf"), tl.float32),
            tl.full([BLOCK], float("-inf"), tl.float32),
            zeros,
            zeros,
        )

    @triton.jit
    def add_totals(in_cnt, in_mass, in_min, in_max, up_cnt, up_mass, y, inside, above, mass):
        """Per-lane running totals of a pass: count, mass, min and max of the tokens in the
        bracket, count and mass of those above it."""
        return (
            in_cnt + inside.to(tl.float32),
            in_mass + tl.where(inside, mass, 0.0),
            tl.minimum(in_min, tl.where(inside, y, float("inf"))),
            tl.maximum(in_max, tl.where(inside, y, float("-inf"))),
            up_cnt + above.to(tl.float32),
            up_mass + tl.where(above, mass, 0.0),
        )

    @triton.jit
    def store_totals(partials_ptr, in_cnt, in_mass, in_min, in_max, up_cnt, up_mass):
        tl.store(partials_ptr + T_CNT_IN, tl.sum(in_cnt, axis=0))
        tl.store(partials_ptr + T_MASS_IN, tl.sum(in_mass, axis=0))
        tl.store(partials_ptr + T_MIN_IN, tl.min(in_min, axis=0))
        tl.store(partials_ptr + T_MAX_IN, tl.max(in_max, axis=0))
        tl.store(partials_ptr + T_CNT_ABOVE, tl.sum(up_cnt, axis=0))
        tl.store(partials_ptr + T_MASS_ABOVE, tl.sum(up_mass, axis=0))

    @triton.jit
    def pivot_chunk_pass(
        logits_row,
        partials_ptr,
        temperature,
        row_max,
        lo,
        hi,
        pivots_ptr,
        start,
        end,
        BLOCK: tl.constexpr,
    ):
        """Per pivot: count and mass (exp(y - row_max)) of this chunk's tokens in (lo, hi]
        above the pivot; then the chunk's totals. The per-pivot sums are reduced every block
        rather than kept per lane, and two blocks are loaded per iteration: registers stay
        low and bytes in flight high, for a memory-bound pass."""
        pivots = tl.load(pivots_ptr + tl.arange(0, PIVOTS))
        sum_cnt = tl.zeros([PIVOTS], tl.float32)
        sum_mass = tl.zeros([PIVOTS], tl.float32)
        in_cnt, in_mass, in_min, in_max, up_cnt, up_mass = zero_totals(BLOCK)
        for offset in range(start, end, 2 * BLOCK):
            for half in tl.static_range(2):
                cols = offset + half * BLOCK + tl.arange(0, BLOCK)
                y, inside, above, mass = bracket_block(
                    logits_row, cols, end, temperature, row_max, lo, hi
                )
                hit = inside[:, None] & (y[:, None] > pivots[None, :])
                sum_cnt += tl.sum(hit.to(tl.float32), axis=0)
                sum_mass += tl.sum(tl.where(hit, mass[:, None], 0.0), axis=0)
                in_cnt, in_mass, in_min, in_max, up_cnt, up_mass = add_totals(
                    in_cnt, in_mass, in_min, in_max, up_cnt, up_mass, y, inside, above, mass
                )
        j = tl.arange(0, PIVOTS)
        tl.store(partials_ptr + j, sum_cnt)
        tl.store(partials_ptr + PIVOTS + j, sum_mass)
        store_totals(partials_ptr, in_cnt, in_mass, in_min, in_max, up_cnt, up_mass)

    @triton.jit
    def reduce_totals(partials_ptr, num_chunks, CHUNKS_P2: tl.constexpr):
        """A row's totals over its chunks, summed in chunk order (batch invariant)."""
        chunks = tl.arange(0, CHUNKS_P2)
        in_range = chunks < num_chunks
        tail = partials_ptr + chunks * ROW_P
        return (
            tl.sum(tl.load(tail + T_CNT_IN, mask=in_range, other=0.0), axis=0),
            tl.sum(tl.load(tail + T_MASS_IN, mask=in_range, other=0.0), axis=0),
            tl.min(tl.load(tail + T_MIN_IN, mask=in_range, other=float("inf")), axis=0),
            tl.max(tl.load(tail + T_MAX_IN, mask=in_range, other=float("-inf")), axis=0),
            tl.sum(tl.load(tail + T_CNT_ABOVE, mask=in_range, other=0.0), axis=0),
            tl.sum(tl.load(tail + T_MASS_ABOVE, mask=in_range, other=0.0), axis=0),
        )

    @triton.jit
    def _at(values, index, SIZE: tl.constexpr):
        """values[index] for a 1-D register tensor (0 when index is out of range)."""
        return tl.sum(tl.where(tl.arange(0, SIZE) == index, values, 0.0), axis=0)

    @triton.jit
    def start_histogram(state_f, state_i, lo, hi, bins_lo):
        """Next pass: a histogram of (lo, hi], NUM_BINS - 2 even bins over (bins_lo, hi] and
        a last bin for what lies below (kernels/_threshold_bins.py)."""
        tl.store(state_f + F_LO, lo)
        tl.store(state_f + F_HI, hi)
        span = hi - tl.maximum(bins_lo, lo)
        tl.store(
            state_f + F_INV_WIDTH, tl.where(span > 0.0, tl.minimum((BINS - 2) / span, 1e30), 1e30)
        )
        tl.store(state_i + I_ACTION, HISTOGRAM)

    @triton.jit
    def restart(state_f, state_i, pivots_ptr):
        """A bracket chosen from bounds missed the answer (or float sums disagree at a knife
        edge): search the phase's whole range again, by pivots and exact sums, once."""
        lo = tl.load(state_f + F_START)
        hi = tl.load(state_f + F_MAX)
        tl.store(state_i + I_RESTARTED, 1)
        tl.store(state_f + F_LO, lo)
        tl.store(state_f + F_HI, hi)
        tl.store(state_i + I_ACTION, PIVOT)
        tl.store(pivots_ptr + tl.arange(0, PIVOTS), linspace_pivots(lo, hi))

    @triton.jit
    def resolve_top_k(state_f, state_i, pivots_ptr, kth, cnt_greater, mass_greater):
        """The k-th largest survivor is known (kth), with the count and mass of the tokens
        above it: done, unless top-p must still cut inside the top k (then search it among
        the tokens above kth)."""
        top_k = tl.load(state_i + I_TOP_K).to(tl.float32)
        row_max = tl.load(state_f + F_MAX)
        target = tl.load(state_f + F_TOP_P) * (
            mass_greater + (top_k - cnt_greater) * tl.exp(kth - row_max)
        )
        if (tl.load(state_i + I_HAS_P) == 0) | (mass_greater < target):
            tl.store(state_f + F_THRESHOLD, kth)
            tl.store(state_i + I_PHASE, DONE)
        else:
            tl.store(state_i + I_PHASE, SEARCH_P)
            tl.store(state_i + I_ROUND, 0)
            tl.store(state_f + F_START, kth)
            tl.store(state_f + F_TARGET, target)
            if cnt_greater <= CAP:
                tl.store(state_f + F_LO, kth)
                tl.store(state_f + F_HI, row_max)
                tl.store(state_i + I_ACTION, COMPACT_ALL)
            else:
                start_histogram(state_f, state_i, kth, row_max, kth)

    @triton.jit
    def settle_phase(state_f, state_i, cnt_in, mass_in, mass_above):
        """The phase and target after a counting pass: on the first pass, a top-k as large as
        the survivors keeps them all (top-p, if any, alone decides) and top-p's target
        p * (the survivors' mass) becomes known."""
        phase = tl.load(state_i + I_PHASE)
        first_round = tl.load(state_i + I_ROUND) == 0
        target = tl.load(state_f + F_TARGET)
        k_inactive = (
            (phase == SEARCH_K)
            & first_round
            & (cnt_in <= tl.load(state_i + I_TOP_K).to(tl.float32))
        )
        has_p = tl.load(state_i + I_HAS_P) != 0
        phase = tl.where(k_inactive, tl.where(has_p, SEARCH_P, DONE), phase)
        pending = (phase == SEARCH_P) & (k_inactive | (target < 0.0))
        target = tl.where(pending, tl.load(state_f + F_TOP_P) * (mass_above + mass_in), target)
        return phase, target

    @triton.jit
    def set_bracket(
        state_f,
        state_i,
        pivots_ptr,
        phase,
        target,
        new_lo,
        new_hi,
        new_cnt_above,
        new_cnt_in,
        progress,
        next_action,
    ):
        """Store a narrowed bracket and pick the next pass: copy it out if it fits (with all
        above it if that fits too), else `next_action` while the count shrinks, else pivots."""
        tl.store(state_i + I_PHASE, phase)
        tl.store(state_i + I_ROUND, tl.load(state_i + I_ROUND) + 1)
        tl.store(state_f + F_TARGET, target)
        tl.store(state_f + F_LO, new_lo)
        tl.store(state_f + F_HI, new_hi)
        if new_cnt_above + new_cnt_in <= CAP:
            tl.store(state_i + I_ACTION, COMPACT_ALL)
        elif new_cnt_in <= CAP:
            tl.store(state_i + I_ACTION, COMPACT)
        elif (next_action == HISTOGRAM) & progress:
            start_histogram(state_f, state_i, new_lo, new_hi, new_lo)
        else:
            tl.store(state_i + I_ACTION, PIVOT)
            tl.store(pivots_ptr + tl.arange(0, PIVOTS), linspace_pivots(new_lo, new_hi))

    @triton.jit
    def narrow_by_pivots(
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
        CHUNKS_P2: tl.constexpr,
    ):
        """Narrow the bracket to the pivot interval where the weight reaches the target."""
        chunks = tl.arange(0, CHUNKS_P2)
        j = tl.arange(0, PIVOTS)
        rows = partials_ptr + chunks[:, None] * ROW_P + j[None, :]
        in_range = (chunks < num_chunks)[:, None]
        cnt_j = tl.sum(tl.load(rows, mask=in_range, other=0.0), axis=0)
        mass_j = tl.sum(tl.load(rows + PIVOTS, mask=in_range, other=0.0), axis=0)
        pivots = tl.load(pivots_ptr + j)
        use_mass = phase == SEARCH_P
        weight_j = tl.where(use_mass, mass_j, cnt_j)
        weight_above = tl.where(use_mass, mass_above, cnt_above)
        first = tl.min(tl.where(weight_above + weight_j >= target, j, PIVOTS), axis=0)
        found = first < PIVOTS
        upper = first - 1  # index of the new bracket's upper pivot; -1: the old hi
        new_lo = tl.where(found, _at(pivots, first, PIVOTS), tl.load(state_f + F_LO))
        new_hi = tl.where(upper >= 0, _at(pivots, upper, PIVOTS), tl.load(state_f + F_HI))
        cnt_upper = _at(cnt_j, upper, PIVOTS)
        new_cnt_in = tl.where(found, _at(cnt_j, first, PIVOTS), cnt_in) - cnt_upper
        set_bracket(
            state_f,
            state_i,
            pivots_ptr,
            phase,
            target,
            new_lo,
            new_hi,
            cnt_above + cnt_upper,
            new_cnt_in,
            False,
            PIVOT,
        )
