"""`tandem generate`: offline generation for one or many prompts."""

from __future__ import annotations

import argparse
import sys
from typing import Any

import orjson

from actors.protocol.sampling_params import SamplingParams
from app.engine_args import add_engine_args, engine_config_from_args


def add_parser(sub: Any) -> None:
    p = sub.add_parser(
        "generate",
        help="generate completions offline",
        description="Generate completions for prompts offline, without a server. Each prompt is "
        "rendered through the model's chat template as one user message unless --raw.",
    )
    src = p.add_argument_group("prompts")
    src.add_argument("--prompt", action="append", default=[], help="a prompt (repeat for several)")
    src.add_argument("--prompts-file", help="a text file with one prompt per line")
    src.add_argument(
        "--raw", action="store_true", help="send prompts as plain text, without the chat template"
    )
    s = p.add_argument_group("sampling")
    s.add_argument("--max-tokens", type=int, default=128, help="most tokens to generate per prompt")
    s.add_argument("--min-tokens", type=int, default=0, help="fewest tokens before EOS may stop")
    s.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default)")
    s.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling mass")
    s.add_argument("--top-k", type=int, default=-1, help="sample among the k likeliest (-1: off)")
    s.add_argument(
        "--min-p", type=float, default=0.0, help="drop tokens below min_p x the top probability"
    )
    s.add_argument("--repetition-penalty", type=float, default=1.0, help="1.0 = off")
    s.add_argument(
        "--sample-seed",
        dest="sample_seed",
        type=int,
        default=None,
        help="sampling seed of every request (reproducible sampling)",
    )
    s.add_argument("--stop", action="append", default=[], help="a stop string (repeatable)")
    s.add_argument("--ignore-eos", action="store_true", help="keep generating past EOS")
    s.add_argument("--n", type=int, default=1, help="completions per prompt")
    s.add_argument(
        "--logprobs", type=int, default=None, help="return top-k logprobs per token (0-20)"
    )
    o = p.add_argument_group("output")
    o.add_argument(
        "--json",
        action="store_true",
        help="print one JSON object per prompt, in input order, with text, token_ids, "
        "finish_reason and runner",
    )
    o.add_argument("--no-progress", action="store_true", help="hide the progress bar")
    add_engine_args(p)
    p.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    from app.cli_errors import UserFacingError, user_errors

    prompts = _read_prompts(args)
    if not prompts:
        raise UserFacingError("no prompts: give --prompt TEXT or --prompts-file FILE")
    try:
        params = _sampling_params(args)
        from app.llm import LLM

        llm = LLM(**_config_kwargs(args))
        inputs = prompts if args.raw else [llm.chat_prompt(p) for p in prompts]
        outputs = _generate_with_progress(
            llm, inputs, params, show=not args.no_progress and llm.rank == 0
        )
        llm.close()
    except user_errors() as exc:
        raise UserFacingError(str(exc)) from None
    if llm.rank != 0:  # the ranks of an external launcher: rank 0 prints for all
        return 0
    for prompt, out in zip(prompts, outputs):
        _print_output(args, prompt, out, llm.runner, llm.runner_reason)
    return 0


def _config_kwargs(args: argparse.Namespace) -> dict[str, Any]:
    config = engine_config_from_args(args)
    return {f: getattr(config, f) for f in config.__dataclass_fields__}


def _read_prompts(args: argparse.Namespace) -> list[str]:
    prompts = list(args.prompt)
    if args.prompts_file:
        from app.cli_errors import UserFacingError

        try:
            with open(args.prompts_file, encoding="utf-8") as f:
                prompts.extend(line.rstrip("\n") for line in f if line.strip())
        except OSError as exc:
            raise UserFacingError(
                f"cannot read prompts file {args.prompts_file}: {exc.strerror}"
            ) from None
    return prompts


def _sampling_params(args: argparse.Namespace) -> SamplingParams:
    return SamplingParams(
        n=args.n,
        temperature=args.temperature,
        top_p=args.top_p,
        top_k=args.top_k,
        min_p=args.min_p,
        repetition_penalty=args.repetition_penalty,
        seed=args.sample_seed,
        max_tokens=args.max_tokens,
        min_tokens=args.min_tokens,
        stop=tuple(args.stop),
        ignore_eos=args.ignore_eos,
        logprobs=args.logprobs,
    )


def _generate_with_progress(
    llm: Any, inputs: list[Any], params: SamplingParams, show: bool
) -> list[Any]:
    if not show or len(inputs) < 2:
        return llm.generate(inputs, params)
    from tqdm import tqdm

    with tqdm(total=len(inputs), desc="generate", unit="prompt", file=sys.stderr) as bar:
        return llm.generate(inputs, params, on_finished=lambda _: bar.update(1))


def _print_output(
    args: argparse.Namespace, prompt: str, out: Any, runner: str, reason: str
) -> None:
    if not args.json:
        for completion in out.outputs:
            sys.stdout.write(completion.text + "\n")
        return
    completions = [_completion_record(c) for c in out.outputs]
    record = {
        "prompt": prompt,
        **completions[0],
        "num_prompt_tokens": len(out.prompt_token_ids),
        "num_cached_tokens": out.num_cached_tokens,
        "runner": runner,
        "runner_reason": reason,
    }
    if len(completions) > 1:
        record["completions"] = completions
    sys.stdout.write(orjson.dumps(record).decode() + "\n")


def _completion_record(completion: Any) -> dict[str, Any]:
    return {
        "text": completion.text,
        "token_ids": list(completion.token_ids),
        "finish_reason": completion.finish_reason,
        "stop_reason": completion.stop_reason,
    }
