"""benchmarks.multi_turn reads the offload tiers' hits (summed over tiers) with the prefix
cache's counters, for the host tier's target run."""

from __future__ import annotations

import httpx
import pytest

from benchmarks.multi_turn_figures import read_counters


def test_read_counters_keeps_the_tiers_hits(monkeypatch: pytest.MonkeyPatch) -> None:
    text = (
        "# TYPE tandem:kv_offload_hits counter\n"
        'tandem:kv_offload_hits_total{model_name="m",engine="0",tier="cpu"} 32.0\n'
        'tandem:kv_offload_hits_total{model_name="m",engine="0",tier="disk"} 16.0\n'
        "# TYPE tandem:kv_offload_bytes counter\n"
        'tandem:kv_offload_bytes_total{model_name="m",engine="0",tier="cpu",direction="save"} 9.0\n'
    )
    monkeypatch.setattr(httpx, "get", lambda url, **kw: httpx.Response(200, text=text))
    assert read_counters("http://x") == {"tandem:kv_offload_hits_total": 48.0}
