"""The environment of every tensor-parallel worker process.

tandem never uses NVLink multicast (NVLS / NVLink SHARP): it needs driver and fabric
support that many virtualised multi-GPU hosts lack, and there NCCL's multicast setup, or
torch's symmetric-memory and NVSHMEM multicast objects, fail or hang at the first
collective. Plain NVLink peer-to-peer transfers are unaffected. The variables are set
before the communicator starts, in the parent (so spawned workers inherit them) and again
in each worker (so a worker started by another launcher is covered too).
"""

from __future__ import annotations

import logging
import os
from collections.abc import MutableMapping

logger = logging.getLogger(__name__)

NO_MULTICAST_ENV: dict[str, str] = {
    "NCCL_NVLS_ENABLE": "0",
    "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1",
    "NVSHMEM_DISABLE_NVLS": "1",
}


def apply_worker_env(environ: MutableMapping[str, str] | None = None) -> dict[str, str]:
    """Set NO_MULTICAST_ENV in `environ` (os.environ by default), overriding other values
    with a warning. Returns {name: previous value} for each value that was overridden."""
    environ = os.environ if environ is None else environ
    overridden: dict[str, str] = {}
    for name, value in NO_MULTICAST_ENV.items():
        previous = environ.get(name)
        if previous is not None and previous != value:
            overridden[name] = previous
            logger.warning(
                "%s=%s overridden with %s: tandem never uses NVLink multicast",
                name,
                previous,
                value,
            )
        environ[name] = value
    return overridden
