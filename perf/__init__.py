"""Benchmarks: providers, the timing method (timing.py) and plots."""
