"""Discrete-event simulator driving the same libs/sched policy objects as the services.

``aegaeon sim`` (see :mod:`aegaeon_sim.cli`) reproduces the paper's
end-to-end experiments on a simulated cluster: 16 H800 GPUs (Aegaeon: 6
prefill + 10 decode instances; the request-level and static baselines use all
16 as unified instances), a market of 6-14B models mixed 6:2:2 like
Qwen2.5-7B / Yi-1.5-9B / Llama-2-13B, Poisson arrivals per model and
ShareGPT-like lengths.

Nothing here makes a scheduling decision: every decision is taken by an
``aegaeon_sched`` policy (dispatchers, queues, work lists, quota planner)
through the action contract of :mod:`aegaeon_sched.actions`; the simulator
only plays the instances (what runs takes the time the latency model says)
and the clock. Metrics come from :mod:`aegaeon_sched.slo`, as live.

Modules: ``hardware`` (H800 and model sizes -> Eq. 4-6 coefficients, with
sources), ``workload`` (arrivals and lengths), ``state`` (per-request state,
chunked token times), ``prefill_sim`` and ``aegaeon_sim`` (Aegaeon's prefill
and decode instances, prefetch model), ``hybrid_sim`` (a prefill instance
that decodes when idle), ``unified_sim`` (baseline instances),
``driver`` (the event loop), ``runner`` (one experiment), ``figures``/``plots``
(sweeps and PNGs), ``cli``/``cli_theorem`` and ``theorem`` (Theorem 3.1).
"""
