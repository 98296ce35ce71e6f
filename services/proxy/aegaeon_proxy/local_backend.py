"""A real in-process backend: the engine's driver on a worker thread.

For development (``aegaeon serve --local``) and tests. One model is loaded at
a time; requests for another model make the worker switch (request-level
FCFS, see :mod:`aegaeon_proxy.local_worker`). Tokens stream per prefill and
decode step. The event loop never runs the engine: it only enqueues commands
and receives chunks through ``call_soon_threadsafe``.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Iterator

from aegaeon_common.config import Config, ModelConfig
from prometheus_client import CollectorRegistry, Counter
from prometheus_client.core import GaugeMetricFamily
from prometheus_client.registry import Collector

from aegaeon_proxy.backend import (
    BackendError,
    GenerationRequest,
    TokenChunk,
    TokenQueue,
    TokenStream,
)
from aegaeon_proxy.local_stepper import EngineStepper
from aegaeon_proxy.local_worker import Cancel, LocalWorker, Shutdown, Submit

RETRY_AFTER_S = 1.0

__all__ = ["LocalEngineBackend"]


class LocalEngineBackend:
    """:class:`~aegaeon_proxy.backend.Backend` over ``aegaeon_engine.LLM`` on one thread.

    Sizes default to the config: KV cache ``decode.kv_memory_bytes``, batch
    ``scheduler.max_batch_size``, torch threads ``decode.threads``, dtype
    ``config.dtype``. At most ``proxy.max_queued_requests`` requests are open
    (waiting or running) at once; beyond that ``submit`` answers 429.
    """

    def __init__(
        self,
        config: Config,
        *,
        kv_cache_bytes: int | None = None,
        max_num_seqs: int | None = None,
        num_threads: int | None = None,
        dtype: str | None = None,
    ) -> None:
        self._config = config
        self._kv_cache_bytes = kv_cache_bytes or config.decode.kv_memory_bytes
        self._max_num_seqs = max_num_seqs or config.scheduler.max_batch_size
        self._num_threads = num_threads or config.decode.threads
        self._dtype = dtype or config.dtype
        self._max_open = config.proxy.max_queued_requests
        self._worker = LocalWorker(
            {m.name: m for m in config.models}, self._make_stepper, self._deliver
        )
        self._thread: threading.Thread | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._open: dict[str, TokenQueue] = {}
        self._submitted: Counter | None = None
        self._rejected: Counter | None = None

    def _make_stepper(self, model: ModelConfig) -> EngineStepper:
        return EngineStepper(
            model,
            dtype=self._dtype,
            kv_cache_bytes=self._kv_cache_bytes,
            max_num_seqs=self._max_num_seqs,
            num_threads=self._num_threads,
        )

    # -- lifecycle ---------------------------------------------------------------------------

    async def start(self) -> None:
        self._loop = asyncio.get_running_loop()
        self._thread = threading.Thread(
            target=self._worker.run, name="aegaeon-local-engine", daemon=True
        )
        self._thread.start()

    async def stop(self) -> None:
        thread, self._thread = self._thread, None
        if thread is None:
            return
        self._worker.inbox.put(Shutdown())
        await asyncio.to_thread(thread.join)
        await asyncio.sleep(0)  # let the worker's last deliveries run
        for queue in self._open.values():
            queue.finish("cancelled")
        self._open.clear()

    def ready(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    def health(self) -> dict[str, object]:
        stats = self._worker.stats
        return {
            "kind": "local",
            "alive": self.ready(),
            "loaded_model": stats.loaded_model,
            "open_requests": len(self._open),
            "waiting": stats.num_waiting,
            "running": stats.num_running,
            "model_switches": stats.num_switches,
        }

    def register_metrics(self, registry: CollectorRegistry) -> None:
        self._submitted = Counter(
            "aegaeon_local_submitted", "Requests accepted", registry=registry
        )
        self._rejected = Counter(
            "aegaeon_local_rejected", "Requests refused (overload)", registry=registry
        )
        registry.register(_LocalCollector(self))

    # -- requests ----------------------------------------------------------------------------

    def submit(self, req: GenerationRequest) -> TokenStream:
        if self._loop is None or not self.ready():
            raise BackendError.unavailable("the local engine is not running")
        if self._config.model(req.model) is None:
            raise BackendError.unavailable(f"model {req.model!r} is not served here")
        if len(self._open) >= self._max_open:
            if self._rejected is not None:
                self._rejected.inc()
            raise BackendError.overloaded(
                f"{len(self._open)} requests are open (max {self._max_open})", RETRY_AFTER_S
            )
        queue = TokenQueue(self._loop)
        self._open[req.request_id] = queue
        if self._submitted is not None:
            self._submitted.inc()
        self._worker.inbox.put(Submit(req))
        return queue

    async def cancel(self, request_id: str) -> None:
        if request_id in self._open:
            self._worker.inbox.put(Cancel(request_id))

    def _deliver(self, request_id: str, chunk: TokenChunk) -> None:
        """Called on the worker thread."""
        assert self._loop is not None
        self._loop.call_soon_threadsafe(self._on_chunk, request_id, chunk)

    def _on_chunk(self, request_id: str, chunk: TokenChunk) -> None:
        queue = self._open.get(request_id)
        if queue is None:
            return
        queue.push(chunk)
        if chunk.finish_reason is not None:
            del self._open[request_id]


class _LocalCollector(Collector):
    """The local engine's state at scrape time (reads only)."""

    def __init__(self, backend: LocalEngineBackend) -> None:
        self._backend = backend

    def collect(self) -> Iterator[GaugeMetricFamily]:
        b = self._backend
        stats = b._worker.stats
        gauges = [
            ("aegaeon_local_open_requests", "Requests waiting or running", len(b._open)),
            ("aegaeon_local_waiting_requests", "Requests waiting for admission",
             stats.num_waiting),
            ("aegaeon_local_running_requests", "Requests in the running batch", stats.num_running),
            ("aegaeon_local_model_switches", "Models loaded since start", stats.num_switches),
            ("aegaeon_local_steps", "Decode steps since start", stats.num_steps),
        ]  # fmt: skip
        for name, help_text, value in gauges:
            yield GaugeMetricFamily(name, help_text, value=float(value))
