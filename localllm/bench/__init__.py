"""Benchmarks: llama-bench's tests, the editor's and the server's workloads."""
