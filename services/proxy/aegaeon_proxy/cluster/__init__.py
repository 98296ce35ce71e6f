"""The distributed backend: policy-driven dispatch to prefill/decode instances."""
