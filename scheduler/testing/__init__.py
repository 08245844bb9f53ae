"""Aids for tests and benchmarks: synthetic cost graphs with known structure."""
