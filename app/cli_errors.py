"""Errors the command line reports on one line (exit code 2), never as a traceback."""

from __future__ import annotations


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
