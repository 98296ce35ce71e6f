"""libs/sched stays pure: no I/O, clock, randomness or heavy frameworks."""

from __future__ import annotations

import ast
from pathlib import Path

import aegaeon_sched

FORBIDDEN = {
    "torch", "zmq", "asyncio", "time", "random", "numpy", "socket", "subprocess",
    "threading", "multiprocessing", "os", "io", "pathlib", "shutil", "datetime",
    "requests", "aiohttp", "msgpack", "yaml", "logging", "structlog",
}  # fmt: skip


def _imported_roots(path: Path) -> set[str]:
    roots: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.Import):
            roots.update(alias.name.split(".")[0] for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            roots.add(node.module.split(".")[0])
    return roots


def test_no_forbidden_imports() -> None:
    package_dir = Path(aegaeon_sched.__file__).parent
    modules = sorted(package_dir.glob("*.py"))
    assert len(modules) >= 10
    offenders = {
        m.name: sorted(_imported_roots(m) & FORBIDDEN)
        for m in modules
        if _imported_roots(m) & FORBIDDEN
    }
    assert offenders == {}


def test_only_stdlib_and_itself() -> None:
    # msgspec: a library, no I/O (the queues are msgspec structs, their own stored form)
    allowed = {"__future__", "aegaeon_sched", "collections", "dataclasses", "typing",
               "math", "heapq", "itertools", "functools", "bisect", "enum", "operator",
               "msgspec"}  # fmt: skip
    package_dir = Path(aegaeon_sched.__file__).parent
    for module in package_dir.glob("*.py"):
        extra = _imported_roots(module) - allowed
        assert not extra, f"{module.name} imports {sorted(extra)}"


def test_modules_are_small() -> None:
    package_dir = Path(aegaeon_sched.__file__).parent
    for module in package_dir.glob("*.py"):
        assert len(module.read_text().splitlines()) < 300, module.name
