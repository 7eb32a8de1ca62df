"""pipeline-bench and the micro-benchmarks."""
