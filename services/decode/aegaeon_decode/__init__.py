"""aegaeon_decode."""
