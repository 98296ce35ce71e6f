"""Liveness that means it: is an instance's compute thread making progress?

The event loop answers ``/health`` whatever the compute thread does, so a
wedged thread (a deadlock, a kernel that never returns, a collective whose
peer hung) used to look alive forever. The compute thread takes from its
inbox on every turn of its loop and between any two decode steps or prefills
(``Inbox.taken_s``). An instance is *stalled* once that has not happened for
``health.stall_s`` while it has work: requests queued or decoding, or
commands waiting. Waiting on the cachemgr (a model loading from disk into
the Model Cache) is not a stall: that call has its own timeout, and the
cachemgr its own health. Idle is not a stall either: with nothing to do the
thread may sleep in its inbox.

A stall is final for the process: the instance says so once
(``InstanceStalled``: the proxy marks it down and fails its requests over at
once), sends no more hellos, and its ``/health`` answers 503 until a
supervisor replaces it (``aegaeon serve``'s supervisor, Docker's health check
through ``aegaeon-container health``, Kubernetes' liveness probe).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class Progress:
    """What the event loop reads of the compute thread (all plain values)."""

    taken_s: float  # when it last took from its inbox (monotonic)
    calling_since_s: float | None  # waiting on the cachemgr since, or None
    queued: int  # requests queued for prefill or decoding (its published load)
    commands: int  # commands waiting in its inbox
    started: bool  # the thread serves (its start-up profile done)


@dataclass(frozen=True)
class Verdict:
    """Whether the compute thread is stalled, and what ``/health`` says of it."""

    stalled: bool
    since_progress_s: float
    has_work: bool
    reason: str = ""

    def body(self, stall_s: float, tid: int | None) -> dict[str, Any]:
        """``/health``'s ``compute_thread`` object."""
        return {"tid": tid, "since_progress_s": round(self.since_progress_s, 3),
                "has_work": self.has_work, "stall_s": stall_s,
                "stalled": self.stalled}  # fmt: skip


def judge(progress: Progress, now_s: float, stall_s: float) -> Verdict:
    """The verdict on ``progress`` at ``now_s`` (module docstring)."""
    has_work = progress.queued > 0 or progress.commands > 0
    if not progress.started or progress.calling_since_s is not None:
        return Verdict(False, 0.0, has_work)
    since = max(0.0, now_s - progress.taken_s)
    if not has_work or since < stall_s:
        return Verdict(False, since, has_work)
    reason = (f"compute thread made no progress for {since:.1f} s (health.stall_s "
              f"{stall_s:g}) with {progress.queued} request(s) and {progress.commands} "
              f"command(s) waiting")  # fmt: skip
    return Verdict(True, since, has_work, reason)
