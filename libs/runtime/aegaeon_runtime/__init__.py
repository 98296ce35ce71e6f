"""aegaeon_runtime."""
