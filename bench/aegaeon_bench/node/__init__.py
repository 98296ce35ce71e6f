"""A served node as the benches reach it: start it, call it (one SSE reader), probe it."""
