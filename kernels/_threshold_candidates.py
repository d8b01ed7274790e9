"""Copy-outs of the sort-free threshold search (kernels/_threshold_search.py).

Once a row's bracket (lo, hi] holds at most CAPACITY tokens, a pass appends them (or,
when they fit too, every token above lo) to the row's candidates and sums the pass's exact
totals, as every pass does. The answer is then read off the candidates' cumulative
weights in registers, by bisection over the float order in integer fixed point, so that
neither the order the chunks appended them in nor a sort can change a threshold. Where
the totals show the answer is not among them (a guessed cut that missed, a float sum at a
knife edge), the row searches again (kernels/_threshold_search.py, restart).
"""

from kernels._triton import HAS_TRITON, tl, triton

if HAS_TRITON:
    from kernels._threshold_search import (
        CAP,
        COMPACT_ALL,
        DONE,
        F_BINS_LO,
        F_MAX,
        F_START,
        F_TARGET,
        F_THRESHOLD,
        F_TOP_P,
        I_ACTION,
        I_GUESSED,
        I_HAS_P,
        I_NUM_CANDIDATES,
        I_PHASE,
        I_RESTARTED,
        I_TOP_K,
        SEARCH_K,
        add_totals,
        bracket_block,
        float_key,
        from_key,
        reduce_totals,
        resolve_top_k,
        restart,
        start_histogram,
        store_totals,
        zero_totals,
    )

    @triton.jit
    def compact_chunk_pass(
        logits_row,
        partials_ptr,
        candidates_ptr,
        count_ptr,
        temperature,
        row_max,
        lo,
        hi,
        start,
        end,
        BLOCK: tl.constexpr,
    ):
        """Append this chunk's tokens in (lo, hi] to the row's candidates (at most CAPACITY
        are stored; the count keeps counting), and store the chunk's totals. Each token in
        the bracket takes its slot by an atomic of its own: a block-wide count would cost a
        reduction across warps per block, and the bracket holds few of a row's tokens."""
        in_cnt, in_mass, in_min, in_max, up_cnt, up_mass = zero_totals(BLOCK)
        counter = count_ptr + tl.zeros([BLOCK], tl.int32)
        for offset in range(start, end, BLOCK):
            cols = offset + tl.arange(0, BLOCK)
            y, inside, above, mass = bracket_block(
                logits_row, cols, end, temperature, row_max, lo, hi
            )
            slot = tl.atomic_add(counter, 1, mask=inside, sem="relaxed")
            tl.store(candidates_ptr + slot, y, mask=inside & (slot < CAP))
            in_cnt, in_mass, in_min, in_max, up_cnt, up_mass = add_totals(
                in_cnt, in_mass, in_min, in_max, up_cnt, up_mass, y, inside, above, mass
            )
        store_totals(partials_ptr, in_cnt, in_mass, in_min, in_max, up_cnt, up_mass)

    @triton.jit
    def exact_sum(weights):
        """sum(weights) for weights in [0, 1] (counts, masses relative to the max) in 2^-40
        fixed point: integer sums are the same in any order, so the order the chunks
        appended the candidates in (which the batch's other rows change) cannot change a
        threshold."""
        return tl.sum((weights * 1099511627776.0).to(tl.int64), axis=0).to(tl.float32) * (
            1.0 / 1099511627776.0
        )

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
            reached = exact_sum(tl.where(valid & (values >= from_key(mid)), weights, 0.0)) >= need
            lo_key = tl.where(reached, mid, lo_key)
            hi_key = tl.where(reached, hi_key, mid - 1)
        return from_key(lo_key)

    @triton.jit
    def decide_after_compaction(
        state_f,
        state_i,
        pivots_ptr,
        partials_ptr,
        candidates_ptr,
        num_chunks,
        CHUNKS_P2: tl.constexpr,
    ):
        """The bracket's tokens (or every token above lo) are in the candidates: read the
        answer off their cumulative weights, in registers, after the pass's exact totals
        confirm that the answer is among them."""
        i = tl.arange(0, CAP)
        num_candidates = tl.load(state_i + I_NUM_CANDIDATES)
        valid = i < tl.minimum(num_candidates, CAP)
        values = tl.load(candidates_ptr + i, mask=valid, other=float("-inf"))
        mass = tl.where(valid, tl.exp(values - tl.load(state_f + F_MAX)), 0.0)
        lowest_key = float_key(tl.min(tl.where(valid, values, float("inf")), axis=0))
        everything = tl.load(state_i + I_ACTION) == COMPACT_ALL
        _, _, _, _, base_cnt, base_mass = reduce_totals(partials_ptr, num_chunks, CHUNKS_P2)
        tl.store(state_i + I_NUM_CANDIDATES, 0)
        search_k = tl.load(state_i + I_PHASE) == SEARCH_K
        top_k = tl.load(state_i + I_TOP_K).to(tl.float32)
        need = tl.where(search_k, top_k - base_cnt, tl.load(state_f + F_TARGET) - base_mass)
        have = tl.where(search_k, num_candidates.to(tl.float32), exact_sum(mass))
        misplaced = (need <= 0.0) | (need > have) | (num_candidates > CAP)
        guessed = tl.load(state_i + I_GUESSED) != 0
        tl.store(state_i + I_GUESSED, 0)
        if misplaced & guessed:  # the guess missed: search as if it had not been tried
            # (top-p's target comes from the histogram's exact total again, as without a guess)
            tl.store(state_f + F_TARGET, tl.where(search_k, tl.load(state_f + F_TARGET), -1.0))
            start_histogram(
                state_f,
                state_i,
                tl.load(state_f + F_START),
                tl.load(state_f + F_MAX),
                tl.load(state_f + F_BINS_LO),
            )
        elif misplaced & (tl.load(state_i + I_RESTARTED) == 0):
            restart(state_f, state_i, pivots_ptr)
        elif search_k:
            kth = largest_reaching(values, valid, valid.to(tl.float32), need, lowest_key)
            greater = valid & (values > kth)
            cnt_greater = base_cnt + tl.sum(greater.to(tl.float32), axis=0)
            mass_greater = base_mass + exact_sum(tl.where(greater, mass, 0.0))
            if everything & (tl.load(state_i + I_HAS_P) != 0):
                # Top-p over exactly the k best ranks: of the k-th value's ties, only those
                # ranked within k count (its total is the mass of the top k).
                row_max = tl.load(state_f + F_MAX)
                top_mass = mass_greater + (top_k - cnt_greater) * tl.exp(kth - row_max)
                threshold = largest_reaching(
                    values, valid, mass, tl.load(state_f + F_TOP_P) * top_mass, float_key(kth)
                )
                tl.store(state_f + F_THRESHOLD, threshold)
                tl.store(state_i + I_PHASE, DONE)
            else:
                resolve_top_k(state_f, state_i, pivots_ptr, kth, cnt_greater, mass_greater)
        else:
            tl.store(state_f + F_THRESHOLD, largest_reaching(values, valid, mass, need, lowest_key))
            tl.store(state_i + I_PHASE, DONE)
