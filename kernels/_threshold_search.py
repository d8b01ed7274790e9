"""Device functions of the sort-free threshold search (kernels/sampling_thresholds.py).

The search finds, per logit row, the value T where a cumulative weight taken in descending
value order first reaches a target: weight 1 per token for top-k (T = the k-th largest),
exp(y - max) per token for top-p (T = the value whose inclusive mass reaches p * Z). It
keeps a bracket (lo, hi] known to hold T, with the weight of everything above hi, and
narrows it by counting against a few pivots per pass over the row; once the bracket holds
at most CAPACITY tokens they are copied out, sorted in registers and resolved exactly.

Per-row state lives in two small tables (columns below) so that a fixed sequence of
launches (a CUDA graph) can carry rows that need different numbers of passes.
"""

from kernels._triton import HAS_TRITON, tl, triton

NUM_PIVOTS = 8
CAPACITY = 1024
NUM_F = 16  # float state columns per row
NUM_I = 8  # int state columns per row
NUM_PARTIALS = 2 * NUM_PIVOTS + 4  # per chunk: counts and masses above each pivot, then 4 more

if HAS_TRITON:
    _c = tl.constexpr
    # the sizes above, for kernels
    PIVOTS, CAP, ROW_F, ROW_I, ROW_P = _c(NUM_PIVOTS), _c(CAPACITY), _c(NUM_F), _c(NUM_I), _c(NUM_PARTIALS)
    # float state columns
    F_MAX, F_FLOOR, F_TOP_P, F_LO, F_HI = _c(0), _c(1), _c(2), _c(3), _c(4)
    F_CNT_ABOVE, F_MASS_ABOVE, F_TARGET, F_THRESHOLD = _c(5), _c(6), _c(7), _c(8)
    # int state columns
    I_PHASE, I_ACTION, I_TOP_K, I_NUM_CANDIDATES, I_HAS_P, I_ROUND = _c(0), _c(1), _c(2), _c(3), _c(4), _c(5)
    # phases and actions
    DONE, SEARCH_K, SEARCH_P = _c(0), _c(1), _c(2)
    NONE, PIVOT, COMPACT, COMPACT_ALL = _c(0), _c(1), _c(2), _c(3)

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
    def upper_normal_quantile(q):
        """z with P(Z > z) = q for a standard normal (Abramowitz-Stegun 26.2.23, |err| < 5e-4:
        it only places pivots, so the search stays exact whatever it returns)."""
        q = tl.minimum(tl.maximum(q, 1e-12), 1.0 - 1e-7)
        tail = tl.minimum(q, 1.0 - q)
        t = tl.sqrt(-2.0 * tl.log(tail))
        z = t - (2.515517 + t * (0.802853 + t * 0.010328)) / (1.0 + t * (1.432788 + t * (0.189269 + t * 0.001308)))
        return tl.where(q < 0.5, z, -z)

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
    def _pivot_block(logits_row, cols, end, temperature, row_max, lo, hi, pivots):
        y = scaled(tl.load(logits_row + cols, mask=cols < end, other=float("-inf")), temperature)
        valid = (y > lo) & (y <= hi)
        mass = tl.where(valid, tl.exp(y - row_max), 0.0)
        above = valid[:, None] & (y[:, None] > pivots[None, :])
        return (y, valid, mass, tl.sum(above.to(tl.float32), axis=0),
                tl.sum(tl.where(above, mass[:, None], 0.0), axis=0))

    @triton.jit
    def pivot_chunk_pass(logits_row, partials_ptr, temperature, row_max, lo, hi, pivots_ptr,
                         start, end, BLOCK: tl.constexpr):
        """Per pivot: count and mass (exp(y - row_max)) of this chunk's tokens in (lo, hi]
        above the pivot; also their total count and mass, min and max. The per-pivot sums
        are reduced every block rather than kept per lane, and two blocks are loaded per
        iteration: registers stay low and bytes in flight high, for a memory-bound pass."""
        pivots = tl.load(pivots_ptr + tl.arange(0, PIVOTS))
        sum_cnt = tl.zeros([PIVOTS], tl.float32)
        sum_mass = tl.zeros([PIVOTS], tl.float32)
        in_cnt = tl.zeros([BLOCK], tl.float32)
        in_mass = tl.zeros([BLOCK], tl.float32)
        in_min = tl.full([BLOCK], float("inf"), tl.float32)
        in_max = tl.full([BLOCK], float("-inf"), tl.float32)
        for offset in range(start, end, 2 * BLOCK):
            cols = offset + tl.arange(0, BLOCK)
            y0, valid0, mass0, cnt0, sum0 = _pivot_block(logits_row, cols, end, temperature,
                                                        row_max, lo, hi, pivots)
            y1, valid1, mass1, cnt1, sum1 = _pivot_block(logits_row, cols + BLOCK, end, temperature,
                                                        row_max, lo, hi, pivots)
            sum_cnt += cnt0 + cnt1
            sum_mass += sum0 + sum1
            in_cnt += valid0.to(tl.float32) + valid1.to(tl.float32)
            in_mass += mass0 + mass1
            in_min = tl.minimum(in_min, tl.minimum(tl.where(valid0, y0, float("inf")),
                                                   tl.where(valid1, y1, float("inf"))))
            in_max = tl.maximum(in_max, tl.maximum(tl.where(valid0, y0, float("-inf")),
                                                   tl.where(valid1, y1, float("-inf"))))
        j = tl.arange(0, PIVOTS)
        tl.store(partials_ptr + j, sum_cnt)
        tl.store(partials_ptr + PIVOTS + j, sum_mass)
        tl.store(partials_ptr + 2 * PIVOTS, tl.sum(in_cnt, axis=0))
        tl.store(partials_ptr + 2 * PIVOTS + 1, tl.sum(in_mass, axis=0))
        tl.store(partials_ptr + 2 * PIVOTS + 2, tl.min(in_min, axis=0))
        tl.store(partials_ptr + 2 * PIVOTS + 3, tl.max(in_max, axis=0))

    @triton.jit
    def compact_chunk_pass(logits_row, candidates_ptr, count_ptr, temperature, lo, hi, start, end,
                           BLOCK: tl.constexpr):
        """Append this chunk's tokens in (lo, hi] to the row's candidates (at most CAPACITY
        are stored; the count keeps counting)."""
        for offset in range(start, end, BLOCK):
            cols = offset + tl.arange(0, BLOCK)
            y = scaled(tl.load(logits_row + cols, mask=cols < end, other=float("-inf")), temperature)
            valid = (y > lo) & (y <= hi)
            num_valid = tl.sum(valid.to(tl.int32), axis=0)
            if num_valid > 0:
                base = tl.atomic_add(count_ptr, num_valid)
                slot = base + tl.cumsum(valid.to(tl.int32), axis=0) - 1
                tl.store(candidates_ptr + slot, y, mask=valid & (slot < CAP))

    @triton.jit
    def chunk_pass(logits_ptr, logits_stride, partials_ptr, candidates_ptr, state_f_ptr,
                   state_i_ptr, pivots_ptr, row, chunk, num_chunks, temperature, vocab_size,
                   CHUNK: tl.constexpr, BLOCK: tl.constexpr):
        """One chunk of a row's pass: whatever the row's state asks for."""
        action = tl.load(state_i_ptr + row * ROW_I + I_ACTION)
        phase = tl.load(state_i_ptr + row * ROW_I + I_PHASE)
        if (phase != DONE) & (action != NONE):
            logits_row = logits_ptr + row.to(tl.int64) * logits_stride
            start = chunk * CHUNK
            end = tl.minimum(start + CHUNK, vocab_size)
            lo = tl.load(state_f_ptr + row * ROW_F + F_LO)
            hi = tl.load(state_f_ptr + row * ROW_F + F_HI)
            if action == PIVOT:
                pivot_chunk_pass(logits_row, partials_ptr + (row * num_chunks + chunk) * ROW_P,
                                 temperature, tl.load(state_f_ptr + row * ROW_F + F_MAX), lo, hi,
                                 pivots_ptr + row * PIVOTS, start, end, BLOCK)
            else:
                top = tl.where(action == COMPACT_ALL, float("inf"), hi)
                compact_chunk_pass(logits_row, candidates_ptr + row * CAP,
                                   state_i_ptr + row * ROW_I + I_NUM_CANDIDATES, temperature, lo,
                                   top, start, end, BLOCK)

    @triton.jit
    def _at(values, index, SIZE: tl.constexpr):
        """values[index] for a 1-D register tensor (0 when index is out of range)."""
        return tl.sum(tl.where(tl.arange(0, SIZE) == index, values, 0.0), axis=0)

    @triton.jit
    def first_pivots(row_max, mean, std, lo, phase, top_k, top_p, num_finite):
        """Pivots for a row's first pass, placed where a normal sample of this mean and std
        would put the answer, plus a few near the max (peaked rows) and far below; where
        they land affects only how many passes the search takes, never its result."""
        std = tl.maximum(std, 1e-6)
        if phase == SEARCH_K:
            expected = mean + std * upper_normal_quantile(top_k.to(tl.float32) / num_finite)
        else:
            # Mass-weighted, a normal sample is a normal shifted by std^2, cut at the max.
            shift = mean + std * std
            below_max = 0.5 * (1.0 + tl.math.erf((row_max - shift) / (std * 1.4142135)))
            expected = shift + std * upper_normal_quantile(1.0 - below_max * (1.0 - top_p))
        j = tl.arange(0, PIVOTS)
        pivots = tl.where(j == 0, row_max - 0.05 * std, 0.5 * (row_max + expected))
        offsets = tl.where(j == 2, 0.375, tl.where(j == 3, 0.125, tl.where(j == 4, -0.125, tl.where(
            j == 5, -0.375, tl.where(j == 6, -1.0, -2.5)))))
        pivots = tl.where(j >= 2, expected + offsets * std, pivots)
        pivots = tl.minimum(tl.maximum(pivots, lo), row_max)
        return tl.sort(pivots, descending=True)

    @triton.jit
    def resolve_top_k(state_f, state_i, pivots_ptr, kth, cnt_greater, mass_greater):
        """The k-th largest survivor is known (kth), with the count and mass of the tokens
        above it: done, unless top-p must still cut inside the top k (then search it among
        the tokens above kth)."""
        top_k = tl.load(state_i + I_TOP_K).to(tl.float32)
        row_max = tl.load(state_f + F_MAX)
        target = tl.load(state_f + F_TOP_P) * (mass_greater + (top_k - cnt_greater) * tl.exp(kth - row_max))
        if (tl.load(state_i + I_HAS_P) == 0) | (mass_greater < target):
            tl.store(state_f + F_THRESHOLD, kth)
            tl.store(state_i + I_PHASE, DONE)
        else:
            tl.store(state_i + I_PHASE, SEARCH_P)
            tl.store(state_i + I_ROUND, 0)
            tl.store(state_f + F_LO, kth)
            tl.store(state_f + F_HI, row_max)
            tl.store(state_f + F_CNT_ABOVE, 0.0)
            tl.store(state_f + F_MASS_ABOVE, 0.0)
            tl.store(state_f + F_TARGET, target)
            if cnt_greater <= CAP:
                tl.store(state_i + I_ACTION, COMPACT_ALL)
            else:
                tl.store(state_i + I_ACTION, PIVOT)
                tl.store(pivots_ptr + tl.arange(0, PIVOTS), linspace_pivots(kth, row_max))

    @triton.jit
    def decide_after_pivots(state_f, state_i, pivots_ptr, partials_ptr, num_chunks,
                            CHUNKS_P2: tl.constexpr):
        """Narrow the bracket to the pivot interval where the weight reaches the target."""
        chunks = tl.arange(0, CHUNKS_P2)
        in_range = chunks < num_chunks
        j = tl.arange(0, PIVOTS)
        rows = partials_ptr + chunks[:, None] * ROW_P + j[None, :]
        cnt_j = tl.sum(tl.load(rows, mask=in_range[:, None], other=0.0), axis=0)
        mass_j = tl.sum(tl.load(rows + PIVOTS, mask=in_range[:, None], other=0.0), axis=0)
        tail = partials_ptr + chunks * ROW_P + 2 * PIVOTS
        cnt_in = tl.sum(tl.load(tail, mask=in_range, other=0.0), axis=0)
        mass_in = tl.sum(tl.load(tail + 1, mask=in_range, other=0.0), axis=0)
        min_in = tl.min(tl.load(tail + 2, mask=in_range, other=float("inf")), axis=0)
        max_in = tl.max(tl.load(tail + 3, mask=in_range, other=float("-inf")), axis=0)
        phase = tl.load(state_i + I_PHASE)
        first_round = tl.load(state_i + I_ROUND) == 0
        cnt_above = tl.load(state_f + F_CNT_ABOVE)
        mass_above = tl.load(state_f + F_MASS_ABOVE)
        target = tl.load(state_f + F_TARGET)
        # A top-k as large as the survivors keeps them all: top-p (if any) alone decides.
        k_inactive = (phase == SEARCH_K) & first_round & (cnt_in <= tl.load(state_i + I_TOP_K).to(tl.float32))
        has_p = tl.load(state_i + I_HAS_P) != 0
        phase = tl.where(k_inactive, tl.where(has_p, SEARCH_P, DONE), phase)
        pending = (phase == SEARCH_P) & (k_inactive | (target < 0.0))
        target = tl.where(pending, tl.load(state_f + F_TOP_P) * (mass_above + mass_in), target)
        if phase == DONE:  # min-p survivors (or everything) kept
            tl.store(state_f + F_THRESHOLD, tl.load(state_f + F_FLOOR))
            tl.store(state_i + I_PHASE, DONE)
        elif (min_in == max_in) | (cnt_in <= 0.0):  # one value left in the bracket: the answer
            if phase == SEARCH_K:
                resolve_top_k(state_f, state_i, pivots_ptr, max_in, cnt_above, mass_above)
            else:
                tl.store(state_f + F_THRESHOLD, tl.where(cnt_in > 0.0, max_in, tl.load(state_f + F_FLOOR)))
                tl.store(state_i + I_PHASE, DONE)
        else:
            narrow_bracket(state_f, state_i, pivots_ptr, phase, target, cnt_j, mass_j, cnt_in,
                           cnt_above, mass_above)

    @triton.jit
    def narrow_bracket(state_f, state_i, pivots_ptr, phase, target, cnt_j, mass_j, cnt_in,
                       cnt_above, mass_above):
        j = tl.arange(0, PIVOTS)
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
        new_cnt_above = cnt_above + cnt_upper
        new_cnt_in = tl.where(found, _at(cnt_j, first, PIVOTS), cnt_in) - cnt_upper
        tl.store(state_i + I_PHASE, phase)
        tl.store(state_i + I_ROUND, tl.load(state_i + I_ROUND) + 1)
        tl.store(state_f + F_TARGET, target)
        tl.store(state_f + F_LO, new_lo)
        tl.store(state_f + F_HI, new_hi)
        tl.store(state_f + F_CNT_ABOVE, new_cnt_above)
        tl.store(state_f + F_MASS_ABOVE, mass_above + _at(mass_j, upper, PIVOTS))
        if new_cnt_above + new_cnt_in <= CAP:
            tl.store(state_i + I_ACTION, COMPACT_ALL)
        elif new_cnt_in <= CAP:
            tl.store(state_i + I_ACTION, COMPACT)
        else:
            tl.store(state_i + I_ACTION, PIVOT)
            tl.store(pivots_ptr + j, linspace_pivots(new_lo, new_hi))

    @triton.jit
    def largest_reaching(values, valid, weights, need, floor_key):
        """The largest x among `values` with sum(weights where values >= x) >= need, found by
        bisection over the float order in (floor_key, key(max)]; the float of floor_key if
        no larger x reaches it. Sorting the candidates would give the same answer."""
        lo_key = floor_key.to(tl.int64)
        hi_key = float_key(tl.max(tl.where(valid, values, float("-inf")), axis=0)).to(tl.int64)
        hi_key = tl.maximum(hi_key, lo_key)
        for _ in range(32):
            mid = lo_key + (hi_key - lo_key + 1) // 2
            reached = tl.sum(tl.where(valid & (values >= from_key(mid)), weights, 0.0), axis=0) >= need
            lo_key = tl.where(reached, mid, lo_key)
            hi_key = tl.where(reached, hi_key, mid - 1)
        return from_key(lo_key)

    @triton.jit
    def decide_after_compaction(state_f, state_i, pivots_ptr, candidates_ptr):
        """The bracket's tokens (or every token above lo) are in the candidates: read the
        answer off their cumulative weights, in registers."""
        i = tl.arange(0, CAP)
        valid = i < tl.minimum(tl.load(state_i + I_NUM_CANDIDATES), CAP)
        values = tl.load(candidates_ptr + i, mask=valid, other=float("-inf"))
        mass = tl.where(valid, tl.exp(values - tl.load(state_f + F_MAX)), 0.0)
        lowest_key = float_key(tl.min(tl.where(valid, values, float("inf")), axis=0))
        everything = tl.load(state_i + I_ACTION) == COMPACT_ALL
        base_cnt = tl.where(everything, 0.0, tl.load(state_f + F_CNT_ABOVE))
        base_mass = tl.where(everything, 0.0, tl.load(state_f + F_MASS_ABOVE))
        tl.store(state_i + I_NUM_CANDIDATES, 0)
        if tl.load(state_i + I_PHASE) == SEARCH_K:
            top_k = tl.load(state_i + I_TOP_K).to(tl.float32)
            kth = largest_reaching(values, valid, valid.to(tl.float32), top_k - base_cnt, lowest_key)
            greater = valid & (values > kth)
            cnt_greater = base_cnt + tl.sum(greater.to(tl.float32), axis=0)
            mass_greater = base_mass + tl.sum(tl.where(greater, mass, 0.0), axis=0)
            if everything & (tl.load(state_i + I_HAS_P) != 0):
                # Top-p over exactly the k best ranks: of the k-th value's ties, only those
                # ranked within k count (its total is the mass of the top k).
                row_max = tl.load(state_f + F_MAX)
                top_mass = mass_greater + (top_k - cnt_greater) * tl.exp(kth - row_max)
                threshold = largest_reaching(values, valid, mass, tl.load(state_f + F_TOP_P) * top_mass,
                                             float_key(kth))
                tl.store(state_f + F_THRESHOLD, threshold)
                tl.store(state_i + I_PHASE, DONE)
            else:
                resolve_top_k(state_f, state_i, pivots_ptr, kth, cnt_greater, mass_greater)
        else:
            threshold = largest_reaching(values, valid, mass, tl.load(state_f + F_TARGET) - base_mass,
                                         lowest_key)
            tl.store(state_f + F_THRESHOLD, threshold)
            tl.store(state_i + I_PHASE, DONE)

    @triton.jit
    def decide(state_f_ptr, state_i_ptr, pivots_ptr, partials_ptr, candidates_ptr, row, num_chunks,
               CHUNKS_P2: tl.constexpr):
        state_f = state_f_ptr + row * ROW_F
        state_i = state_i_ptr + row * ROW_I
        action = tl.load(state_i + I_ACTION)
        if (tl.load(state_i + I_PHASE) != DONE) & (action != NONE):
            if action == PIVOT:
                decide_after_pivots(state_f, state_i, pivots_ptr + row * PIVOTS,
                                    partials_ptr + row * num_chunks * ROW_P, num_chunks, CHUNKS_P2)
            else:
                decide_after_compaction(state_f, state_i, pivots_ptr + row * PIVOTS,
                                        candidates_ptr + row * CAP)
