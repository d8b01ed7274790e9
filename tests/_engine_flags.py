"""The engine configuration a command line gives, as `tandem serve` and `tandem generate`
parse it (for the tests of each engine flag)."""

from __future__ import annotations

import argparse

from actors.protocol.config import EngineConfig
from app.engine_args import add_engine_args, engine_config_from_args


def config_from_flags(*argv: str) -> EngineConfig:
    parser = argparse.ArgumentParser()
    add_engine_args(parser)
    return engine_config_from_args(parser.parse_args(list(argv)))
