"""Benchmarks of switching models: the switcher on one rig, naive and vLLM starts,
KV fragmentation, scale-up."""
