"""Benchmarks behind ``pd-transfer bench``: each runs our path and its baselines side by side in one run."""
