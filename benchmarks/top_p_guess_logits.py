"""How often top-p alone resolves in the threshold search's first pass: the share of rows
the guessed copy-out (kernels/_threshold_guess.start_top_p) resolves within one graphed
round, the rest searching by histogram. Each row's threshold is checked against the
sort-based reference (equal, or different only at a float32 knife edge).

    --source gaussian (CUDA): 256 x 151,936 rows of N(0, 1), N(0, 9), the peaked rows of
        benchmarks/_threshold_ab.py and Student-t (5 degrees) * 2, at temperature 0.8;
    --source model (CPU, kernels in the Triton interpreter): the embedded model's logits
        (SmolLM2-135M-Instruct) before each token of its greedy answers to a few prompts.

    python3 benchmarks/top_p_guess_logits.py --source gaussian --out $OUT/top_p_guess_gaussian.json
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
from pathlib import Path

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from kernels import sampling_thresholds as module  # noqa: E402
from tests.kernels.test_sampling_thresholds import _knife_edge_only  # noqa: E402

TOP_PS = (0.5, 0.8, 0.9, 0.95, 0.99)


def gaussian_rows(kind: str, num_rows: int, vocab: int) -> torch.Tensor:
    generator = torch.Generator(device="cuda").manual_seed(1)
    randn = torch.randn(num_rows, vocab, device="cuda", generator=generator)
    if kind == "peaked":
        randn *= 2.5
        randn[:, :50] += 10 * torch.rand(num_rows, 50, device="cuda", generator=generator)
        return randn
    if kind == "student_t5":
        torch.manual_seed(1)
        chi2 = torch.distributions.Chi2(torch.tensor(5.0, device="cuda")).sample((num_rows, vocab))
        return 2 * randn / torch.sqrt(chi2 / 5)
    return randn * {"randn1": 1.0, "randn3": 3.0}[kind]


def one_round(logits: torch.Tensor, temperature: float, top_p: float) -> dict[str, object]:
    """Rows resolved by the first round; rows whose threshold differs from the reference
    beyond a knife edge (after all rounds)."""
    num_rows, device = logits.shape[0], logits.device
    rows = torch.arange(num_rows, dtype=torch.int32, device=device)
    filters = (torch.full((num_rows,), temperature, device=device),
               torch.zeros(num_rows, dtype=torch.int32, device=device),
               torch.full((num_rows,), top_p, device=device), torch.zeros(num_rows, device=device))
    _, state = module._launch(logits, rows, (rows, *filters), module.CHUNK, 0, num_rounds=1)
    thresholds = module.sampling_thresholds_triton(logits, rows, *filters).cpu()
    expected = module.sampling_thresholds_ref(logits, rows, *filters).cpu()
    cpu_logits = logits.cpu()
    wrong = [row for row in torch.nonzero(thresholds != expected).flatten().tolist()
             if not _knife_edge_only(cpu_logits[row], temperature, 0, top_p, 0.0,
                                     (float(thresholds[row]), float(expected[row])))]
    return {"temperature": temperature, "top_p": top_p, "rows": num_rows,
            "resolved_in_first_round": int((state[:, 0] == 0).sum()), "rows_wrong": wrong}


def model_logits(max_tokens: int) -> torch.Tensor:
    sys.path.insert(0, str(ROOT / "benchmarks"))
    from top_k_guess_real_logits import PROMPTS, answer_logits

    from app.llm import LLM
    from tests._hf_reference import hf_reference_model

    llm = LLM("default", runner="v2", max_model_len=512, max_num_seqs=4)
    model = hf_reference_model()
    return torch.cat([answer_logits(llm, model, prompt, max_tokens) for prompt in PROMPTS])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--source", choices=("gaussian", "model"), required=True)
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--rows", type=int, default=256)
    parser.add_argument("--vocab", type=int, default=151936)
    parser.add_argument("--max-tokens", type=int, default=40)
    args = parser.parse_args()
    results = []
    if args.source == "gaussian":
        for kind in ("randn1", "randn3", "peaked", "student_t5"):
            logits = gaussian_rows(kind, args.rows, args.vocab)
            for top_p in TOP_PS:
                results.append({"logits": kind, **one_round(logits, 0.8, top_p)})
                print(results[-1], flush=True)
        hardware = torch.cuda.get_device_name()
    else:
        logits = model_logits(args.max_tokens)
        for temperature in (0.7, 1.0):
            for top_p in (0.9, 0.95):
                results.append({"logits": "embedded model", **one_round(logits, temperature, top_p)})
                print(results[-1], flush=True)
        hardware = f"CPU ({platform.machine()}), Triton interpreter"
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                            cwd=ROOT).stdout.strip()
    args.out.write_text(json.dumps({"what": __doc__.split("\n\n")[0], "commit": commit,
                                    "hardware": hardware, "command": " ".join(sys.argv),
                                    "results": results}, indent=1))


if __name__ == "__main__":
    main()
