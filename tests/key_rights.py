"""Issue 45's table of who may call what, shared by the proxy's unit test
(tests/unit/test_proxy_key_rights.py) and the live nodes' (tests/e2e/test_serve_key_rights.py).

:data:`TABLE` has one row per endpoint and one column per kind of key
(:data:`KINDS`): no key, a user key, a user key limited to :data:`MINE`, an admin
key. Both markets of the tests (the proxy's and the e2e one, the ``small``
profile) hold these model names; a node under test serves :data:`MINE` and
:data:`OTHER`, not :data:`EXTRA`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

MINE = "llama-gqa-5m"  # the limited key's model
OTHER = "mistral-11m"  # served, not the limited key's
EXTRA = "qwen2-19m"  # in the market, not served: POST adds it
USER_KEY = "sk-user-0123456789"
LIMITED_KEY = "tenantkey123"  # limited to MINE
ADMIN_KEY = "sk-admin-0123456789"
KINDS = ("none", "user", "limited", "admin")
HEADERS = {
    "none": {},
    "user": {"Authorization": f"Bearer {USER_KEY}"},
    "limited": {"Authorization": f"Bearer {LIMITED_KEY}"},
    "admin": {"Authorization": f"Bearer {ADMIN_KEY}"},
}
COMPLETION = {"prompt": "hi", "max_tokens": 2}
CHAT = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
RESPONSE = {"input": "hi", "max_output_tokens": 2}


@dataclass(frozen=True)
class Row:
    method: str
    route: str  # as the app declares it
    path: str  # as called
    body: dict[str, Any] | None
    want: tuple[int, int, int, int]  # status for: no key, user, limited user, admin


# fmt: off
TABLE = [
    # probes: open to everyone
    Row("GET", "/health", "/health", None,                                  (200, 200, 200, 200)),
    Row("GET", "/ready", "/ready", None,                                    (200, 200, 200, 200)),
    # the API: any key; a model-limited key reaches only its model (404 for another)
    Row("POST", "/v1/completions", "/v1/completions", {"model": MINE, **COMPLETION},
                                                                            (401, 200, 200, 200)),
    Row("POST", "/v1/completions", "/v1/completions", {"model": OTHER, **COMPLETION},
                                                                            (401, 200, 404, 200)),
    Row("POST", "/v1/chat/completions", "/v1/chat/completions", {"model": MINE, **CHAT},
                                                                            (401, 200, 200, 200)),
    Row("POST", "/v1/chat/completions", "/v1/chat/completions", {"model": OTHER, **CHAT},
                                                                            (401, 200, 404, 200)),
    Row("POST", "/v1/responses", "/v1/responses", {"model": MINE, **RESPONSE},
                                                                            (401, 200, 200, 200)),
    Row("POST", "/v1/responses", "/v1/responses", {"model": OTHER, **RESPONSE},
                                                                            (401, 200, 404, 200)),
    Row("POST", "/tokenize", "/tokenize", {"model": MINE, "prompt": "hi"},  (401, 200, 200, 200)),
    Row("POST", "/tokenize", "/tokenize", {"model": OTHER, "prompt": "hi"}, (401, 200, 404, 200)),
    Row("POST", "/detokenize", "/detokenize", {"model": MINE, "tokens": [5]},
                                                                            (401, 200, 200, 200)),
    Row("POST", "/detokenize", "/detokenize", {"model": OTHER, "tokens": [5]},
                                                                            (401, 200, 404, 200)),
    Row("GET", "/version", "/version", None,                                (401, 200, 200, 200)),
    Row("GET", "/v1/models", "/v1/models", None,                            (401, 200, 200, 200)),
    Row("GET", "/v1/models/{model}", f"/v1/models/{MINE}", None,            (401, 200, 200, 200)),
    Row("GET", "/v1/models/{model}", f"/v1/models/{OTHER}", None,           (401, 200, 404, 200)),
    # what changes or reveals the node: an admin key; 403 for any user key, whatever
    # model the path names (an unknown one too: the limited key learns no name)
    Row("GET", "/metrics", "/metrics", None,                                (401, 403, 403, 200)),
    Row("GET", "/v1/aegaeon/stats", "/v1/aegaeon/stats", None,              (401, 403, 403, 200)),
    Row("GET", "/v1/aegaeon/services", "/v1/aegaeon/services", None,        (401, 403, 403, 200)),
    Row("GET", "/v1/aegaeon/models", "/v1/aegaeon/models", None,            (401, 403, 403, 200)),
    Row("GET", "/v1/aegaeon/models/{model}", f"/v1/aegaeon/models/{MINE}", None,
                                                                            (401, 403, 403, 200)),
    Row("GET", "/v1/aegaeon/models/{model}", f"/v1/aegaeon/models/{OTHER}", None,
                                                                            (401, 403, 403, 200)),
    Row("GET", "/v1/aegaeon/models/{model}", "/v1/aegaeon/models/no-such-model", None,
                                                                            (401, 403, 403, 404)),
    Row("POST", "/v1/aegaeon/models", "/v1/aegaeon/models", {"name": EXTRA},
                                                                            (401, 403, 403, 201)),
    Row("PATCH", "/v1/aegaeon/models/{model}", f"/v1/aegaeon/models/{MINE}", {"pinned": True},
                                                                            (401, 403, 403, 200)),
    Row("PATCH", "/v1/aegaeon/models/{model}", f"/v1/aegaeon/models/{OTHER}", {"pinned": True},
                                                                            (401, 403, 403, 200)),
    Row("POST", "/v1/aegaeon/models/{model}/reload", f"/v1/aegaeon/models/{MINE}/reload",
        None,                                                               (401, 403, 403, 200)),
    Row("DELETE", "/v1/aegaeon/models/{model}", f"/v1/aegaeon/models/{OTHER}", None,
                                                                            (401, 403, 403, 200)),
    Row("POST", "/sleep", f"/sleep?model={OTHER}", None,                    (401, 403, 403, 200)),
    Row("POST", "/sleep", "/sleep", None,                                   (401, 403, 403, 200)),
    Row("POST", "/wake_up", f"/wake_up?model={OTHER}", None,                (401, 403, 403, 200)),
    Row("GET", "/is_sleeping", f"/is_sleeping?model={OTHER}", None,         (401, 403, 403, 200)),
    Row("GET", "/is_sleeping", "/is_sleeping?model=no-such-model", None,    (401, 403, 403, 404)),
]
# fmt: on
