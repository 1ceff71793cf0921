"""Measurement libraries behind the benchmarks in experiments/ and the notebooks."""
