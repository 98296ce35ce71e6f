"""aegaeon_proxy."""
