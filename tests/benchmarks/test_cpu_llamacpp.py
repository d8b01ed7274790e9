"""benchmarks/cpu_llamacpp.py's pure parts: the A B B A order, the exact-length body, the
llama.cpp command and the summary (the run itself needs llama-cpp-python's server)."""

from __future__ import annotations

from benchmarks.cpu_llamacpp import (
    exact_length_body,
    headline,
    llama_command,
    server_order,
    summarize,
)


def test_the_servers_alternate_which_goes_first() -> None:
    orders = [server_order(i) for i in range(4)]
    assert orders == [
        ("tandem", "llama.cpp"),
        ("llama.cpp", "tandem"),
        ("tandem", "llama.cpp"),
        ("llama.cpp", "tandem"),
    ]


def test_both_servers_are_held_to_the_same_exact_length() -> None:
    body = exact_length_body(32, [0, 2])
    assert body == {"max_tokens": 32, "logit_bias": {"0": -100, "2": -100}}


def test_llama_cpp_queues_requests_instead_of_cutting_them() -> None:
    command = llama_command("/py", "/m.gguf", 8001, 2)
    assert command[:3] == ["/py", "-m", "llama_cpp.server"]
    flags = dict(zip(command[3::2], command[4::2]))
    assert flags["--interrupt_requests"] == "False"
    assert flags["--n_threads"] == "2" and flags["--port"] == "8001"


def _level(concurrency: int, tok_s: float, failed: int = 0) -> dict:
    return {
        "concurrency": concurrency,
        "output_throughput_tok_s": tok_s,
        "ttft": {"median_ms": 100.0},
        "tpot": {"median_ms": 20.0},
        "failed": failed,
    }


def test_the_summary_takes_each_servers_median_and_the_ratio() -> None:
    runs = [
        {"server": "tandem", "hogs": 0, "round": 1, "levels": [_level(1, 40.0)]},
        {"server": "llama.cpp", "hogs": 0, "round": 1, "levels": [_level(1, 50.0)]},
        {"server": "llama.cpp", "hogs": 0, "round": 2, "levels": [_level(1, 60.0, failed=1)]},
        {"server": "tandem", "hogs": 0, "round": 2, "levels": [_level(1, 44.0)]},
        {"server": "tandem", "hogs": 2, "round": 1, "levels": [_level(1, 30.0)]},
    ]
    rows = summarize(runs)
    assert [(r["hogs"], r["concurrency"]) for r in rows] == [(0, 1), (2, 1)]
    quiet = rows[0]
    assert quiet["tandem"]["output_tok_s"] == 42.0 and quiet["llama.cpp"]["output_tok_s"] == 55.0
    assert quiet["llama.cpp"]["failed"] == 1 and quiet["tandem"]["rounds"] == 2
    assert quiet["tandem_over_llama_cpp"] == round(42.0 / 55.0, 3)
    assert "tandem_over_llama_cpp" not in rows[1]  # llama.cpp did not run beside the hogs
    figures = headline(rows)
    assert figures["c1_ratio"] == quiet["tandem_over_llama_cpp"]
    assert figures["c1_hogs2_tandem_tok_s"] == 30.0 and "c1_hogs2_ratio" not in figures


def test_a_stream_without_usage_is_timed_and_counted_by_its_text_chunks() -> None:
    from benchmarks.serve_metrics import StreamTimeline

    role = {"choices": [{"index": 0, "delta": {"role": "assistant"}}]}
    text = {"choices": [{"index": 0, "delta": {"content": "Paris"}}]}
    end = {"choices": [{"index": 0, "delta": {}, "finish_reason": "length"}]}
    events = [(1.0, role), (2.0, text), (2.5, text), (2.6, end)]
    plain, by_text = StreamTimeline(sent_s=0.0), StreamTimeline(sent_s=0.0, by_text=True)
    for at_s, event in events:
        plain.on_event(at_s, event)
        by_text.on_event(at_s, event)
    assert not plain.result().success  # no usage chunk: the usual stream is refused
    result = by_text.result()
    assert result.success and result.output_tokens == 2 and result.ttft_s == 2.0
