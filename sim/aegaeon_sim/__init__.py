"""Discrete-event simulator driving the same libs/sched policy objects as the services.

``aegaeon sim`` (see :mod:`aegaeon_sim.cli`) reproduces the paper's
end-to-end experiments on a simulated cluster: 16 H800 GPUs (Aegaeon: 6
prefill + 10 decode instances; the request-level and static baselines use all
16 as unified instances), a market of 6-14B models mixed 6:2:2 like
Qwen2.5-7B / Yi-1.5-9B / Llama-2-13B, Poisson arrivals per model and
ShareGPT-like lengths.

Nothing here makes a scheduling decision, and nothing here runs an instance:
every decision is taken by an ``aegaeon_sched`` policy (dispatchers, queues,
work lists, quota planner) through the action contract of
:mod:`aegaeon_sched.actions`, and every instance is its service's own compute
loop (``aegaeon_runtime``'s ``DecodeLoop``, ``PrefillLoop``) driven through
the runtime's ports on simulated time. The simulator only plays the proxy,
the engines (what runs takes the time the latency model says) and the clock.
Metrics come from :mod:`aegaeon_sched.slo`, as live.

Modules: ``hardware`` (H800 and model sizes -> Eq. 4-6 coefficients, with
sources), ``events`` (the event heap;
each instance's loop a greenlet on it), ``worker`` (the in-memory worker the
loops run on: engine, switcher, KV, host cache; also what the loops' unit
tests run them on), ``instances`` (an instance: its role's loop, its inbox),
``switching`` (switch prices), ``driver`` (the simulated proxy), ``runner``
(one experiment), ``figures``/``plots`` (sweeps and PNGs), ``node`` and
``replay`` (a live run, simulated), ``cli``/``cli_theorem`` and ``theorem``
(Theorem 3.1).
"""
