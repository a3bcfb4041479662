"""Benchmarks: scripts that print figures and write them to docs/benchmarks.md."""
