"""A served node as the benchmarks reach it: start it, call it (one SSE reader), probe
its processes."""
