"""Reliability checks of a served node: chaos, injected faults, fuzzing, slow clients,
cancellation, soak."""
