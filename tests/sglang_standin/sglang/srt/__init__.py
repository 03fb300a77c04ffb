"""Stand-in package (see tests/sglang_standin/README.md)."""
