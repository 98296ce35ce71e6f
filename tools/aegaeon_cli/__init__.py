"""aegaeon_cli."""
