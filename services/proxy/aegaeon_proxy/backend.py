"""The contract between the HTTP front and whatever produces tokens.

The front (``aegaeon_proxy.app``) owns everything a client sees: validation,
chat templates, tokenizing, detokenizing, stop strings, SSE, usage. A backend
only turns a :class:`GenerationRequest` (token ids in) into a
:class:`TokenStream` (token ids out). The product's drives instances over ZeroMQ
(``cluster.backend``: Algorithms 1-2, or a request-level baseline, over the
store); the proxy's unit tests drive the front with a scripted one.

Stream contract:

* ``submit`` returns at once (it never waits for the model); it raises
  :class:`BackendError` when the request cannot be accepted.
* The stream yields :class:`TokenChunk` objects in generation order (per
  sequence: a request of ``sampling.n`` sequences interleaves them, each chunk
  naming its ``index``). Every sampled token is delivered, including a final
  stop token (EOS or one of ``stop_token_ids``). A sequence's last chunk has
  ``seq_finish``; exactly one chunk, the last of the stream, has
  ``finish_reason`` set (its ``token_ids`` may be empty); iteration ends after
  it. Log-probabilities ride with their tokens when the request asked for them
  (``sampling.logprobs``), the prompt's with the first token
  (``sampling.prompt_logprobs``).
* ``cancel(request_id)`` frees the request's resources; the stream then ends
  with ``finish_reason="cancelled"`` unless it had already finished. Cancelling
  an unknown or finished request is a no-op. The front stops reading a stream
  once it has cancelled it.
* The finishing chunk of a request that completed may carry ``timings``: where
  its time went as the instances measured it (the vLLM-compatible queue and
  prefill times, :mod:`aegaeon_proxy.vllm_metrics`).
"""

from __future__ import annotations

import asyncio
from abc import ABC, abstractmethod
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from typing import Any, ClassVar, Literal, Protocol

from aegaeon_common.config import ModelConfig, ModelSettings
from aegaeon_common.http_side import ServiceAddress
from aegaeon_common.messages.structs import RequestTimings, SamplingParams, TokenLogprobs
from prometheus_client import CollectorRegistry

FinishReason = Literal["stop", "length", "cancelled", "error"]

__all__ = [
    "FAULT_CODES",
    "FAULT_RETRY_AFTER_S",
    "INSTANCE_FAILED",
    "NOT_SUPPORTED",
    "STORE_UNAVAILABLE",
    "Backend",
    "BackendError",
    "EngineSnapshot",
    "FinishReason",
    "GenerationRequest",
    "ModelOps",
    "TokenChunk",
    "TokenQueue",
    "TokenStream",
]


@dataclass(frozen=True)
class GenerationRequest:
    """One request as a backend sees it: a model name and prompt token ids."""

    request_id: str
    model: str  # a name in Config.models
    prompt_token_ids: tuple[int, ...]
    # how to sample, validated by the front: the wire's spec as the instances get it
    # (``stop_token_ids`` holds the model's EOS ids unless ``ignore_eos``: a backend
    # stops on any of them and never needs to know the model's EOS itself)
    sampling: SamplingParams
    arrival_s: float  # time.time() when the front accepted the request (wall clock, seconds)
    # Its SLO class (aegaeon_proxy.slo_classes): the scheduler's rank (0 interactive,
    # 1 standard, 2 batch) and its own targets (None: the deployment's).
    priority: int = 1
    ttft_s: float | None = None
    tbt_s: float | None = None
    slo_class: str = "standard"
    # a LoRA adapter's base (the weights it runs on; "": the model itself)
    unit: str = ""


# A request ended by a fault, not by its own doing (``TokenChunk.code``): the front
# answers 503 with Retry-After (an instance restarts, a store comes back, in seconds).
INSTANCE_FAILED = "instance_failed"
STORE_UNAVAILABLE = "store_unavailable"
FAULT_CODES = (INSTANCE_FAILED, STORE_UNAVAILABLE)
FAULT_RETRY_AFTER_S = 1.0
# The code of an optional operation the backend does not offer (answered 501).
NOT_SUPPORTED = "not_supported"


@dataclass(frozen=True)
class TokenChunk:
    """Newly generated token ids of sequence ``index``; the last chunk of a stream has
    ``finish_reason``, the last of each sequence ``seq_finish`` (with one sequence, the
    same chunk)."""

    token_ids: tuple[int, ...]
    finish_reason: FinishReason | None = None
    error: str | None = None  # why, when finish_reason == "error"
    # what kind of failure (finish_reason "error"): one of FAULT_CODES (the instance
    # holding it died or restarted, the shared store failed: retrying may succeed),
    # else a backend error
    code: str | None = None
    # with the finishing chunk, when known: where the request's time went
    timings: RequestTimings | None = None
    index: int = 0  # which of the request's n sequences
    seq_finish: str | None = None  # this sequence ended ("stop" or "length")
    logprobs: tuple[TokenLogprobs, ...] = ()  # one per token, when the request asked
    prompt_logprobs: tuple[TokenLogprobs, ...] | None = None  # with the first token


class TokenStream(Protocol):
    """A request's chunks, in order; ``ready()``: the next one is there (no wait)."""

    def __aiter__(self) -> AsyncIterator[TokenChunk]: ...
    async def __anext__(self) -> TokenChunk: ...
    def ready(self) -> bool: ...
    async def admitted(self) -> None:
        """Return once the backend admitted the request (it may hold it for room
        first); raise :class:`BackendError` if it refused it after all."""


class BackendError(Exception):
    """A request the backend cannot take now.

    ``status`` is the HTTP status the front answers with: 429 (overloaded) or 503
    (unavailable: an instance kind, the store or a cachemgr is down or restarting),
    each with ``Retry-After: retry_after_s``, 409 (a request id already in
    flight) or 501 (an optional operation it does not offer); ``code`` the error's
    code (``overloaded``, ``unavailable``, ``store_unavailable``,
    ``duplicate_request_id``, ``not_supported``).
    """

    def __init__(self, message: str, *, status: int = 503, retry_after_s: float | None = None,
                 code: str | None = None):  # fmt: skip
        super().__init__(message)
        self.message = message
        self.status = status
        self.retry_after_s = retry_after_s
        self.code = code or ("overloaded" if status == 429 else "unavailable")

    @classmethod
    def overloaded(cls, message: str, retry_after_s: float = 1.0) -> BackendError:
        return cls(message, status=429, retry_after_s=retry_after_s)

    @classmethod
    def unavailable(cls, message: str, retry_after_s: float = FAULT_RETRY_AFTER_S,
                    code: str | None = None) -> BackendError:  # fmt: skip
        return cls(message, status=503, retry_after_s=retry_after_s, code=code)

    @classmethod
    def store_failed(cls, why: object) -> BackendError:
        """The shared store cannot be reached (or failed an operation): 503, retry
        shortly (a store that restarts is back within seconds)."""
        return cls.unavailable(f"the shared store failed: {why}", code=STORE_UNAVAILABLE)


@dataclass(frozen=True)
class EngineSnapshot:
    """What the instances hold now, as the vLLM-compatible gauges report it.

    ``device_kv_*``: the device KV regions of the instances that decode (their
    last heartbeats); ``host_kv_*``: the unified CPU KV cache (``None``: not
    known to this backend).
    """

    device_kv_used_bytes: int = 0
    device_kv_capacity_bytes: int = 0
    host_kv_used_bytes: int | None = None
    host_kv_capacity_bytes: int | None = None


class Backend(ABC):
    """What the HTTP front needs from whatever generates tokens: the abstract methods,
    the read-outs a backend offers by overriding them (default None), and its model
    operations (:attr:`models`). Failures are :class:`BackendError`\\ s whose
    ``status`` and ``code`` the endpoints answer with."""

    def __init__(self, models: ModelOps | None = None) -> None:
        self.models = models or ModelOps()  # (the default offers none)

    @abstractmethod
    async def start(self) -> None:
        """Begin serving (connect, spawn threads); ``ready()`` may still be False after."""

    @abstractmethod
    async def stop(self) -> None:
        """Cancel every open request (their streams end) and release resources."""

    @abstractmethod
    def ready(self) -> bool:
        """True when every configured instance is up and requests can be served."""

    @abstractmethod
    def health(self) -> dict[str, object]:
        """A JSON-able description of the backend's state for ``GET /health``."""

    @abstractmethod
    def register_metrics(self, registry: CollectorRegistry) -> None:
        """Add the backend's own metrics (collectors that only read) to the proxy's
        registry; called once, before ``start``."""

    @abstractmethod
    def submit(self, req: GenerationRequest) -> TokenStream:
        """Accept a request and return its token stream; raises :class:`BackendError`."""

    @abstractmethod
    async def cancel(self, request_id: str) -> None:
        """Stop a request and free its resources; a no-op if unknown or finished."""

    # ---- what it reports ---------------------------------------------------------
    async def engine_snapshot(self) -> EngineSnapshot | None:
        """What the instances hold now, for ``/metrics`` (None: not known, the KV gauges
        are left out); called once per scrape, never raises."""
        return None

    def context_limit(self, model: str) -> int | None:
        """The most tokens of KV one request of ``model`` can hold (None: its window)."""
        return None

    async def stats(self, light: bool = False) -> dict[str, object] | None:
        """The detailed counters of ``GET /v1/aegaeon/stats`` (``light``: no record
        lists; None: it keeps none, 404)."""
        return None

    def services(self) -> list[ServiceAddress] | None:
        """Every node's cachemgr and instances, as they registered (None: the ones in
        the proxy's run directory)."""
        return None


class ModelOps:
    """A backend's operations on its models (``Backend.models``), each offered by
    overriding it (the front calls them all): a default model change, reload or sleep
    raises 501 ``not_supported``, a default read-out is None, what replicas share
    stays on this one."""

    # it adds and removes models at run time (its add_model, forget_model): else the
    # admin API refuses an add or a removal before doing any of it
    changes_models: ClassVar[bool] = False

    async def add_model(self, model: ModelConfig) -> None:
        """Serve ``model`` on every instance (cachemgr and instances told); returns
        once every live instance serves it."""
        raise _not_supported("change its models at run time")

    async def forget_model(self, name: str) -> bool:
        """Stop serving ``name`` (its requests have ended): the Model Cache frees its
        bytes; True when it is out of the cache now."""
        raise _not_supported("change its models at run time")

    async def set_model_flags(self, name: str, *, pinned: bool, preload: bool) -> None:
        """The operator's pin (never evicted) and a preload (load it now) of ``name``,
        on every node."""
        raise _not_supported("change its models' flags")

    async def model_cache(self) -> dict[str, Any] | None:
        """The Model Cache's stats (``ModelCacheStats`` as plain data; None if the
        cachemgr did not answer, or there is none)."""
        return None

    # ---- sleep and wake: a sleeping model's weights stay in the host Model Cache
    async def set_model_awake(self, name: str, awake: bool) -> bool:
        """Sleep ``name`` (off every device) or wake it (onto one); returns once the
        instances answered, whether it sleeps now (a device with work of it keeps it)."""
        raise _not_supported("put models to sleep")

    def model_sleeping(self, name: str) -> bool:
        """``name`` is on no device, as the instances last reported."""
        raise _not_supported("put models to sleep")

    # ---- checkpoints that cannot be read: unavailable everywhere until reloaded
    _on_unavailable: Callable[[str, str | None], None] | None = None

    def follow_unavailable(self, apply: Callable[[str, str | None], None]) -> None:
        """Call ``apply(name, why)`` whenever a model is found unreadable (``why`` names
        the file and what is wrong), ``apply(name, None)`` once it is read again (also
        at once for what is known already)."""
        self._on_unavailable = apply

    async def quarantine_model(self, name: str, why: str | None) -> None:
        """Make ``name`` unavailable everywhere (``why``), or no longer (None: it is
        gone, or read again); by default on this replica alone."""
        if self._on_unavailable is not None:
            self._on_unavailable(name, why)

    async def reload_model(self, model: ModelConfig) -> None:
        """Read ``model``'s checkpoint again on every node (its quarantine lifted there),
        have every instance serve it, and make it available everywhere; a
        :class:`BackendError` (422 ``model_unavailable``, naming what is wrong now) when
        it still cannot be read: it stays unavailable."""
        raise _not_supported("read its models again")

    # ---- what proxy replicas share (by default one replica: nothing to tell or follow);
    # a follower is called for every replica's change, this one's included, and at start
    # for the changes made before it
    async def publish_model_settings(self, name: str, settings: ModelSettings) -> None:
        """``name``'s settings as this replica just changed them, for every replica."""
        return None

    def follow_model_settings(self, apply: Callable[[str, ModelSettings], None]) -> None:
        """Call ``apply(name, settings)`` whenever a replica changed a model's settings."""
        return None

    async def publish_served(self, name: str, model: ModelConfig | None) -> None:
        """``name`` is served now (``model``: added) or no longer (None), for every replica."""
        return None

    def follow_served(self, apply: Callable[[str, ModelConfig | None], None]) -> None:
        """Call ``apply(name, model)`` whenever a replica added or removed (None) a model."""
        return None


def _not_supported(what: str) -> BackendError:
    return BackendError(f"this backend cannot {what}", status=501, code=NOT_SUPPORTED)


class TokenQueue:
    """A :data:`TokenStream` fed by a producer: ``push`` chunks, iterate on the loop.

    ``push`` must be called on the event loop's thread. Chunks pushed after the finishing chunk are
    dropped, so a late token after a cancel cannot confuse the reader.
    """

    def __init__(self, loop: asyncio.AbstractEventLoop | None = None) -> None:
        self._loop = loop or asyncio.get_running_loop()
        self._queue: asyncio.Queue[TokenChunk] = asyncio.Queue()
        self._closed = False  # a finishing chunk was pushed
        self._done = False  # the finishing chunk was read
        self._held: asyncio.Future[None] | None = None  # waiting for room (admission)
        self._refused: BackendError | None = None

    @property
    def finished(self) -> bool:
        return self._closed

    def push(self, chunk: TokenChunk) -> None:
        if self._closed:
            return
        if chunk.finish_reason is not None:
            self._closed = True
            self.admit()  # ended while it waited (cancelled, failed): read how
        self._queue.put_nowait(chunk)

    def hold(self) -> None:
        """The backend holds the request until there is room for it (admission): the
        front answers once it is admitted (:meth:`admit`) or refused (:meth:`refuse`)."""
        self._held = self._loop.create_future()

    def admit(self) -> None:
        if self._held is not None and not self._held.done():
            self._held.set_result(None)

    def refuse(self, error: BackendError) -> None:
        """Its wait ended without room: :meth:`admitted` raises ``error`` (a 429)."""
        self._refused = error
        self._closed = True
        self.admit()

    async def admitted(self) -> None:
        """Return once the request was admitted (at once unless held); raise the
        :class:`BackendError` it was refused with."""
        if self._held is not None:
            await asyncio.shield(self._held)
        if self._refused is not None:
            raise self._refused

    def ready(self) -> bool:
        """A chunk can be read without waiting."""
        return not self._queue.empty()

    def finish(self, reason: FinishReason, error: str | None = None,
               code: str | None = None) -> None:  # fmt: skip
        self.push(TokenChunk((), reason, error, code))

    def __aiter__(self) -> TokenQueue:
        return self

    async def __anext__(self) -> TokenChunk:
        if self._done:
            raise StopAsyncIteration
        chunk = await self._queue.get()
        if chunk.finish_reason is not None:
            self._done = True
        return chunk
