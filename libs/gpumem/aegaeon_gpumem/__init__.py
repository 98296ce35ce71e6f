"""aegaeon_gpumem."""
