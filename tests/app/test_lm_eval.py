"""lm-eval's `local-completions` model runs a loglikelihood (multiple-choice) task from a
local dataset file end to end against the server, with the server's remote tokenizer
endpoints; its per-choice loglikelihoods equal transformers' on the same weights."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from tests._hf_reference import hf_reference_model
from tests.app._server_fixtures import RunningServer

pytestmark = pytest.mark.slow
lm_eval = pytest.importorskip("lm_eval")

DOCS = [{"question": "The capital of France is", "choices": ["Paris", "Tokyo"], "answer": 0},
        {"question": "Two plus two equals", "choices": ["seven", "four"], "answer": 1},
        {"question": "The sky on a clear day is", "choices": ["blue", "green"], "answer": 0}]
TASK = """task: tandem_tiny_mc
dataset_path: json
dataset_kwargs:
  data_files:
    test: {data}
test_split: test
output_type: multiple_choice
doc_to_text: "{{{{question}}}}"
doc_to_choice: "{{{{choices}}}}"
doc_to_target: answer
metric_list:
  - metric: acc
"""


@pytest.fixture(scope="module")
def server() -> Iterator[RunningServer]:
    running = RunningServer()
    yield running
    running.stop()


def _reference_loglikelihood(tokenizer: object, context_text: str, continuation_text: str
                             ) -> float:
    """As lm-eval splits a request: the whole text's tokens, the context's tokens first."""
    whole = tokenizer.encode(context_text + continuation_text)  # type: ignore[attr-defined]
    context = tokenizer.encode(context_text)  # type: ignore[attr-defined]
    continuation = whole[len(context):]
    token_ids = torch.tensor([whole])
    with torch.no_grad():
        logprobs = torch.log_softmax(hf_reference_model()(token_ids).logits[0].float(), -1)
    positions = range(len(context) - 1, len(context) + len(continuation) - 1)
    return sum(logprobs[p, t].item() for p, t in zip(positions, continuation))


def test_local_completions_loglikelihood_task(server: RunningServer, tmp_path: Path) -> None:
    from lm_eval.tasks import TaskManager

    data = tmp_path / "docs.jsonl"
    data.write_text("".join(json.dumps(doc) + "\n" for doc in DOCS))
    (tmp_path / "task.yaml").write_text(TASK.format(data=data))
    results = lm_eval.simple_evaluate(
        model="local-completions",
        model_args={"base_url": server.url + "/v1/completions", "model": "default",
                    "tokenizer_backend": "remote", "num_concurrent": 2, "max_retries": 1},
        tasks=["tandem_tiny_mc"], task_manager=TaskManager(include_path=str(tmp_path)),
        log_samples=True, limit=len(DOCS))
    assert results is not None
    samples = results["samples"]["tandem_tiny_mc"]
    assert len(samples) == len(DOCS)
    tokenizer = server.state.tokenizer
    for sample in samples:
        doc = sample["doc"]
        for choice, response in zip(doc["choices"], sample["resps"]):
            loglikelihood, _ = response[0]
            # lm-eval's default target delimiter joins the question and each choice.
            expected = _reference_loglikelihood(tokenizer, doc["question"], " " + choice)
            assert loglikelihood == pytest.approx(expected, abs=5e-3)
    accuracy = results["results"]["tandem_tiny_mc"]["acc,none"]
    assert 0.0 <= accuracy <= 1.0
