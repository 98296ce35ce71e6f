"""aegaeon_engine."""
