"""The docs against the shared live node (issue 43): every JSON field README.md and
docs/operations.md show in a table or a marked paragraph is in the answers of
`aegaeon serve`, every request field they list is the server's, and the admin calls they
show answer as they say (tests/docs_grammar.py has the grammar; the commands and config
keys are checked without a node in tests/unit/test_docs_check.py)."""

from __future__ import annotations

from docs_check import http_fetch, live_problems, read_docs
from serve_harness import Served


def test_every_json_field_the_docs_show_is_in_a_live_answer(served: Served) -> None:
    models = [m["id"] for m in served.get_json("/v1/models")["data"]]  # type: ignore[index]
    problems = live_problems(read_docs(), http_fetch(served.url), models)
    assert not problems, "\n".join(str(p) for p in problems)
    # the last model was removed and added back (the DELETE and POST rows): served again
    after = [m["id"] for m in served.get_json("/v1/models")["data"]]  # type: ignore[index]
    assert after == models
