"""The engine against transformers, vLLM and llama.cpp; roofline, agreement, density."""
