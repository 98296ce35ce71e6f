"""Benchmarks of a served node: open-loop load (`bench serve`), sweeps, overload,
other clients, many nodes, Prometheus."""
