"""The start-up profile's latency model predicts a served decode step (profile.py).

A real worker (a cachemgr process and the worker over it, as the switch bench
builds them) runs the start-up profile, and then a decode step of a batch the
profile never measured (six sequences of mixed lengths), timed as a turn times
it (the engine's step and the sampler). The fitted Eq. 6 must predict that step
within 20%. Both sides are medians of several steps of a few milliseconds each.

It runs ``alone`` (tests/worker_groups.py): with the other pytest worker busy, three or
more processes share the two cores, and a step is preempted or not by chance, so the
medians of a profile and of the served step disagree by 25-60% (seen on a 2-core AMD
EPYC with two busy loops beside it; -5 to -7% on the same machine quiet). Outside load
is left, and the whole measurement is retried (six attempts in all) before the test
fails: a miss is followed by a pause, longer each time (2, 4, 8, 16, 32 s), so that the
attempts are spread over a minute.
"""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest
from aegaeon_bench.switch.rig import rig_sizes, switch_rig
from aegaeon_engine import DecodeSeq
from aegaeon_runtime.profile import median_s, profile, served_step_s

MODEL = "mistral-11m"
SERVED = [20, 45, 90, 130, 210, 300]  # a batch's contexts, none of the profile's
ATTEMPTS = 6
TOLERANCE = 0.2

pytestmark = pytest.mark.alone


def test_profile_predicts_a_served_step_of_mixed_lengths(default_market: Path) -> None:
    path = default_market / MODEL
    nbytes = json.loads((default_market / "market.json").read_text())
    assert any(m["name"] == MODEL for m in nbytes["models"])
    with switch_rig({MODEL: path}, "bfloat16", rig_sizes([64 << 20], 32 << 20)) as rig:
        worker = rig.worker
        errors = []
        for _ in range(ATTEMPTS):
            latency = profile(worker, [MODEL])
            shape = worker.kv_shape(MODEL)
            per_seq = [shape.blocks_for(c + 1) for c in SERVED]
            blocks = worker.kv.alloc(shape, sum(per_seq))
            try:
                starts = [sum(per_seq[:i]) for i in range(len(SERVED))]
                seqs = [DecodeSeq(7, c, blocks[s:s + n])
                        for c, n, s in zip(SERVED, per_seq, starts, strict=True)]
                served_step_s(worker, seqs)
                measured = median_s(lambda seqs=seqs: served_step_s(worker, seqs), 15)
            finally:
                worker.kv.free(shape, blocks)
            predicted = latency.decode_step_s(MODEL, len(SERVED), sum(c + 1 for c in SERVED))
            errors.append(abs(predicted - measured) / measured)
            if errors[-1] <= TOLERANCE:
                break
            if len(errors) < ATTEMPTS:
                time.sleep(2.0 ** len(errors))  # spread the attempts (see the module)
        assert min(errors) <= TOLERANCE, f"relative errors per attempt: {errors}"
