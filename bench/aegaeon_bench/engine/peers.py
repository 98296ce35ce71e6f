"""The engine bench's peers (vLLM, llama.cpp): workers in interpreters of their own.

Each peer is a script (vllm_peer.py, llamacpp_peer.py) that imports only
the standard library and its engine, run by the python of the venv its
install script built (scripts/install-vllm, scripts/install-llamacpp), so
neither ever sees our packages. They speak the same JSON-lines protocol (the
workload, ``ready``, one repeat per ``run``), so one `PeerWorker` drives both;
a peer that is not installed is reported as null with the reason.
"""

from __future__ import annotations

import importlib.util
import json
import shutil
import signal
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

# where scripts/install-llamacpp builds its venv unless told otherwise
LLAMACPP_PYTHON = Path.home() / ".cache" / "aegaeon" / "llamacpp-venv" / "bin" / "python"


class PeerWorker:
    """A peer's script in a subprocess of another interpreter, one repeat per ``run``."""

    def __init__(self, name: str, python: str, script: str, work: dict[str, Any]) -> None:
        self.name = name
        # lives as long as the worker: its stderr, shown if it dies
        self.log = tempfile.TemporaryFile(mode="w+")  # noqa: SIM115
        self.proc = subprocess.Popen([python, str(Path(__file__).with_name(script))],
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                     stderr=self.log, text=True)
        self._send(json.dumps(work))
        self.ready = self._receive()  # {"ready": true, ...what the peer says of itself}
        self.pause()

    def _send(self, line: str) -> None:
        assert self.proc.stdin is not None
        self.proc.stdin.write(line + "\n")
        self.proc.stdin.flush()

    def _receive(self) -> dict[str, Any]:
        assert self.proc.stdout is not None
        line = self.proc.stdout.readline()
        if not line:
            self.proc.wait()
            self.log.seek(0)
            raise RuntimeError(f"{self.name} worker exited ({self.proc.returncode}): "
                               f"{self.log.read()[-2000:]}")
        return dict(json.loads(line))

    def run(self) -> dict[str, Any]:
        """One repeat of the workload: tokens/s and the batch-8 greedy tokens."""
        self._signal(signal.SIGCONT)
        self._send("run")
        try:
            return self._receive()
        finally:
            self.pause()

    def pause(self) -> None:
        """Stop the worker between its repeats: an idle engine may still spin a core
        (vLLM's loop, OpenMP's waiting threads), which the other engines would lose."""
        self._signal(signal.SIGSTOP)

    def _signal(self, sig: signal.Signals) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(sig)

    def close(self) -> None:
        self._signal(signal.SIGCONT)
        if self.proc.poll() is None:
            try:
                self._send("quit")
                self.proc.wait(timeout=60)
            except (OSError, subprocess.TimeoutExpired):
                self.proc.kill()
        self.log.close()


@dataclass(frozen=True)
class Peer:
    """How to find and start one peer."""

    name: str  # the JSON key of its numbers
    script: str
    module: str  # what its python must import
    install: str  # what installs it
    default_python: Path | None = None  # where the install script puts it


VLLM = Peer("vllm", "vllm_peer.py", "vllm", "scripts/install-vllm")
LLAMACPP = Peer("llamacpp", "llamacpp_peer.py", "llama_cpp", "scripts/install-llamacpp",
                LLAMACPP_PYTHON)


def _unavailable(peer: Peer, why: str, result: dict[str, Any]) -> None:
    result[f"{peer.name}_error"] = why
    print(f"aegaeon bench engine: {peer.name} unavailable: {why}", file=sys.stderr)


def peer_python(peer: Peer, given: str | None, result: dict[str, Any]) -> str | None:
    """The interpreter to run ``peer``: ``given``, else the install script's if it exists,
    else this one if it can import the peer. None (the reason in ``result[<name>_error]``
    and printed): not installed, or ``given`` is not an interpreter here."""
    if given:
        if shutil.which(given) is None:
            _unavailable(peer, f"no interpreter {given}", result)
            return None
        return given
    if peer.default_python is not None and peer.default_python.is_file():
        return str(peer.default_python)
    if importlib.util.find_spec(peer.module) is not None:
        return sys.executable
    _unavailable(peer, f"not installed ({peer.install}, or --{peer.name}-python)", result)
    return None


def start_peer(peer: Peer, python: str, work: dict[str, Any],
               result: dict[str, Any]) -> PeerWorker | None:
    """The started worker, or None with the reason in ``result[<name>_error]`` and printed."""
    try:
        return PeerWorker(peer.name, python, peer.script, work)
    except (OSError, RuntimeError) as exc:
        _unavailable(peer, str(exc), result)
        return None


def write_peer_gguf(model_dir: Path, dtype: str, scratch: Path,
                    result: dict[str, Any]) -> Path | None:
    """The checkpoint as a GGUF file for llama.cpp, in ``dtype``; None (and the reason in
    ``result["llamacpp_error"]``) when it cannot be written."""
    from aegaeon_engine import CheckpointError
    from aegaeon_market.gguf_export import write_gguf

    try:
        return write_gguf(model_dir, scratch / f"{model_dir.name}-{dtype}.gguf", dtype)
    except (CheckpointError, OSError) as exc:
        _unavailable(LLAMACPP, f"no GGUF file for it: {exc}", result)
        return None
