"""Benchmarks: workloads, throughput and sharing, serving load, step latency, and the transformers baseline."""
