"""The per-launch secret that tells the engine core its own API servers from any other
process able to open its ipc socket (actors/protocol/transport.py: a peer is ignored until its
ClientHello carries the secret).

`tandem serve` (or, with several API servers, its supervisor) draws one secret per launch
and writes it to each child's stdin, a pipe it then closes. Not argv: /proc/PID/cmdline
is readable by every user. Not the environment: every descendant inherits it (compiler
subprocesses, tensor-parallel workers) and /proc/PID/environ shows it for the process's
whole life. Not a file: a crash would leave it behind. Once the child has read the pipe,
the secret exists only in the memory of the processes that use it.
"""

from __future__ import annotations

import hmac
import secrets
import subprocess
import sys
from collections.abc import Sequence
from typing import Any

SECRET_LEN = 32


def new_secret() -> bytes:
    return secrets.token_bytes(SECRET_LEN)


def start_with_secret(
    command: Sequence[str], secret: bytes, **popen_kwargs: Any
) -> subprocess.Popen[bytes]:
    """Start `command` with `secret` waiting on its stdin (read by `read_secret`)."""
    process = subprocess.Popen(command, stdin=subprocess.PIPE, **popen_kwargs)
    assert process.stdin is not None
    try:
        process.stdin.write(secret)  # far below a pipe's buffer: never blocks
        process.stdin.close()
    except BrokenPipeError:  # the child is gone already; whoever watches it will see
        pass
    return process


def read_secret() -> bytes:
    """The secret the parent wrote to this process's stdin (read to its end)."""
    if sys.stdin.isatty():
        raise SystemExit(
            "this process is started by `tandem serve`, which passes it the launch secret on stdin"
        )
    secret = sys.stdin.buffer.read()
    if len(secret) != SECRET_LEN:
        raise SystemExit(
            f"expected a {SECRET_LEN}-byte launch secret on stdin, got {len(secret)} bytes"
        )
    return secret


def matches(presented: bytes, secret: bytes) -> bool:
    """In constant time, so that the answer's timing does not reveal how much of a guess
    was right."""
    return hmac.compare_digest(presented, secret)
