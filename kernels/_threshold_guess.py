"""First passes guessed from a row's statistics (kernels/sampling_thresholds.py).

Rather than a histogram, the search's first pass can copy out the tokens where a normal
fit of the row (mean, std, count; for top-p also the exact total mass) puts the answer.
The copy-out's exact totals check the guess (kernels/_threshold_candidates.py,
decide_after_compaction): when it holds, that one pass resolves the row in registers;
when it does not, the row searches by histogram as if no guess had been made, one pass
later. A guess decides only how many passes a row takes, never its threshold.
"""

from kernels import _threshold_search as search
from kernels._triton import HAS_TRITON, tl, triton

MAX_GUESSED_TOP_K = 128
"""A top-k up to this many starts by copying out every token above a guessed cut (a normal
fit of the row puts 1.5 k + 32 tokens above it): when at least k and at most CAPACITY are,
that one pass resolves the row (with top-p inside the top k). Language model rows have a
heavier upper tail than the fit: on the embedded model's logits about twice the expected
count lies above the cut, within bounds for all 127 rows up to k = 128
(benchmarks/NOTES.md, "Top-k from a guessed cut")."""
TOP_P_HALF_WINDOW = 300.0
"""Top-p alone copies out the tokens the fit expects within this many ranks of its guess:
600 or so, well within the CAPACITY of 1024. At 256 x 151,936 the window holds the answer
for every row of N(0, 9) and peaked logits at p from 0.5 to 0.99 and for 255-256 of 256
rows of N(0, 1); on the embedded model's own logits for 126 of 127 rows
(benchmarks/NOTES.md, "Top-p alone from a guessed window")."""
TOP_P_MIN_ABOVE = 256.0
"""Where the guess lies among the top few hundred tokens, or above the fitted bulk
altogether (a few strong candidates hold more than p of the mass, common in a language
model's rows), top-p copies out every token above the cut the fit puts this many above."""

if HAS_TRITON:
    _c = tl.constexpr
    GUESSED_MAX_K = _c(MAX_GUESSED_TOP_K)
    _HALF_WINDOW, _MIN_ABOVE = _c(TOP_P_HALF_WINDOW), _c(TOP_P_MIN_ABOVE)

    @triton.jit
    def normal_tail_quantile(q):
        """z with P(N(0, 1) > z) = q for 0 < q <= 0.5 (Abramowitz and Stegun 26.2.23,
        within 5e-4): only a guess is made of it."""
        t = tl.sqrt(-2.0 * tl.log(tl.minimum(tl.maximum(q, 1e-30), 0.5)))
        return t - (
            (2.515517 + 0.802853 * t + 0.010328 * t * t)
            / (1.0 + 1.432788 * t + 0.189269 * t * t + 0.001308 * t * t * t)
        )

    @triton.jit
    def normal_quantile(x):
        """z with P(N(0, 1) <= z) = x, for any 0 < x < 1 (to normal_tail_quantile's accuracy)."""
        return tl.where(x <= 0.5, -normal_tail_quantile(x), normal_tail_quantile(1.0 - x))

    @triton.jit
    def fitted_cut(mean, std, num_above, num_tokens):
        """Where the normal fit puts num_above of num_tokens above
        (any 0 < num_above < num_tokens)."""
        return mean - std * normal_quantile(num_above / num_tokens)

    @triton.jit
    def start_guessed_copy(state_f, state_i, guess, cut_lo, cut_hi, action, lo, row_max, bins_lo):
        """A guessed first pass: if `guess`, `action` (a copy-out) of (cut_lo, cut_hi]; else,
        and when the copy misses, a histogram of (lo, row_max] from bins_lo."""
        tl.store(state_f + search.F_BINS_LO, bins_lo)
        tl.store(state_i + search.I_GUESSED, guess.to(tl.int32))
        if guess:
            tl.store(state_f + search.F_LO, cut_lo)
            tl.store(state_f + search.F_HI, cut_hi)
            tl.store(state_i + search.I_ACTION, action)
        else:
            search.start_histogram(state_f, state_i, lo, row_max, bins_lo)

    @triton.jit
    def start_top_k(state_f, state_i, lo, row_max, bins_lo, top_k, num_tokens, mean, std):
        """A top-k search's first pass: for a small k, a copy of every token above the cut
        where the fit expects 1.5 k + 32 of them; else (and when that copy holds fewer than
        k or more than CAP) a histogram from bins_lo."""
        expected = 1.5 * top_k.to(tl.float32) + 32.0
        cut = fitted_cut(mean, std, expected, num_tokens)
        guess = (
            (top_k <= GUESSED_MAX_K) & (2.0 * expected < num_tokens) & (cut > lo) & (cut < row_max)
        )
        start_guessed_copy(
            state_f, state_i, guess, cut, row_max, search.COMPACT_ALL, lo, row_max, bins_lo
        )

    @triton.jit
    def top_p_rank(top_p, mass, row_max, num_tokens, mean, std):
        """How many tokens the fit puts above top-p's answer (0: above the fitted bulk). Of
        N(mean, std^2) tokens weighing exp(y - row_max), those below t weigh
        num_tokens exp(mean + std^2 / 2 - row_max) Phi((t - mean - std^2) / std): the answer
        is the t where that is (1 - p) of the row's mass. Below the answer lie the many
        tokens the fit describes well, above it the few extreme ones it does not."""
        log_below = (
            tl.log((1.0 - top_p) * mass) - tl.log(num_tokens) - (mean + 0.5 * std * std - row_max)
        )
        in_bulk = log_below < 0.0
        below = tl.exp(tl.minimum(log_below, 0.0))
        z = normal_quantile(below) + std  # (t - mean) / std
        return tl.where(
            in_bulk, num_tokens * 0.5 * (1.0 - tl.math.erf(z * 0.7071067811865476)), 0.0
        )

    @triton.jit
    def start_top_p(state_f, state_i, lo, row_max, bins_lo, top_p, mass, num_tokens, mean, std):
        """Top-p alone's first pass: a copy of the tokens the fit expects within
        TOP_P_HALF_WINDOW ranks of its guess (of all those above, near the top); its target
        p * mass is known from the statistics pass. Else a histogram from bins_lo."""
        rank = top_p_rank(top_p, mass, row_max, num_tokens, mean, std)
        everything = rank <= _HALF_WINDOW
        num_above_lo = tl.minimum(tl.maximum(rank + _HALF_WINDOW, _MIN_ABOVE), num_tokens - 1.0)
        cut_lo = fitted_cut(mean, std, num_above_lo, num_tokens)
        cut_hi = tl.where(
            everything,
            row_max,
            tl.minimum(fitted_cut(mean, std, rank - _HALF_WINDOW, num_tokens), row_max),
        )
        guess = (std > 0.0) & (mass > 0.0) & (cut_lo > lo) & (cut_lo < cut_hi)
        tl.store(state_f + search.F_TARGET, tl.where(guess, top_p * mass, -1.0))
        start_guessed_copy(
            state_f,
            state_i,
            guess,
            cut_lo,
            cut_hi,
            tl.where(everything, search.COMPACT_ALL, search.COMPACT),
            lo,
            row_max,
            bins_lo,
        )
