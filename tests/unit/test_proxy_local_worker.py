"""The local backend's worker: FCFS admission, model switching, cancels, failures.

The engine is replaced by a stepper double that emits token ``i`` at step ``i``
for every request, so the scheduling can be checked without torch.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator

import pytest
from aegaeon_common.config import ModelConfig
from aegaeon_proxy.backend import GenerationRequest, SamplingParams, TokenChunk
from aegaeon_proxy.local_stepper import StepEvent
from aegaeon_proxy.local_worker import Cancel, LocalWorker, Shutdown, Submit

ENDLESS = 100
MODELS = {name: ModelConfig(name, f"/nonexistent/{name}") for name in ("a", "b", "broken")}  # type: ignore[arg-type]


class StepperDouble:
    """Admits up to ``capacity`` requests; each emits max_tokens tokens then 'length'.

    Requests with ``max_tokens >= ENDLESS`` run until aborted.
    """

    capacity = 2

    def __init__(self, model: ModelConfig, log: list[str]) -> None:
        if model.name == "broken":
            raise OSError("no such checkpoint")
        self.model = model.name
        self._log = log
        self._left: dict[str, int] = {}
        log.append(f"load {model.name}")

    @property
    def num_running(self) -> int:
        return len(self._left)

    def fits_ever(self, prompt_len: int, sampling: SamplingParams) -> bool:
        return sampling.max_tokens < 1000

    def try_admit(
        self, rid: str, prompt: tuple[int, ...], sampling: SamplingParams
    ) -> StepEvent | None:
        if len(self._left) >= self.capacity:
            return None
        self._log.append(f"admit {rid}")
        if sampling.max_tokens == 1:
            return StepEvent(rid, 0, "length")
        self._left[rid] = sampling.max_tokens - 1
        return StepEvent(rid, 0, None)

    def step(self) -> list[StepEvent]:
        time.sleep(0.001)
        events = []
        for rid in list(self._left):
            if self._left[rid] >= ENDLESS:
                events.append(StepEvent(rid, 1, None))
                continue
            self._left[rid] -= 1
            done = self._left[rid] == 0
            events.append(StepEvent(rid, 1, "length" if done else None))
            if done:
                del self._left[rid]
        return events

    def abort(self, rid: str) -> bool:
        return self._left.pop(rid, None) is not None

    def abort_all(self) -> list[str]:
        ids = list(self._left)
        self._left.clear()
        return ids


def _req(rid: str, model: str, max_tokens: int = 3) -> GenerationRequest:
    return GenerationRequest(rid, model, (1, 2), SamplingParams(max_tokens=max_tokens), 0.0)


class Harness:
    def __init__(self) -> None:
        self.log: list[str] = []
        self.chunks: dict[str, list[TokenChunk]] = {}
        self.done = threading.Condition()
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.worker = LocalWorker(MODELS, lambda m: StepperDouble(m, self.log), self._deliver)  # type: ignore[arg-type,return-value]

    def _run(self) -> None:
        self.worker.run()

    def _deliver(self, rid: str, chunk: TokenChunk) -> None:
        with self.done:
            self.chunks.setdefault(rid, []).append(chunk)
            self.done.notify_all()

    def start(self, *cmds: Submit | Cancel) -> None:
        """Queue commands, then start the worker thread (so the first drain sees them all)."""
        for cmd in cmds:
            self.worker.inbox.put(cmd)
        self.thread.start()

    def finish(self, rid: str) -> TokenChunk:
        with self.done:
            ok = self.done.wait_for(
                lambda: any(c.finish_reason for c in self.chunks.get(rid, [])), timeout=5
            )
        assert ok, f"{rid} never finished"
        return self.chunks[rid][-1]


@pytest.fixture
def harness() -> Iterator[Harness]:
    h = Harness()
    yield h
    h.worker.inbox.put(Shutdown())
    if h.thread.is_alive():
        h.thread.join(5)
    assert not h.thread.is_alive()


def test_switch_waits_for_the_running_batch(harness: Harness) -> None:
    harness.start(Submit(_req("a1", "a")), Submit(_req("a2", "a")), Submit(_req("b1", "b")),
                  Submit(_req("a3", "a")))  # fmt: skip
    for rid in ("a1", "a2", "b1", "a3"):
        assert harness.finish(rid).finish_reason == "length"
        assert [c.token_ids for c in harness.chunks[rid]] == [(0,), (1,), (1,)]
    # a1 and a2 batch together; a3 came after b1, so FCFS serves b1 before switching back
    assert harness.log == ["load a", "admit a1", "admit a2", "load b", "admit b1", "load a",
                           "admit a3"]  # fmt: skip
    assert harness.worker.stats.num_switches == 3


def test_batch_capacity_defers_admission(harness: Harness) -> None:
    harness.start(*(Submit(_req(f"r{i}", "a", max_tokens=2 + i)) for i in range(4)))
    for i in range(4):
        assert harness.finish(f"r{i}").finish_reason == "length"
    assert harness.log == ["load a", "admit r0", "admit r1", "admit r2", "admit r3"]


def test_cancel_waiting_and_running(harness: Harness) -> None:
    harness.start(Submit(_req("run1", "a", ENDLESS)), Submit(_req("run2", "a", ENDLESS)),
                  Submit(_req("wait", "a", 2)), Submit(_req("huge", "a", 1000)))  # fmt: skip
    harness.worker.inbox.put(Cancel("wait"))  # behind a full batch: still waiting
    harness.worker.inbox.put(Cancel("run1"))
    harness.worker.inbox.put(Cancel("nobody"))  # unknown: ignored
    assert harness.finish("wait").finish_reason == "cancelled"
    assert harness.finish("run1").finish_reason == "cancelled"
    harness.worker.inbox.put(Cancel("run2"))
    assert harness.finish("run2").finish_reason == "cancelled"
    huge = harness.finish("huge")  # admitted once the batch had room, and never fits
    assert huge.finish_reason == "error"
    assert "wait" not in [line.split()[-1] for line in harness.log]


def test_load_failure_fails_only_that_models_requests(harness: Harness) -> None:
    harness.start(Submit(_req("x", "broken")), Submit(_req("ok", "a", max_tokens=1)))
    failed = harness.finish("x")
    assert failed.finish_reason == "error"
    assert failed.error is not None and "no such checkpoint" in failed.error
    assert harness.finish("ok").finish_reason == "length"


def test_shutdown_cancels_everything(harness: Harness) -> None:
    harness.start(Submit(_req("a1", "a", ENDLESS)), Submit(_req("b1", "b")))
    while "admit a1" not in harness.log:
        time.sleep(0.001)
    harness.worker.inbox.put(Shutdown())
    assert harness.finish("a1").finish_reason == "cancelled"
    assert harness.finish("b1").finish_reason == "cancelled"
