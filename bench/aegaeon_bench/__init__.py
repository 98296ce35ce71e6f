"""aegaeon_bench."""
