"""Acceptance-length evaluation: AL benchmark, train x eval domain matrix, plots, drafter loading."""
