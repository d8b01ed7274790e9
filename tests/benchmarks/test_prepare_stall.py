"""benchmarks.prepare_stall on the embedded model's tokenizer: both arms prepare the same
tokens, and the record holds each arm's stall and preparation time."""

from __future__ import annotations

import json
from pathlib import Path

from benchmarks import prepare_stall
from tests._embedded_model import needs_embedded_model


@needs_embedded_model
def test_both_arms_prepare_the_same_request_and_are_timed(tmp_path: Path) -> None:
    output = tmp_path / "record.json"
    argv = ["--turns", "3", "--system-len", "300", "--user-len", "40", "--answer-len", "60"]
    argv += ["--repeats", "2", "--not-a-result", "--output", str(output)]
    assert prepare_stall.main(argv) == 0
    record = json.loads(output.read_text())
    assert record["workload"]["body_bytes"] > 1000
    assert record["details"]["prompt_tokens"] > 300 + 3 * 40 + 2 * 60
    for arm in prepare_stall.ARMS:
        samples = record["details"]["samples_ms"][arm]
        assert len(samples) == 2 and all(stall > 0 and prepared > 0 for stall, prepared in samples)
        assert record["figures"][f"{arm}_stall_median_ms"] > 0
