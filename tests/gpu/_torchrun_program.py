"""The program torchrun starts on every rank in tests/gpu/test_external_launcher.py: the
same offline LLM on each, as a vLLM user's external_launcher script is.

    torchrun --standalone --nproc-per-node N tests/gpu/_torchrun_program.py \\
        MODEL_DIR OUT_DIR TP PP RUNNER [KILLED_RANK]

Each rank writes its pid (OUT_DIR/pid-RANK) on start, then its outputs as JSON
(OUT_DIR/rank-RANK.json). KILLED_RANK, when given, kills itself once the engine is up.
A rank still running after STACKS_AFTER_S writes every thread's stack to stderr (once), so
a job that hangs says where.
"""

from __future__ import annotations

import faulthandler
import json
import os
import signal
import sys

sys.path.insert(0, os.getcwd())

from app.llm import LLM  # noqa: E402
from tests.gpu._parallel_engine import ENGINE_OPTIONS, outputs  # noqa: E402

STACKS_AFTER_S = 60.0


def main() -> None:
    model_dir, out_dir, tp, pp, runner = sys.argv[1:6]
    killed_rank = int(sys.argv[6]) if len(sys.argv) > 6 else None
    rank = int(os.environ["RANK"])
    faulthandler.dump_traceback_later(STACKS_AFTER_S)
    with open(os.path.join(out_dir, f"pid-{rank}"), "w") as f:
        f.write(str(os.getpid()))
    llm = LLM(
        model_dir,
        **{**ENGINE_OPTIONS, "dtype": "float32", "runner": runner},
        tensor_parallel_size=int(tp),
        pipeline_parallel_size=int(pp),
        distributed_executor_backend="external_launcher",
    )
    if rank == killed_rank:
        os.kill(os.getpid(), signal.SIGKILL)
    results = [
        {"token_ids": list(o.token_ids), "logprobs": [e.logprob for e in o.logprobs or ()]}
        for o in outputs(llm)
    ]
    llm.close()
    faulthandler.cancel_dump_traceback_later()
    with open(os.path.join(out_dir, f"rank-{rank}.json"), "w") as f:
        json.dump({"runner": llm.runner, "outputs": results}, f)


if __name__ == "__main__":
    main()
