"""structlog set-up: JSON lines when not on a TTY (containers), readable otherwise.

Every line of a process carries its ``service`` (and, in a worker, its
``instance``): fields bound with :func:`bind_process` reach every thread,
which context variables would not (a compute thread starts with an empty
context). A line about a request also names its ``request_id`` and ``model``.
Prompt text and API keys are never logged at info level or above.
"""

from __future__ import annotations

import logging
import sys
import threading
from collections.abc import MutableMapping
from typing import Any

import structlog

from aegaeon_common.env import read_env

_PROCESS_FIELDS: dict[str, Any] = {}


def bind_process(**fields: Any) -> None:
    """Add ``fields`` to every later log line of this process, from any thread."""
    _PROCESS_FIELDS.update(fields)


def _add_process_fields(
    _: Any, __: str, event: MutableMapping[str, Any]
) -> MutableMapping[str, Any]:
    for key, value in _PROCESS_FIELDS.items():
        event.setdefault(key, value)
    return event


class _StderrLogger:
    """structlog's print logger, to whatever ``sys.stderr`` is when a line is written,
    and never raising: a closed or broken stream loses the line, not the work that
    logged it (a load that logs its end must still end)."""

    _lock = threading.Lock()

    def msg(self, message: str) -> None:
        try:
            with self._lock:
                sys.stderr.write(message + "\n")
                sys.stderr.flush()
        except (OSError, ValueError):  # closed (a test's captured stream), or EPIPE
            pass

    log = debug = info = warn = warning = error = critical = exception = fatal = msg


def _stderr_logger(*_: Any) -> _StderrLogger:
    return _StderrLogger()


def setup_logging(service: str, level: str | None = None, json: bool | None = None) -> None:
    """Configure structlog and the stdlib root logger for one process."""
    env = read_env()
    level_name = (level or env.log_level).upper()
    as_json = json if json is not None else env.log_json
    if as_json is None:
        as_json = not sys.stderr.isatty()
    renderer: Any = (
        structlog.processors.JSONRenderer()
        if as_json
        else structlog.dev.ConsoleRenderer(colors=False)
    )
    shared: list[Any] = [
        structlog.contextvars.merge_contextvars,
        _add_process_fields,
        structlog.processors.add_log_level,
        structlog.processors.TimeStamper(fmt="iso", utc=True),
    ]
    structlog.configure(
        processors=[*shared, structlog.processors.format_exc_info, renderer],
        wrapper_class=structlog.make_filtering_bound_logger(
            logging.getLevelName(level_name) if level_name in logging._nameToLevel else 20
        ),
        logger_factory=_stderr_logger,
        cache_logger_on_first_use=True,
    )
    bind_process(service=service)
    # Lines of the stdlib's loggers (the engine's, libraries') in the same format
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(structlog.stdlib.ProcessorFormatter(
        foreign_pre_chain=[*shared, structlog.stdlib.add_logger_name],
        processors=[structlog.stdlib.ProcessorFormatter.remove_processors_meta,
                    structlog.processors.format_exc_info, renderer],
    ))  # fmt: skip
    root = logging.getLogger()
    root.handlers = [handler]
    root.setLevel(level_name if level_name in logging._nameToLevel else logging.INFO)


def get_logger(name: str | None = None) -> Any:
    return structlog.get_logger(name)
