"""structlog set-up: JSON lines when not on a TTY (containers), readable otherwise."""

from __future__ import annotations

import logging
import sys
from typing import Any

import structlog

from aegaeon_common.env import read_env


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
    structlog.configure(
        processors=[
            structlog.contextvars.merge_contextvars,
            structlog.processors.add_log_level,
            structlog.processors.TimeStamper(fmt="iso", utc=True),
            structlog.processors.format_exc_info,
            renderer,
        ],
        wrapper_class=structlog.make_filtering_bound_logger(
            logging.getLevelName(level_name) if level_name in logging._nameToLevel else 20
        ),
        logger_factory=structlog.PrintLoggerFactory(file=sys.stderr),
        cache_logger_on_first_use=True,
    )
    structlog.contextvars.bind_contextvars(service=service)
    logging.basicConfig(level=level_name, stream=sys.stderr, format="%(name)s %(message)s")


def get_logger(name: str | None = None) -> Any:
    return structlog.get_logger(name)
