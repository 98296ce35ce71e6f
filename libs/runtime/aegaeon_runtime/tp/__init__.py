"""Tensor-parallel instances: a group of ``tp`` devices serving as one instance.

Rank 0 is the instance's own process (its loops, scheduler and sockets as
ever); ranks 1.. are follower processes it starts (``follower``), one per
device, which run what rank 0's engine and switcher do on their shards
(``aegaeon_engine.tp_mirror``). See ``group`` for the whole picture.
"""
