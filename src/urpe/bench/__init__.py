"""Benchmarks behind `urpe bench ...`: speed and memory measurements, not part of the core."""
