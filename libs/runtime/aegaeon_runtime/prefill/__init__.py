"""Prefill on an instance: one job (:mod:`.job`) and the loop over its job queue
(:mod:`.loop`), run alone by a prefill instance and first by a hybrid one."""
