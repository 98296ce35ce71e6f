"""The engine benchmark: our engine against transformers, vLLM and llama.cpp; roofline,
agreement, KV density."""
