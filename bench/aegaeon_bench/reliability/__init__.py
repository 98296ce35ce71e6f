"""Reliability of a served node: chaos, faults, fuzzing, slow clients, cancel, soak."""
