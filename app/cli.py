"""`tandem` command line: serve, generate, export-tokenizer."""

from __future__ import annotations

import argparse
import sys

from app import export_tokenizer_cmd, generate_cmd, serve_cmd
from app.cli_errors import UserFacingError

EXIT_USAGE = 2


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="tandem",
        description="tandem: an OpenAI-compatible LLM inference server with an overlapped, "
        "GPU-native model runner. Runs the embedded SmolLM2-135M-Instruct offline "
        "by default.",
    )
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    serve_cmd.add_parser(sub)
    generate_cmd.add_parser(sub)
    export_tokenizer_cmd.add_parser(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    _log_to_stderr()
    try:
        return args.run(args)
    except KeyboardInterrupt:
        return 130
    except UserFacingError as exc:
        print(f"tandem: error: {exc}", file=sys.stderr)
        return EXIT_USAGE


def _log_to_stderr() -> None:
    # stdout carries results (`generate --json`); logs must never interleave with them.
    # `serve` reconfigures logging from its own flags.
    from telemetry.logging import configure_logging

    configure_logging(json=False, level="info", stream=sys.stderr)


if __name__ == "__main__":
    sys.exit(main())
