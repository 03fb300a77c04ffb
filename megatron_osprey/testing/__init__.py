"""Tiny random models and data that the tests and the benchmarks build on the fly.

It lives in the library (as `torch.testing` does) so that benchmarks need not import
from tests/; it sits above the stages (it runs prune and adapt) and nothing in the
pipeline imports it.
"""
