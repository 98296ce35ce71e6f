"""aegaeon_cachemgr."""
