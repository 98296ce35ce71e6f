"""aegaeon_sched."""
