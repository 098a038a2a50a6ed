"""Benchmarks that write results files (docs/design.md section 10)."""
