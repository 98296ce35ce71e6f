"""Benchmarks of model switching: the switcher's rig, naive and vLLM starts, KV."""
