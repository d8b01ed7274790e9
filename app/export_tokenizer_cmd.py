"""`tandem export-tokenizer`: write a served model's tokenizer as a Hugging Face directory."""

from __future__ import annotations

import argparse
from typing import Any


def add_parser(sub: Any) -> None:
    p = sub.add_parser(
        "export-tokenizer",
        help="write the model's tokenizer as a Hugging Face directory",
        description="Write the tokenizer of any model tandem loads (the embedded model, a GGUF "
        "file, a Hugging Face directory) as a Hugging Face tokenizer directory: "
        "tokenizer.json, tokenizer_config.json (special tokens, chat template), "
        "special_tokens_map.json and generation_config.json (the EOS ids). "
        "transformers.AutoTokenizer.from_pretrained(DIR) loads it, so tools that "
        "need the served model's tokenizer (guidellm, lm-eval) work offline.",
    )
    p.add_argument(
        "--model",
        default="default",
        help="'default' (embedded SmolLM2-135M-Instruct), a .gguf file or a Hugging Face directory",
    )
    p.add_argument(
        "--tokenizer",
        default=None,
        help="take the tokenizer from here instead (a .gguf file or a directory)",
    )
    p.add_argument("out_dir", metavar="DIR", help="directory to write (created if missing)")
    p.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    from app.cli_errors import UserFacingError
    from app.tokenizer_export import export_tokenizer
    from app.tokenizer_loader import load_generation_config, load_tokenizer

    try:
        tokenizer = load_tokenizer(args.model, args.tokenizer)
        generation_config = load_generation_config(args.model)
    except (OSError, ValueError) as exc:
        raise UserFacingError(str(exc)) from None
    if tokenizer is None:
        source = args.tokenizer or args.model
        raise UserFacingError(
            f"{source} has no tokenizer (dummy weights, a directory without "
            "tokenizer.json, or a GGUF without tokenizer metadata); pass "
            "--tokenizer"
        )
    for path in export_tokenizer(tokenizer, args.out_dir, generation_config):
        print(path)
    return 0
