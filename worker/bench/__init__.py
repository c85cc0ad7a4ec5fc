"""Benchmarks (``logitpool bench ...``)."""
