"""`tandem` command line: serve, generate, bench."""

from __future__ import annotations

import argparse
import sys

from app import generate_cmd, serve_cmd

EXIT_USAGE = 2


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="tandem",
        description="tandem: an OpenAI-compatible LLM inference server with an overlapped, "
                    "GPU-native model runner. Runs the embedded SmolLM2-135M-Instruct offline "
                    "by default.")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    serve_cmd.add_parser(sub)
    generate_cmd.add_parser(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        return args.run(args)
    except KeyboardInterrupt:
        return 130
    except UserFacingError as exc:
        print(f"tandem: error: {exc}", file=sys.stderr)
        return EXIT_USAGE


class UserFacingError(Exception):
    """An error whose message is the whole story: printed on one line, exit code 2."""


def user_errors() -> tuple[type[BaseException], ...]:
    """Errors caused by what the user asked for (files, flags, parameters), not by a bug."""
    from actors.sampling_params import SamplingParamsError
    from app.config import ConfigError
    from gpu.models.config import UnsupportedModelError
    from gpu.runner_selection import RunnerSelectionError
    from gpu.weights.loader import ModelLoadError
    from gpu.worker import WorkerConfigError

    return (SamplingParamsError, ConfigError, UnsupportedModelError, RunnerSelectionError,
            ModelLoadError, WorkerConfigError)


if __name__ == "__main__":
    sys.exit(main())
