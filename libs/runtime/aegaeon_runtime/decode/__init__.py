"""A decode instance's machinery (Algorithm 2: rounds, turns, admission, KV residency,
token emission): shared worker code, run by the decode service and by a prefill instance
that decodes when it has no prefill work (``scheduler.prefill_decodes_when_idle``)."""
