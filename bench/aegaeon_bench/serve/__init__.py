"""Benchmarks of a served node: load, sweeps, overload, other clients, many nodes."""
