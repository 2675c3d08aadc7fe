"""Benchmarks shipped with the package, run by ``rlferry bench NAME`` and ``benchmarks/*.py``."""
