"""Every log line of a process is one JSON object in containers, the stdlib's loggers' too."""

from __future__ import annotations

import json
import subprocess
import sys

SCRIPT = """
import logging
from aegaeon_common.logs import bind_process, get_logger, setup_logging
setup_logging("decode-0", json=True)
bind_process(instance="decode-0")
logging.getLogger("aegaeon_engine.engine").info("engine on %s, kernels %s", "cpu", "avx2")
get_logger("x").info("switch", from_model="a", to_model="b")
try:
    1 / 0
except ZeroDivisionError:
    logging.getLogger("lib").exception("failed")
"""


def test_structlog_and_stdlib_lines_are_json_with_the_process_fields() -> None:
    out = subprocess.run([sys.executable, "-c", SCRIPT], capture_output=True, text=True,
                         timeout=60, check=True)  # fmt: skip
    lines = [json.loads(line) for line in out.stderr.splitlines()]
    assert [line["event"] for line in lines] == ["engine on cpu, kernels avx2", "switch", "failed"]
    for line in lines:
        assert line["service"] == "decode-0" and line["instance"] == "decode-0"
        assert {"level", "timestamp"} <= set(line)
    assert lines[0]["logger"] == "aegaeon_engine.engine"
    assert lines[1]["to_model"] == "b"
    assert "ZeroDivisionError" in lines[2]["exception"]


def test_a_closed_stderr_loses_the_line_not_the_work() -> None:
    """A line logged after the stream it would go to was closed (a test's captured
    stderr, a closed pipe) is lost; the code that logged it goes on."""
    import io
    import logging

    import structlog
    from aegaeon_common.logs import get_logger, setup_logging

    config, handlers, saved = structlog.get_config(), logging.getLogger().handlers[:], sys.stderr
    closed, live = io.StringIO(), io.StringIO()
    closed.close()
    try:
        setup_logging("t", json=True)
        sys.stderr = closed
        get_logger("x").info("model_loaded", model="m")  # no ValueError
        sys.stderr = live
        get_logger("x").info("after", model="m")  # to the stream in place now
    finally:  # this process's logging as it was
        sys.stderr = saved
        structlog.configure(**config)
        logging.getLogger().handlers = handlers
    assert json.loads(live.getvalue())["event"] == "after"
