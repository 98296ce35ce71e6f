"""aegaeon_common."""
