"""Benchmarks that write results files (DESIGN.md section 10)."""
