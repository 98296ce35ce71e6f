"""The docs as a user runs them: what README.md and docs/operations.md show must be what
happens (issue 43). Read the docs, pull out every command, config key and JSON field they
show, and check each against the code: commands with their own parsers (``--help``),
config keys with the config loader, JSON fields against a live node's answers.

What is checked (a small grammar; anything else in the docs is prose):

* **Skip marker.** ``<!-- docs-check: skip: REASON -->`` on the nearest non-blank line
  above a fenced block or a table: nothing in it is checked (a GPU, Docker, a cluster).
* **Command blocks.** A fenced block tagged ``sh``, ``bash``, ``shell`` or ``console``:
  every line (``\\`` continuations joined; ``# comments``, a ``$`` prompt and a trailing
  ``&`` dropped) is a command of ``aegaeon`` (or ``.venv/bin/aegaeon``), of a script in
  ``scripts/``, or of ``pytest``; any other program needs the skip marker. ``aegaeon``
  commands are parsed by the ``aegaeon`` parser (subcommands, choices, types, required
  arguments; nothing runs); a script must exist and be executable, and what it hands its
  arguments to parses them (``aegaeon SUB "$@"``) or lists every ``--option`` used in its
  ``--help`` (``python -m MODULE "$@"``), else the option is in the script's text.
  ``pytest``: its paths exist and its ``-m`` markers are registered.
* **Commands in tables.** A code span in a table cell that starts with one of those
  programs is a synopsis (``aegaeon bench serve --url URL [--rps R]``): its subcommands
  must exist and its ``--help`` must list every ``--option`` it names.
* **Config keys.** In a table whose first column is ``key`` or ``config key``, that
  column's code spans; and in any table cell, a dotted name (``proxy.admission_wait``,
  ``roles.{high_util, low_util}``, ``model_settings.<m>.pin``, ``proxy.api_keys[].models``;
  not a file such as ``market.json``, not a module ``aegaeon_*``). The config loader must
  know each (given a dummy value, its complaint may not be an unknown key).
* **JSON answers.** In a table row whose call (first column, header ``call`` or
  ``control``) is ``GET PATH``: the ``answer`` column's fields, and every JSON literal
  (a code span that starts with ``{``) in the row. A field is an identifier code span; in
  parentheses right after it, code spans joined by ``/`` are its values (``state``
  (``serving``/``removing``)), joined by ``,`` its object's fields (``model_cache``
  (``budget_bytes``, ...)), after ``or`` another name for it. A literal is a shape
  (``{"services": [{"name", "role"}]}``: keys, arrays, ``"NAME"`` for any key); one with
  a string value (``{"state": "removed", "evicted"}``) describes the answers with that
  value. ``PATCH`` rows: each ``body`` field is sent with the value the ``GET`` answer
  shows for it (200 expected). ``DELETE`` rows: the last served model is removed and
  added back with the ``POST`` row's body literal; the literals are checked against the
  ``DELETE`` answer. A paragraph after ``<!-- docs-check: json GET PATH -->``: its JSON
  literals against that answer.
* **Request fields.** In a table whose first column is ``field``: each field (code
  spans of the first column) with a bad value is a 400 naming it (``param``), and each
  quoted value of the row (``"interactive"``) is served.

Failures name the file, the line and what does not match: ``README.md:158: field
`num_hitz` of GET /v1/aegaeon/models: not in the answer``.
"""

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
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
CHECKED_DOCS = ("README.md", "docs/operations.md")
SHELL_TAGS = {"sh", "bash", "shell", "console"}
SKIP = re.compile(r"<!--\s*docs-check:\s*skip:\s*(\S.*?)\s*-->")
JSON_MARK = re.compile(r"<!--\s*docs-check:\s*json\s+(GET)\s+(\S+)\s*-->")
CODE = re.compile(r"`([^`]+)`")
IDENT = re.compile(r"^[a-z_][a-z0-9_]*$")
SEG = r"(?:[a-z_][a-z0-9_]*|\*|<[a-z_]+>|\{[a-z0-9_, ]+\})(?:\[\])?"
DOTTED = re.compile(rf"^[a-z_][a-z0-9_]*(?:\[\])?(?:\.{SEG})+$")
FILE_SUFFIXES = {"json", "yaml", "yml", "py", "md", "txt", "toml", "sh", "gguf", "png", "log"}
PROGRAMS = ("aegaeon", ".venv/bin/aegaeon", "pytest")
OPTION = re.compile(r"(?<![\w-])(--[a-z][a-z0-9-]*)")
DUMMY = "docs-check-value"


@dataclass(frozen=True)
class Where:
    file: str
    line: int

    def __str__(self) -> str:
        return f"{self.file}:{self.line}"


@dataclass(frozen=True)
class Problem:
    where: Where
    what: str

    def __str__(self) -> str:
        return f"{self.where}: {self.what}"


# ---- what the docs show --------------------------------------------------------------------


@dataclass(frozen=True)
class Command:
    where: Where
    text: str
    synopsis: bool  # a table's synopsis (options only) or a block's runnable line


@dataclass(frozen=True)
class ConfigKey:
    where: Where
    key: str


@dataclass
class FieldSpec:
    name: str
    values: list[str] = field(default_factory=list)
    subfields: list[str] = field(default_factory=list)
    aliases: list[str] = field(default_factory=list)


@dataclass(frozen=True)
class Call:
    """A table row about one call: ``GET /v1/aegaeon/models[/{model}]``."""

    where: Where
    method: str
    path: str
    answer: list[FieldSpec]  # the ``answer`` column's fields
    body: list[FieldSpec]  # the ``body`` column's fields
    body_literals: list[str]
    literals: list[str]  # JSON literals anywhere in the row but the body


@dataclass(frozen=True)
class RequestField:
    where: Where
    names: list[str]
    values: list[str]


@dataclass(frozen=True)
class Marked:
    """A paragraph under ``<!-- docs-check: json GET PATH -->``."""

    where: Where
    path: str
    literals: list[str]


@dataclass
class Doc:
    file: str
    commands: list[Command] = field(default_factory=list)
    keys: list[ConfigKey] = field(default_factory=list)
    calls: list[Call] = field(default_factory=list)
    request_fields: list[RequestField] = field(default_factory=list)
    marked: list[Marked] = field(default_factory=list)
    problems: list[Problem] = field(default_factory=list)  # found while reading


def _cells(line: str) -> list[str]:
    """A table row's cells; ``\\|`` is a ``|`` inside a cell (GitHub's rule)."""
    body = line.strip().strip("|")
    return [c.strip().replace("\\|", "|") for c in re.split(r"(?<!\\)\|", body)]


def _spans(text: str) -> list[str]:
    return CODE.findall(text)


def _skip_reason(lines: list[str], index: int) -> str | None:
    """The skip marker on the nearest non-blank line above ``lines[index]``."""
    k = index - 1
    while k >= 0 and not lines[k].strip():
        k -= 1
    if k < 0:
        return None
    found = SKIP.search(lines[k])
    return found.group(1) if found else None


def read_doc(file: str, text: str) -> Doc:
    """Everything ``text`` (the docs file ``file``) shows that the grammar checks."""
    doc = Doc(file)
    lines = text.splitlines()
    i = 0
    while i < len(lines):
        line = lines[i]
        fence = re.match(r"^\s*```\s*([\w-]*)", line)
        if fence:
            end = next((k for k in range(i + 1, len(lines))
                        if lines[k].strip().startswith("```")), len(lines))  # fmt: skip
            if fence.group(1) in SHELL_TAGS and _skip_reason(lines, i) is None:
                _block_commands(doc, lines, i + 1, end)
            i = end + 1
            continue
        if line.lstrip().startswith("|"):
            end = i
            while end < len(lines) and lines[end].lstrip().startswith("|"):
                end += 1
            if _skip_reason(lines, i) is None:
                _table(doc, lines, i, end)
            i = end
            continue
        mark = JSON_MARK.search(line)
        if mark:
            end = i + 1
            while end < len(lines) and not lines[end].strip():
                end += 1
            start = end
            while end < len(lines) and lines[end].strip():
                end += 1
            literals = [s for s in _spans(" ".join(lines[start:end])) if s.startswith("{")]
            where = Where(file, start + 1)
            if not literals:
                doc.problems.append(Problem(where, "a json marker's paragraph shows no literal"))
            doc.marked.append(Marked(where, mark.group(2), literals))
            i = end
            continue
        i += 1
    return doc


def _block_commands(doc: Doc, lines: list[str], start: int, end: int) -> None:
    k = start
    while k < end:
        first = k
        text = lines[k]
        while text.rstrip().endswith("\\") and k + 1 < end:
            k += 1
            text = text.rstrip()[:-1] + " " + lines[k].strip()
        k += 1
        stripped = text.strip()
        if stripped.startswith("$ "):
            stripped = stripped[2:]
        if not stripped or stripped.startswith("#"):
            continue
        doc.commands.append(Command(Where(doc.file, first + 1), stripped, synopsis=False))


def _is_program(span: str) -> bool:
    word = span.split(maxsplit=1)[0] if span.strip() else ""
    return word in PROGRAMS or _script(word) is not None


def _script(word: str) -> Path | None:
    name = word.removeprefix("./")
    if not name.startswith("scripts/") or "/" in name.removeprefix("scripts/"):
        return None
    return REPO / name


def _table(doc: Doc, lines: list[str], start: int, end: int) -> None:
    header = [h.strip("` ").lower() for h in _cells(lines[start])]
    rows = [(k, _cells(lines[k])) for k in range(start + 1, end)
            if not re.match(r"^\s*\|[\s:|-]+\|\s*$", lines[k])]  # fmt: skip
    first = header[0] if header else ""
    for k, cells in rows:
        where = Where(doc.file, k + 1)
        for column, cell in enumerate(cells):
            for span in _spans(cell):
                if _is_program(span):
                    doc.commands.append(Command(where, span, synopsis=True))
                elif column == 0 and first in ("key", "config key"):
                    keys = re.split(r",(?![^{]*\})", span)  # not a comma inside {a, b}
                    doc.keys.extend(ConfigKey(where, key.strip()) for key in keys if key.strip())
                elif _dotted_key(span):
                    doc.keys.append(ConfigKey(where, span))
        if first in ("call", "control"):
            _call_row(doc, where, header, cells)
        elif first == "field" and cells:
            names = [s for s in _spans(cells[0]) if IDENT.match(s)]
            values = [s.strip('"') for cell in cells[1:2] for s in _spans(cell)
                      if re.fullmatch(r'"[^"]+"', s)]  # fmt: skip
            if names:
                doc.request_fields.append(RequestField(where, names, values))


def _dotted_key(span: str) -> bool:
    if not DOTTED.match(span) or span.startswith("aegaeon_"):
        return False
    return span.rsplit(".", 1)[-1] not in FILE_SUFFIXES


def _call_row(doc: Doc, where: Where, header: list[str], cells: list[str]) -> None:
    calls = _spans(cells[0]) if cells else []
    found = re.match(r"^(GET|POST|PATCH|DELETE|PUT)\s+(\S+)", calls[0]) if calls else None
    if found is None:
        return
    column = {name: cells[k] for k, name in enumerate(header) if k < len(cells)}
    answer = column.get("answer", "")
    body = column.get("body", "")
    literals = [s for k, cell in enumerate(cells) if header[k:k + 1] != ["body"]
                for s in _spans(cell) if s.startswith("{")]  # fmt: skip
    doc.calls.append(Call(
        where, found.group(1), found.group(2), field_specs(answer), field_specs(body),
        [s for s in _spans(body) if s.startswith("{")], literals,
    ))  # fmt: skip


def field_specs(cell: str) -> list[FieldSpec]:
    """The fields a cell lists (see the module docstring)."""
    out: list[FieldSpec] = []
    depth = 0
    skip_to = -1
    for tok in re.finditer(r"`[^`]+`|\(|\)", cell):
        if tok.start() < skip_to:
            continue  # inside a field's parentheses: read with the field
        text = tok.group(0)
        if text in ("(", ")"):
            depth += 1 if text == "(" else -1
            continue
        name = text[1:-1]
        if depth or not IDENT.match(name):
            continue
        spec = FieldSpec(name)
        out.append(spec)
        opened = re.match(r"\s*\(", cell[tok.end():])
        if opened is None:
            continue
        start = tok.end() + opened.end() - 1
        close = _closing(cell, start)
        inner = cell[start + 1 : close]
        names = [s for s in _spans(inner) if IDENT.match(s)]
        glue = [g.strip() for g in CODE.sub("\0", inner).split("\0")[1:-1]]
        if re.match(r"\s*or\s", inner):
            spec.aliases = names
        elif len(names) > 1 and all(g == "/" for g in glue[: len(names) - 1]):
            spec.values = names
        elif len(names) > 1 and all("," in g for g in glue[: len(names) - 1]):
            spec.subfields = names
        skip_to = close + 1
    return out


def _closing(text: str, open_at: int) -> int:
    depth = 0
    in_code = False
    for k in range(open_at, len(text)):
        ch = text[k]
        if ch == "`":
            in_code = not in_code
        elif not in_code and ch == "(":
            depth += 1
        elif not in_code and ch == ")":
            depth -= 1
            if depth == 0:
                return k
    return len(text)


def read_docs(files: tuple[str, ...] = CHECKED_DOCS, root: Path = REPO) -> list[Doc]:
    return [read_doc(name, (root / name).read_text()) for name in files]


# ---- JSON shapes -----------------------------------------------------------------------------


@dataclass
class Shape:
    """A JSON literal's shape: an object's keys (with their shapes), an array's items, or a
    value (a string, or None for anything)."""

    keys: dict[str, Shape | None] | None = None
    item: Shape | None = None
    value: str | None = None
    is_array: bool = False


def parse_shape(text: str) -> Shape:
    """``{"services": [{"name", "role"}]}``, ``{"state": "removed", "evicted"}``, ...;
    ValueError when it is not such a literal."""
    tokens = re.findall(r'"[^"]*"|[{}\[\]:,]|[^\s{}\[\]:,"]+', text)
    shape, rest = _shape(tokens, 0)
    if rest != len(tokens):
        raise ValueError(f"trailing text in {text!r}")
    return shape


def _shape(tokens: list[str], k: int) -> tuple[Shape, int]:
    if k >= len(tokens):
        raise ValueError("a literal ends too early")
    tok = tokens[k]
    if tok == "{":
        keys: dict[str, Shape | None] = {}
        k += 1
        while k < len(tokens) and tokens[k] != "}":
            if tokens[k] == ",":
                k += 1
                continue
            name = tokens[k]
            if not name.startswith('"'):
                raise ValueError(f"a key must be quoted, not {name!r}")
            k += 1
            if k < len(tokens) and tokens[k] == ":":
                value, k = _shape(tokens, k + 1)
                keys[name.strip('"')] = value
            else:
                keys[name.strip('"')] = None
        return Shape(keys=keys), k + 1
    if tok == "[":
        if k + 1 < len(tokens) and tokens[k + 1] == "]":
            return Shape(is_array=True), k + 2
        item, k = _shape(tokens, k + 1)
        while k < len(tokens) and tokens[k] != "]":
            k += 1
        return Shape(item=item, is_array=True), k + 1
    if tok.startswith('"'):
        return Shape(value=tok.strip('"')), k + 1
    return Shape(), k + 1  # bool, ..., a number: any value


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
            is_list = part.endswith("[]")
            name = part.removesuffix("[]")
            last = k == len(parts) - 1
            child: Any = DUMMY if last else {}
            if is_list:
                node[name] = [child] if not last else DUMMY
                node = child
            else:
                node[name] = child
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
    script = _script(program)
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
        posts = [c for c in doc.calls if c.method == "POST"]
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
    import urllib.error
    import urllib.request

    def fetch(method: str, path: str, body: Any) -> Reply:
        data = json.dumps(body).encode() if body is not None else None
        request = urllib.request.Request(base_url + path, data=data, method=method,
                                         headers={"Content-Type": "application/json",
                                                  **(headers or {})})  # fmt: skip
        try:
            with urllib.request.urlopen(request, timeout=120) as resp:
                return Reply(resp.status, json.loads(resp.read() or b"null"))
        except urllib.error.HTTPError as exc:
            raw = exc.read()
            try:
                return Reply(exc.code, json.loads(raw or b"null"))
            except ValueError:
                return Reply(exc.code, raw.decode(errors="replace"))

    return fetch
