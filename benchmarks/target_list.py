"""The open issues' targets, each read from the results that measure it (benchmarks/targets.py
prints them). An issue's table row is one Target; "report" rows carry no bound."""

from __future__ import annotations

from benchmarks.targets import BeforeCommit, Detail, Figure, Ratio, Reader, Target

REUSE_BASELINE_COMMIT = "95c77a7"
"""The commit before decoded blocks joined the prefix cache (issue 29's "without")."""


def _tokens_per_s(result: str) -> Reader:
    return Figure(result, "v2_output_tok_s")


def _tpot(result: str) -> Reader:
    return Figure(result, "v2_tpot_median_ms")


def _vs_transformers(result: str) -> Reader:
    return Ratio(_tokens_per_s(result), Figure(result, "hf_static_output_tok_s"))


def _kv_tokens(result: str) -> Reader:
    return Detail(result, lambda d: d["startup"]["kv_cache_tokens"])


def _preemptions(result: str) -> Reader:
    return Detail(result, lambda d: max(run["num_preemptions"] for run in d["runs"]))


def _tiers(prefix: str, key: str, arm: str, against: str) -> Reader:
    return Ratio(Figure(f"{prefix}_{arm}", key), Figure(f"{prefix}_{against}", key))


def _moe_targets() -> list[Target]:
    ms, tok_s, x = " ms", " tok/s", "x"
    return [
        Target(25, "gpt-oss-20b batch-1 TPOT", _tpot("throughput_w4_batch1"), 3.5, True, ms),
        Target(
            25,
            "gpt-oss-20b batch-1 TPOT, --mxfp4-copy fp8",
            _tpot("throughput_w4_mxfp4_fp8_copy_batch1"),
            3.5,
            True,
            ms,
        ),
        Target(25, "gpt-oss-20b offline", _tokens_per_s("throughput_w4"), 25_000, unit=tok_s),
        Target(
            25,
            "gpt-oss-20b offline, --mxfp4-copy fp8",
            _tokens_per_s("throughput_w4_mxfp4_fp8_copy"),
            25_000,
            unit=tok_s,
        ),
        Target(
            25,
            "gpt-oss-20b offline, --mxfp4-copy bf16",
            _tokens_per_s("throughput_w4_mxfp4_bf16_copy"),
            25_000,
            unit=tok_s,
        ),
        Target(25, "gpt-oss-20b vs transformers", _vs_transformers("throughput_w4_hf"), 10, unit=x),
        Target(25, "qwen3-30b-a3b batch-1 TPOT", _tpot("throughput_w5_batch1"), 5, True, ms),
        Target(25, "qwen3-30b-a3b offline", _tokens_per_s("throughput_w5"), 20_000, unit=tok_s),
        Target(
            25, "qwen3-30b-a3b vs transformers", _vs_transformers("throughput_w5_hf"), 10, unit=x
        ),
        Target(25, "gpt-oss-120b batch-1 TPOT", _tpot("throughput_gpt_oss_120b_batch1"), unit=ms),
        Target(
            25,
            "gpt-oss-20b served c256 / offline at 256 rows",
            Ratio(
                Figure("serve_chat_w4", "c256_output_tok_s"), _tokens_per_s("throughput_w4_seqs256")
            ),
            unit=x,
        ),
    ]


def _fp8_targets() -> list[Target]:
    ms, tok_s, x = " ms", " tok/s", "x"
    return [
        Target(
            26, "llama-3.1-8b FP8 batch-1 TPOT", _tpot("throughput_w3_fp8_batch1"), 3.0, True, ms
        ),
        Target(26, "W3 FP8 offline", _tokens_per_s("throughput_w3_fp8"), 30_000, unit=tok_s),
        Target(
            26,
            "W3 FP8 KV tokens / bf16 KV's",
            Ratio(_kv_tokens("throughput_w3_fp8_kv"), _kv_tokens("throughput_w3_fp8")),
            1.9,
            unit=x,
        ),
        Target(
            26,
            "W3 FP8 KV tok/s / bf16 KV's",
            Ratio(_tokens_per_s("throughput_w3_fp8_kv"), _tokens_per_s("throughput_w3_fp8")),
            1.0,
            unit=x,
        ),
        Target(26, "W3 FP8 KV preemptions", _preemptions("throughput_w3_fp8_kv"), 0, True),
        Target(
            26, "qwen3-32b FP8 batch-1 TPOT", _tpot("throughput_qwen3_32b_fp8_batch1"), 10, True, ms
        ),
    ]


TIER_TARGETS = (  # what, figure, the arm it is held against, bound, at most
    ("hit rate / unlimited pool's", "hit_rate", "unlimited", 0.8, False),
    ("TTFT p50 turns 2-8 / unlimited pool's", "turns_2_on_ttft_p50_ms", "unlimited", 1.5, True),
    ("server ITL / same pool without copies", "server_itl_mean_ms", "limited", 1.1, True),
)


def _tier_targets(model: str, prefix: str) -> list[Target]:
    return [
        Target(
            29, f"{model} host tier: {what}", _tiers(prefix, key, "host", arm), bound, at_most, "x"
        )
        for what, key, arm, bound, at_most in TIER_TARGETS
    ]


REUSE_TARGETS = (  # what, figure
    ("computed prefill turns 2-8", "turns_2_on_computed_prefill_mean"),
    ("TTFT p50 turns 2-8", "turns_2_on_ttft_p50_ms"),
)


def _reuse_targets(model: str, prefix: str) -> list[Target]:
    """Decoded blocks reused against the same tree without (--no-prefix-caching-outputs)."""
    return [
        Target(
            29,
            f"{model} decoded reuse: {what}, with / without",
            _tiers(prefix, key, "unlimited", "noreuse"),
            0.5,
            True,
            "x",
        )
        for what, key in REUSE_TARGETS
    ]


def _reuse_targets_across_commits() -> list[Target]:
    """The first measurement: the tree before decoded blocks were cached as the without."""
    result = "multi_turn_qwen3"
    return [
        Target(
            29,
            f"qwen3-0.6b decoded reuse: {what}, with / without ({REUSE_BASELINE_COMMIT})",
            Ratio(Figure(result, key), BeforeCommit(result, key, REUSE_BASELINE_COMMIT)),
            0.5,
            True,
            "x",
        )
        for what, key in REUSE_TARGETS
    ]


TARGETS: list[Target] = [
    *_moe_targets(),
    *_fp8_targets(),
    *_reuse_targets_across_commits(),
    *_reuse_targets("qwen3-0.6b", "multi_turn_qwen3_tiers"),
    *_reuse_targets("llama-3.1-8b", "multi_turn_llama8b_tiers"),
    *_tier_targets("qwen3-0.6b", "multi_turn_qwen3_tiers"),
    *_tier_targets("llama-3.1-8b", "multi_turn_llama8b_tiers"),
]
