"""Errors the command line reports on one line (exit code 2), never as a traceback."""

from __future__ import annotations


class UserFacingError(Exception):
    """An error whose message is the whole story: printed on one line, exit code 2."""


def user_errors() -> tuple[type[BaseException], ...]:
    """Errors caused by what the user asked for (files, flags, parameters), not by a bug.
    Imports the engine's modules (torch): for the CLI and the engine core's process, never
    for a front end's request path."""
    from actors.core.engine_startup import load_errors

    return load_errors()


def flag_errors() -> tuple[type[BaseException], ...]:
    """Errors in the flags themselves, found while building the configuration; these
    modules load no torch, so the front end can report them too."""
    from actors.protocol.config import ConfigError
    from actors.protocol.logits_processors import LogitsProcessorLoadError
    from actors.protocol.speculative_config import SpeculativeConfigError

    return (ConfigError, SpeculativeConfigError, LogitsProcessorLoadError)
