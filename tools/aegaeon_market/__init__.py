"""aegaeon_market."""
