"""Benchmarks: each prints a table and writes JSON; each claim is a ratio to a baseline run in the same process."""
