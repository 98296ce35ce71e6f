"""The docs checked against the code and a live node: the commands, config keys and JSON
fields :mod:`docs_grammar` reads out of README.md and docs/operations.md (its docstring
is the grammar). Every problem names the file, the line and what does not match."""

from __future__ import annotations

import argparse
import contextlib
import functools
import io
import json
import os
import re
import shlex
import subprocess
import sys
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from docs_grammar import (
    CHECKED_DOCS,
    REPO,
    Call,
    Command,
    Doc,
    FieldSpec,
    Problem,
    RequestField,
    Shape,
    Where,
    field_specs,
    parse_shape,
    read_doc,
    read_docs,
    script_path,
)

__all__ = [
    "CHECKED_DOCS", "REPO", "Reply", "field_specs", "http_fetch", "live_problems",
    "offline_problems", "parse_shape", "read_doc", "read_docs", "shape_problems",
]  # fmt: skip

OPTION = re.compile(r"(?<![\w-])(--[a-z][a-z0-9-]*)")
DUMMY = "docs-check-value"


def _placeholder(key: str) -> bool:
    return bool(re.fullmatch(r"[A-Z][A-Z_]*", key))


def applies(shape: Shape, answer: Any) -> bool:
    """Whether ``shape`` describes ``answer`` at all: its top-level string values match."""
    if shape.keys is None or not isinstance(answer, dict):
        return True
    return all(answer.get(k) == s.value for k, s in shape.keys.items()
               if s is not None and s.value is not None)  # fmt: skip


def shape_problems(shape: Shape, answer: Any, at: str = "") -> list[str]:
    """What of ``shape`` ``answer`` lacks (``at``: the JSON path so far)."""
    if shape.keys is not None:
        if not isinstance(answer, dict):
            return [f"{at or 'the answer'} is not an object"]
        out = []
        for key, sub in shape.keys.items():
            if _placeholder(key):
                values = list(answer.values())
                if sub is not None:
                    for value in values:
                        out += shape_problems(sub, value, f"{at}.{key}")
                continue
            if key not in answer:
                out.append(f"key `{key}` not in {at or 'the answer'}")
            elif sub is not None:
                out += shape_problems(sub, answer[key], f"{at}.{key}")
        return out
    if shape.is_array:
        if not isinstance(answer, list):
            return [f"{at or 'the answer'} is not an array"]
        if shape.item is None:
            return []
        found = [p for item in answer for p in shape_problems(shape.item, item, f"{at}[]")]
        return list(dict.fromkeys(found))  # once per key, not once per item
    return []


def _walk(answer: Any) -> Iterator[tuple[str, Any]]:
    """Every ``(key, value)`` pair anywhere in ``answer``."""
    if isinstance(answer, dict):
        for key, value in answer.items():
            yield str(key), value
            yield from _walk(value)
    elif isinstance(answer, list):
        for item in answer:
            yield from _walk(item)


def field_problems(specs: list[FieldSpec], answer: Any) -> list[str]:
    """What of the listed fields ``answer`` lacks, anywhere in it (see the grammar)."""
    pairs = list(_walk(answer))
    out: list[str] = []
    for spec in specs:
        values = [v for k, v in pairs if k == spec.name]
        if not values:
            out.append(f"field `{spec.name}`: not in the answer")
            continue
        for value in values:
            if spec.values and isinstance(value, str) and value not in spec.values:
                out.append(f"field `{spec.name}` is {value!r}, not one of {spec.values}")
            if spec.subfields and isinstance(value, dict):
                missing = [s for s in spec.subfields if s not in value]
                out += [f"field `{spec.name}.{s}`: not in the answer" for s in missing]
        if spec.subfields and not any(isinstance(v, dict) for v in values):
            out.append(f"field `{spec.name}` is not an object with {spec.subfields}")
    return list(dict.fromkeys(out))


# ---- config keys ------------------------------------------------------------------------------


def _expand(key: str) -> list[str]:
    """``roles.{a, b}`` -> both; ``<class>`` -> each SLO class; ``<m>``/``<model>``/``NAME``
    -> the test model; ``[]`` kept (a list item)."""
    from aegaeon_common.config import SLO_CLASS_NAMES

    found = re.search(r"\{([^}]+)\}", key)
    if found:
        head, tail = key[: found.start()], key[found.end() :]
        parts = found.group(1).split(",")
        return [k for part in parts for k in _expand(head + part.strip() + tail)]
    if "<class>" in key:
        return [k for name in SLO_CLASS_NAMES for k in _expand(key.replace("<class>", name))]
    return [re.sub(r"<[a-z_]+>", "m", key)]


def config_key_problem(key: str) -> str | None:
    """None when the config loader knows ``key``; else what it said."""
    from aegaeon_common.config import ConfigError, config_from_dict

    for one in _expand(key):
        raw: dict[str, Any] = {"models": [{"name": "m", "path": "/nonexistent-docs-check"}]}
        node: Any = raw
        parts = one.split(".")
        for k, part in enumerate(parts):
            last = k == len(parts) - 1
            child: Any = DUMMY if last else {}  # a list's (``[]``) in a list of one
            node[part.removesuffix("[]")] = [child] if part.endswith("[]") and not last else child
            node = child
        try:
            config_from_dict(raw, source="docs")
        except ConfigError as exc:
            if "unknown" in exc.problem:
                return f"{exc.field}: {exc.problem.split(' (known')[0]}"
    return None


# ---- commands ------------------------------------------------------------------------------------


def _aegaeon_parser(path: list[str]) -> tuple[argparse.ArgumentParser, list[str]]:
    """The parser of ``aegaeon PATH...`` (as deep as ``path`` names subcommands) and the
    subcommand words it took."""
    from aegaeon_cli.main import build_parser

    parser = build_parser(path)
    taken: list[str] = []
    for word in path:
        sub = next((a for a in parser._actions
                    if isinstance(a, argparse._SubParsersAction)), None)  # fmt: skip
        if sub is None or word not in sub.choices:
            break
        parser = sub.choices[word]
        taken.append(word)
    return parser, taken


def _parse_aegaeon(argv: list[str]) -> str | None:
    """None when the ``aegaeon`` parser takes ``argv``; else its error."""
    from aegaeon_cli.main import build_parser

    parser = build_parser(argv)
    err = io.StringIO()
    with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
        try:
            parser.parse_args(argv)
        except SystemExit as exc:
            if exc.code not in (0, None):
                lines = err.getvalue().strip().splitlines()
                return lines[-1] if lines else f"exit {exc.code}"
    return None


@functools.cache
def _module_help(module: str) -> str:
    """``python -m module --help`` (its parser is built where it runs)."""
    done = subprocess.run([sys.executable, "-m", module, "--help"], capture_output=True,
                          text=True, timeout=120, cwd=REPO, check=False)  # fmt: skip
    return done.stdout + done.stderr


def _hands_on(script: Path) -> tuple[str, str] | None:
    """What a script hands its arguments to: ``("aegaeon", "SUB")`` or ``("module", M)``."""
    text = script.read_text(errors="replace")
    found = re.search(r"aegaeon\s+([a-z][a-z-]*)\s+\"\$@\"", text)
    if found:
        return "aegaeon", found.group(1)
    found = re.search(r"-m\s+([\w.]+)\s+\"\$@\"", text)
    if found:
        return "module", found.group(1)
    return None


def command_problems(cmd: Command) -> list[str]:
    """What is wrong with one command the docs show (see the module docstring)."""
    words = cmd.text.split() if cmd.synopsis else _split(cmd.text)
    if words is None:
        return [f"cannot split `{cmd.text}` as a shell line"]
    if words and words[-1] == "&":
        words = words[:-1]
    if not words:
        return []
    program, args = words[0], words[1:]
    if program in ("aegaeon", ".venv/bin/aegaeon"):
        return _aegaeon_problems(args, cmd)
    if program == "pytest":
        return _pytest(args)
    script = script_path(program)
    if script is not None:
        return _script_problems(script, args, cmd)
    return [f"`{program}` is not a program the docs check: mark the block "
            "`<!-- docs-check: skip: REASON -->`"]  # fmt: skip


def _aegaeon_problems(args: list[str], cmd: Command) -> list[str]:
    if not cmd.synopsis:
        error = _parse_aegaeon(args)
        return [] if error is None else [f"`aegaeon {' '.join(args)}`: {error}"]
    parser, taken = _aegaeon_parser(args)
    rest = args[len(taken) :]
    first = rest[0] if rest else ""
    if re.fullmatch(r"[a-z][a-z0-9-]*", first) and _has_subcommands(parser):
        return [f"`aegaeon {' '.join(taken)}` has no subcommand `{first}`"]
    # what `aegaeon PATH --help` prints
    return _options_missing(_options(cmd.text), parser.format_help(),
                            f"aegaeon {' '.join(taken)}")  # fmt: skip


def _script_problems(script: Path, args: list[str], cmd: Command) -> list[str]:
    name = f"scripts/{script.name}"
    if not script.is_file() or not os.access(script, os.X_OK):
        return [f"`{name}`: no such executable script"]
    target = _hands_on(script)
    if target is not None and target[0] == "aegaeon":
        return _aegaeon_problems([target[1], *args], cmd)
    known = script.read_text(errors="replace")
    if target is not None:
        known += _module_help(target[1])
    return _options_missing(_options(cmd.text), known, name)


def _split(text: str) -> list[str] | None:
    try:
        return shlex.split(text, comments=True)
    except ValueError:
        return None


def _options(text: str) -> list[str]:
    return sorted(set(OPTION.findall(text)))


def _options_missing(options: list[str], help_text: str, what: str) -> list[str]:
    listed = set(OPTION.findall(help_text))
    return [f"`{what}` has no option `{opt}`" for opt in options if opt not in listed]


def _has_subcommands(parser: argparse.ArgumentParser) -> bool:
    return any(isinstance(a, argparse._SubParsersAction) for a in parser._actions)


def _pytest(args: list[str]) -> list[str]:
    out = []
    markers = _pytest_markers()
    k = 0
    while k < len(args):
        arg = args[k]
        if arg == "-m" and k + 1 < len(args):
            for word in re.findall(r"[a-z_]+", args[k + 1]):
                if word not in ("and", "or", "not") and word not in markers:
                    out.append(f"pytest marker `{word}` is not registered")
            k += 2
            continue
        if not arg.startswith("-") and not (REPO / arg.split("::")[0]).exists():
            out.append(f"pytest: no such path `{arg}`")
        k += 1
    return out


def _pytest_markers() -> set[str]:
    import tomllib

    config = tomllib.loads((REPO / "pyproject.toml").read_text())
    markers = config["tool"]["pytest"]["ini_options"].get("markers", [])
    return {m.split(":", 1)[0].strip() for m in markers}


# ---- the checks ---------------------------------------------------------------------------------


def offline_problems(docs: list[Doc]) -> list[Problem]:
    """Commands and config keys (no node needed), and what reading the docs found."""
    out: list[Problem] = []
    for doc in docs:
        out += doc.problems
        for cmd in doc.commands:
            out += [Problem(cmd.where, p) for p in command_problems(cmd)]
        for key in doc.keys:
            problem = config_key_problem(key.key)
            if problem is not None:
                out.append(Problem(key.where, f"config key `{key.key}`: {problem}"))
    return out


@dataclass(frozen=True)
class Reply:
    status: int
    body: Any


Fetch = Callable[[str, str, Any], Reply]  # (method, path, JSON body or None) -> the answer


def _fill(path: str, model: str) -> list[str]:
    """Concrete paths for a documented one: ``[...]`` parts left out and kept, ``{x}``
    and ``NAME`` the model, a ``?query`` of placeholders kept with them filled."""
    paths = {re.sub(r"\[[^\]]*\]", "", path), re.sub(r"[\[\]]", "", path)}
    out = []
    for one in sorted(paths):
        filled = re.sub(r"\{[a-z_]+\}", model, one)
        filled = re.sub(r"=NAME\b", f"={model}", filled)
        filled = re.sub(r"&[a-z_]+=[^&]*\|[^&]*", "", filled)  # alternatives: left out
        out.append(filled)
    return out


def live_problems(docs: list[Doc], fetch: Fetch, models: list[str]) -> list[Problem]:
    """The JSON fields and request fields against a live node (``fetch``); ``models``: the
    ones it serves. DELETE rows remove the last model and add it back (see the grammar)."""
    out: list[Problem] = []
    model = models[0]
    for doc in docs:
        for call in doc.calls:
            if call.method == "GET":
                out += _get_row(call, fetch, model)
            elif call.method == "PATCH":
                out += _patch_row(call, fetch, model)
        for mark in doc.marked:
            for path in _fill(mark.path, model):
                reply = fetch("GET", path, None)
                out += _literals(mark.where, mark.literals, reply, f"GET {path}")
        for req in doc.request_fields:
            out += _request_fields(req, fetch, model)
        deletes = [c for c in doc.calls if c.method == "DELETE"]
        # the add (a POST that names no model; one that does acts on a served model)
        posts = [c for c in doc.calls if c.method == "POST" and "{" not in c.path]
        for call in deletes:
            out += _delete_row(call, posts, fetch, models[-1])
    return out


def _answer(where: Where, reply: Reply, what: str) -> list[Problem]:
    if reply.status // 100 != 2:
        return [Problem(where, f"{what}: HTTP {reply.status} {json.dumps(reply.body)[:200]}")]
    return []


def _literals(where: Where, literals: list[str], reply: Reply, what: str) -> list[Problem]:
    out = _answer(where, reply, what)
    if out:
        return out
    for literal in literals:
        try:
            shape = parse_shape(literal)
        except ValueError as exc:
            out.append(Problem(where, f"`{literal}`: not a JSON literal ({exc})"))
            continue
        if applies(shape, reply.body):
            out += [Problem(where, f"`{literal}` of {what}: {p}")
                    for p in shape_problems(shape, reply.body)]  # fmt: skip
    return out


def _get_row(call: Call, fetch: Fetch, model: str) -> list[Problem]:
    """The row's literals against each concrete path's answer; its answer fields against
    them together (``/models[/{model}]``: the list's and one row's)."""
    out: list[Problem] = []
    answers = []
    for path in _fill(call.path, model):
        reply = fetch("GET", path, None)
        out += _literals(call.where, call.literals, reply, f"GET {path}")
        if reply.status // 100 == 2:
            answers.append(reply.body)
    if call.answer and answers:
        out += [Problem(call.where, f"{p} (GET {call.path})")
                for p in field_problems(call.answer, answers)]  # fmt: skip
    return out


def _patch_row(call: Call, fetch: Fetch, model: str) -> list[Problem]:
    """Each body field sent with the value the model's row shows (changes nothing)."""
    out: list[Problem] = []
    path = _fill(call.path, model)[0]
    row = fetch("GET", path, None)
    if row.status // 100 != 2 or not isinstance(row.body, dict):
        return [Problem(call.where, f"GET {path}: HTTP {row.status}")]
    for spec in call.body:
        for name in (spec.name, *spec.aliases):
            source = spec.name if spec.name in row.body else next(
                (a for a in spec.aliases if a in row.body), None)  # fmt: skip
            if source is None:
                out.append(Problem(call.where, f"body field `{name}` of PATCH {call.path}: the "
                                   f"model's row shows no value to send"))  # fmt: skip
                continue
            reply = fetch("PATCH", path, {name: row.body[source]})
            if reply.status != 200:
                said = json.dumps(reply.body)[:200]
                out.append(Problem(call.where, f"body field `{name}` of PATCH {call.path}: "
                                   f"HTTP {reply.status} {said}"))  # fmt: skip
    return out


def _delete_row(call: Call, posts: list[Call], fetch: Fetch, model: str) -> list[Problem]:
    path = _fill(call.path, model)[0]
    reply = fetch("DELETE", path, None)
    out = _literals(call.where, call.literals, reply, f"DELETE {path}")
    matched = [lit for lit in call.literals if applies(parse_shape(lit), reply.body)]
    if reply.status // 100 == 2 and call.literals and not matched:
        out.append(Problem(call.where, f"DELETE {path}: no literal describes its answer "
                           f"{json.dumps(reply.body)[:200]}"))  # fmt: skip
    for post in posts:  # add it back, with the body the POST row shows
        body = {}
        for literal in post.body_literals:
            shape = parse_shape(literal)
            for key in (shape.keys or {}):
                body[key] = model
        added = fetch("POST", post.path, body or {"name": model})
        if added.status != 201:
            out.append(Problem(post.where, f"POST {post.path} {body}: HTTP {added.status} "
                               f"{json.dumps(added.body)[:200]}"))  # fmt: skip
    return out


def _request_fields(req: RequestField, fetch: Fetch, model: str) -> list[Problem]:
    out: list[Problem] = []
    base = {"model": model, "prompt": "docs", "max_tokens": 1, "temperature": 0}
    for name in req.names:
        bad = fetch("POST", "/v1/completions", {**base, name: DUMMY})
        param = bad.body.get("error", {}).get("param") if isinstance(bad.body, dict) else None
        if bad.status != 400 or param != name:
            out.append(Problem(req.where, f"request field `{name}`: a bad value got HTTP "
                               f"{bad.status} (param {param!r}), not a 400 naming it"))  # fmt: skip
        for value in req.values:
            reply = fetch("POST", "/v1/completions", {**base, name: value})
            if reply.status != 200:
                out.append(Problem(req.where, f"request field `{name}` = {value!r}: HTTP "
                                   f"{reply.status} {json.dumps(reply.body)[:200]}"))  # fmt: skip
    return out


def http_fetch(base_url: str, headers: dict[str, str] | None = None) -> Fetch:
    """A :data:`Fetch` of a node's proxy at ``base_url`` (JSON in and out, errors too)."""
    from http_support import call_json

    def fetch(method: str, path: str, body: Any) -> Reply:
        return Reply(*call_json(base_url, method, path, body, headers))

    return fetch
