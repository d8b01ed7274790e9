"""`tandem bench`: throughput benchmarks of tandem's runners against transformers."""
