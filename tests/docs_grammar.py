"""The docs as a user runs them (issue 43): what README.md and docs/operations.md show
must be what happens. This module reads out every command, config key and JSON field
they show; :mod:`docs_check` checks each against the code: commands with their own
parsers (``--help``), config keys with the config loader, JSON fields against a live
node's answers.

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
  added back with the body literal of the ``POST`` row whose path names no model (the
  add; ``POST .../{model}/reload`` acts on a served one); the literals are checked against the
  ``DELETE`` answer. A paragraph after ``<!-- docs-check: json GET PATH -->``: its JSON
  literals against that answer.
* **Request fields.** In a table whose first column is ``field``: each field (code
  spans of the first column) with a bad value is a 400 naming it (``param``), and each
  quoted value of the row (``"interactive"``) is served.

Failures name the file, the line and what does not match: ``README.md:161: field
`model_cache.num_hitz`: not in the answer (GET /v1/aegaeon/models[/{model}])``.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from pathlib import Path

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
            literals = [s for s in CODE.findall(" ".join(lines[start:end])) if s.startswith("{")]
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
    return word in PROGRAMS or script_path(word) is not None


def script_path(word: str) -> Path | None:
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
            for span in CODE.findall(cell):
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
            names = [s for s in CODE.findall(cells[0]) if IDENT.match(s)]
            values = [s.strip('"') for cell in cells[1:2] for s in CODE.findall(cell)
                      if re.fullmatch(r'"[^"]+"', s)]  # fmt: skip
            if names:
                doc.request_fields.append(RequestField(where, names, values))


def _dotted_key(span: str) -> bool:
    if not DOTTED.match(span) or span.startswith("aegaeon_"):
        return False
    return span.rsplit(".", 1)[-1] not in FILE_SUFFIXES


def _call_row(doc: Doc, where: Where, header: list[str], cells: list[str]) -> None:
    calls = CODE.findall(cells[0]) if cells else []
    found = re.match(r"^(GET|POST|PATCH|DELETE|PUT)\s+(\S+)", calls[0]) if calls else None
    if found is None:
        return
    column = {name: cells[k] for k, name in enumerate(header) if k < len(cells)}
    answer = column.get("answer", "")
    body = column.get("body", "")
    literals = [s for k, cell in enumerate(cells) if header[k:k + 1] != ["body"]
                for s in CODE.findall(cell) if s.startswith("{")]  # fmt: skip
    doc.calls.append(Call(
        where, found.group(1), found.group(2), field_specs(answer), field_specs(body),
        [s for s in CODE.findall(body) if s.startswith("{")], literals,
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
        names = [s for s in CODE.findall(inner) if IDENT.match(s)]
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


