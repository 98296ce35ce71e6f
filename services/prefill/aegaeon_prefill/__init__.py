"""aegaeon_prefill."""
