"""tandem's benchmark suite: what to run before and after a change to the engine. Not
shipped in the wheel, not imported by the product; run from a checkout.

    python -m benchmarks.throughput --workload W1     offline engine: V2, V1, transformers
    python -m benchmarks.serve --server "ARGS" ...    a server under streamed load
    python -m benchmarks.soak                         the CPU server under a misbehaving mix
    python -m benchmarks.paged_attention              the decode attention kernel's bandwidth
    python -m benchmarks.sampler                      the device sampler, path by path
    python -m benchmarks.spec_decode                  ngram speculation off and on, step profile
    python -m benchmarks.report                       the results, each against its history
    bash benchmarks/device_run.sh python3 -m benchmarks.NAME ...   the same on the GPU machine

Every benchmark takes the options of benchmarks.recording (`--result`, `--results-dir`,
`--not-a-result`, `--output`) and records one result per name in
benchmarks/results/<name>.json (current + history), only from a committed tree.
benchmarks/NOTES.md keeps what the experiments measured and concluded.
"""
