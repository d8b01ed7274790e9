"""Security limits: the API key, body and prompt sizes, per-request limits, no chat template
or model path from a request, and no internals in any error body."""

from __future__ import annotations

import hashlib
import json
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any
from urllib.parse import quote

import httpx
import pytest

import app.chat_template
import app.http_input
from app.http_input import api_key_matches
from tests._embedded_model import embedded_gguf_path
from tests.app import test_server_errors as bad_requests
from tests.app._fault_injection import leaked_markers
from tests.app._server_fixtures import MAX_MODEL_LEN, RunningServer

pytestmark = pytest.mark.slow

API_KEY = bad_requests.API_KEY
AUTH = {"Authorization": f"Bearer {API_KEY}"}
MAX_BODY_BYTES = bad_requests.MAX_BODY_BYTES
CHAT = "/v1/chat/completions"
CMPL = "/v1/completions"
MSGS = [{"role": "user", "content": "Hi"}]


@pytest.fixture(scope="module")
def server() -> Iterator[RunningServer]:
    with RunningServer(api_key=API_KEY, max_request_body_bytes=MAX_BODY_BYTES) as running:
        yield running


# ---- API key ---------------------------------------------------------------------------

PROTECTED = [
    ("POST", CHAT, {"messages": MSGS, "max_tokens": 1}),
    ("POST", CMPL, {"prompt": "Hi", "max_tokens": 1}),
    ("GET", "/v1/models", None),
    ("GET", "/v1/models/SmolLM2-135M-Instruct", None),
    ("POST", "/tokenize", {"prompt": "Hi"}),
    ("POST", "/detokenize", {"tokens": [1, 2]}),
]
BAD_AUTH: list[dict[str, Any]] = [
    {},
    {"Authorization": ""},
    {"Authorization": "Bearer"},
    {"Authorization": API_KEY},
    {"Authorization": f"Basic {API_KEY}"},
    {"Authorization": f"Bearer {API_KEY}x"},
    {"Authorization": f"Bearer {API_KEY[:-1]}"},
    {"Authorization": f"Bearer {API_KEY.upper()}"},
    {"Authorization": f"Bearer {API_KEY[:3]} {API_KEY[3:]}"},
    {"Authorization": f"Bearer {API_KEY}\u00e9".encode()},
    {"Authorization": "Bearer sk-t\u00ebst-key".encode()},
    {"Authorization": b"Bearer \xff\xfe\x00"[:-1]},
    {"X-Api-Key": API_KEY},
]


@pytest.mark.parametrize("method,path,body", PROTECTED, ids=[p[1] for p in PROTECTED])
def test_protected_routes_refuse_every_wrong_key(
    http: httpx.Client, method: str, path: str, body: Any
) -> None:
    for headers in BAD_AUTH:
        response = http.request(method, path, json=body, headers=headers)
        assert response.status_code == 401, (headers, response.text)
        assert response.json()["error"]["type"] == "AuthenticationError"
        assert API_KEY not in response.text
    ok = http.request(method, path, json=body, headers=AUTH)
    assert ok.status_code == 200, ok.text


def test_a_refusal_before_the_body_is_read_closes_its_connection(http: httpx.Client) -> None:
    """The server does not read the body of a request it refuses at the door; it says it
    closes the connection, so a keep-alive client never reuses it (before this, every few
    requests after such a refusal failed with 'Server disconnected')."""
    for _ in range(30):
        refused = http.post(
            CHAT,
            json={"messages": MSGS, "max_tokens": 1},
            headers={"Authorization": "Bearer wrong"},
        )
        assert refused.status_code == 401 and refused.headers["connection"] == "close"
        assert http.get("/health").status_code == 200
    form = http.post(
        CMPL,
        content=b"prompt=hi",
        headers={**AUTH, "Content-Type": "application/x-www-form-urlencoded"},
    )
    assert form.status_code == 415 and form.headers["connection"] == "close"
    read = http.post(CMPL, json={"prompt": "Hi", "max_tokens": 0}, headers=AUTH)
    assert read.status_code == 400 and "close" not in read.headers.get("connection", "")


def test_surrounding_whitespace_and_scheme_case_are_tolerated(http: httpx.Client) -> None:
    # (Trailing whitespace is optional whitespace in HTTP: never part of a header value.)
    for header in (f"Bearer  {API_KEY}", f"bearer {API_KEY}", f"BEARER \t{API_KEY}"):
        assert http.get("/v1/models", headers={"Authorization": header}).status_code == 200


def test_open_routes_need_no_key(http: httpx.Client) -> None:
    for path in ("/health", "/metrics", "/version", "/openapi.json"):
        assert http.get(path).status_code == 200, path


def test_a_unicode_key_is_compared_as_utf8_bytes() -> None:
    unicode_key = "cl\u00e9-\u00fc\u4e2d-\u2603"
    server = RunningServer(api_key=unicode_key)
    try:
        url = server.url + "/v1/models"
        right = httpx.get(url, headers={"Authorization": f"Bearer {unicode_key}".encode()})
        assert right.status_code == 200
        latin1 = httpx.get(
            url,
            headers={
                "Authorization": f"Bearer {unicode_key}".encode().decode("latin-1").encode("utf-8")
            },
        )
        assert latin1.status_code == 401
        assert httpx.get(url, headers={"Authorization": b"Bearer cl\xe9"}).status_code == 401
    finally:
        server.stop()


def test_the_key_is_compared_in_constant_time(monkeypatch: pytest.MonkeyPatch) -> None:
    compared: list[tuple[bytes, bytes]] = []
    real = app.http_input.hmac.compare_digest

    def spy(a: bytes, b: bytes) -> bool:
        compared.append((a, b))
        return real(a, b)

    monkeypatch.setattr(app.http_input.hmac, "compare_digest", spy)
    assert api_key_matches("k", "a-much-longer-key") is False
    assert api_key_matches("a-much-longer-key", "a-much-longer-key")
    # Every comparison went through hmac.compare_digest, on equal-length digests, so
    # neither the key's content nor its length shows in the timing.
    assert len(compared) == 2
    assert all(len(a) == len(b) == hashlib.sha256().digest_size for a, b in compared)


# ---- sizes and per-request limits ------------------------------------------------------


def test_body_limit_applies_to_declared_and_chunked_bodies(http: httpx.Client) -> None:
    big = json.dumps({"messages": [{"role": "user", "content": "x" * MAX_BODY_BYTES}]}).encode()
    declared = http.post(CHAT, content=big, headers={**AUTH, "Content-Type": "application/json"})
    assert declared.status_code == 413

    def chunks() -> Iterator[bytes]:  # no Content-Length: the limit must count bytes read
        for start in range(0, len(big), 8192):
            yield big[start : start + 8192]

    chunked = http.post(
        CHAT, content=chunks(), headers={**AUTH, "Content-Type": "application/json"}
    )
    assert chunked.status_code == 413 and chunked.json()["error"]["code"] == 413


def test_prompt_token_limit(http: httpx.Client) -> None:
    for path, body in (
        (CMPL, {"prompt": [1] * MAX_MODEL_LEN, "max_tokens": 1}),
        (CMPL, {"prompt": [[1] * 10, [1] * MAX_MODEL_LEN], "max_tokens": 1}),
        (CHAT, {"messages": [{"role": "user", "content": "hi " * MAX_MODEL_LEN}], "max_tokens": 1}),
    ):
        response = http.post(path, json=body, headers=AUTH)
        assert response.status_code == 400 and response.json()["error"]["param"] == "input_tokens"
        assert "maximum context length" in response.json()["error"]["message"]
    # The limit applies after truncate_prompt_tokens (which keeps the prompt's end).
    truncated = http.post(
        CMPL,
        json={"prompt": [1] * (MAX_MODEL_LEN + 50), "max_tokens": 1, "truncate_prompt_tokens": 8},
        headers=AUTH,
    )
    assert truncated.status_code == 200 and truncated.json()["usage"]["prompt_tokens"] == 8


def _vocab_ids(count: int) -> list[int]:
    return list(range(1000, 1000 + count))


# (field values at the limit, the same one past it, the param named in the 400)
LIMITS = [
    ({"n": 16}, {"n": 17}, "n"),
    ({"stop": [f"s{i}" for i in range(16)]}, {"stop": [f"s{i}" for i in range(17)]}, "stop"),
    ({"stop": ["y" * 256]}, {"stop": ["y" * 257]}, "stop"),
    (
        {"logit_bias": {str(t): 1 for t in _vocab_ids(300)}},
        {"logit_bias": {str(t): 1 for t in _vocab_ids(301)}},
        "logit_bias",
    ),
    (
        {"logprobs": True, "top_logprobs": 20},
        {"logprobs": True, "top_logprobs": 21},
        "top_logprobs",
    ),
]


@pytest.mark.parametrize("at_limit,past_limit,param", LIMITS, ids=[c[2] for c in LIMITS])
def test_per_request_limits(
    http: httpx.Client, at_limit: dict[str, Any], past_limit: dict[str, Any], param: str
) -> None:
    base = {"messages": MSGS, "max_tokens": 1}
    accepted = http.post(CHAT, json={**base, **at_limit}, headers=AUTH)
    assert accepted.status_code == 200, accepted.text
    refused = http.post(CHAT, json={**base, **past_limit}, headers=AUTH)
    assert refused.status_code == 400 and refused.json()["error"]["param"] == param, refused.text


def test_completion_logprobs_limit(http: httpx.Client) -> None:
    ok = http.post(CMPL, json={"prompt": "Hi", "max_tokens": 1, "logprobs": 20}, headers=AUTH)
    assert ok.status_code == 200
    refused = http.post(CMPL, json={"prompt": "Hi", "max_tokens": 1, "logprobs": 21}, headers=AUTH)
    assert refused.status_code == 400 and refused.json()["error"]["param"] == "logprobs"


def test_many_prompts_times_n_beyond_capacity_is_refused(http: httpx.Client) -> None:
    response = http.post(
        CMPL, json={"prompt": ["Hi"] * 100, "n": 16, "max_tokens": 1}, headers=AUTH
    )
    assert response.status_code == 400 and response.json()["error"]["param"] == "n"


# ---- no chat template and no model path from a request ---------------------------------

PAYLOAD = "{{ 'PWNED' }}{% for x in ().__class__.__base__.__subclasses__() %}{% endfor %}"


@pytest.fixture()
def compiled_templates(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """Every template the server compiles while the test runs (in this process)."""
    seen: list[str] = []
    real = app.chat_template.compile_chat_template

    def spy(template: str) -> Any:
        seen.append(template)
        return real(template)

    monkeypatch.setattr(app.chat_template, "compile_chat_template", spy)
    return seen


@pytest.mark.parametrize(
    "path,body,param",
    [
        (CHAT, {"messages": MSGS, "chat_template": PAYLOAD}, "chat_template"),
        (CHAT, {"messages": MSGS, "chat_template": ""}, "chat_template"),
        (
            CHAT,
            {"messages": MSGS, "chat_template_kwargs": {"chat_template": PAYLOAD}},
            "chat_template_kwargs",
        ),
        (
            CHAT,
            {"messages": MSGS, "chat_template_kwargs": {"template": PAYLOAD}},
            "chat_template_kwargs",
        ),
        (
            CHAT,
            {"messages": MSGS, "chat_template_kwargs": {"messages": PAYLOAD}},
            "chat_template_kwargs",
        ),
        (
            CHAT,
            {"messages": MSGS, "chat_template_kwargs": {"add_generation_prompt": PAYLOAD}},
            "chat_template_kwargs",
        ),
        ("/tokenize", {"messages": MSGS, "chat_template": PAYLOAD}, "chat_template"),
        (
            "/tokenize",
            {"messages": MSGS, "chat_template_kwargs": {"chat_template": PAYLOAD}},
            "chat_template_kwargs",
        ),
    ],
    ids=[
        "chat field",
        "empty chat field",
        "kwargs chat_template",
        "kwargs template",
        "kwargs messages",
        "kwargs add_generation_prompt",
        "tokenize field",
        "tokenize kwargs",
    ],
)
def test_a_chat_template_never_comes_from_a_request(
    http: httpx.Client, compiled_templates: list[str], path: str, body: dict[str, Any], param: str
) -> None:
    response = http.post(path, json={**body, "max_tokens": 2}, headers=AUTH)
    assert response.status_code == 400, response.text
    assert response.json()["error"]["param"] == param
    assert "PWNED" not in response.text
    assert all("PWNED" not in template for template in compiled_templates)


def test_template_kwargs_stay_plain_variables(
    http: httpx.Client, compiled_templates: list[str]
) -> None:
    # A kwarg holding template syntax is a string value, never compiled or evaluated.
    response = http.post(
        "/tokenize",
        json={"messages": MSGS, "chat_template_kwargs": {"bos_token": PAYLOAD}},
        headers=AUTH,
    )
    assert response.status_code == 200
    assert compiled_templates  # the model's own template, through the spy
    assert all("PWNED" not in template for template in compiled_templates)


@pytest.fixture()
def opened_paths() -> Iterator[list[str]]:
    """Paths the process opens while the test runs (audit hooks cannot be removed, so this
    one is switched off afterwards)."""
    seen: list[str] = []
    active = [True]

    def hook(event: str, args: tuple[Any, ...]) -> None:
        if active[0] and event == "open" and args and isinstance(args[0], (str, bytes)):
            seen.append(args[0] if isinstance(args[0], str) else args[0].decode(errors="replace"))

    sys.addaudithook(hook)
    yield seen
    active[0] = False


def test_model_paths_are_never_taken_from_requests(
    http: httpx.Client, opened_paths: list[str]
) -> None:
    model_file = embedded_gguf_path()
    other_file = str(Path(__file__).resolve())
    for model in (model_file, other_file, "../../../../etc/passwd", "/etc/hostname"):
        for method, path, body in (
            ("POST", CHAT, {"messages": MSGS, "model": model}),
            ("POST", CMPL, {"prompt": "Hi", "model": model}),
            ("POST", "/tokenize", {"prompt": "Hi", "model": model}),
            ("GET", f"/v1/models/{quote(model, safe='')}", None),
        ):
            response = http.request(method, path, json=body, headers=AUTH)
            assert response.status_code == 404, (model, path, response.text)
            assert response.json()["error"]["param"] == "model"
    with open(other_file, "rb"):  # the hook sees opens (of this test, not the server's)
        pass
    assert opened_paths.count(other_file) == 1
    opened_paths.remove(other_file)
    touched = [
        p
        for p in opened_paths
        if any(
            name in p
            for name in (Path(model_file).name, Path(other_file).name, "passwd", "hostname")
        )
    ]
    assert touched == []


# ---- no internals in error bodies ------------------------------------------------------


def test_no_error_body_carries_a_stack_trace_or_a_path(http: httpx.Client) -> None:
    """Every case of the bad-request table, replayed here, and scanned."""
    scanned = 0
    for case in bad_requests.CASES:
        headers = dict(case.headers)
        content = (
            case.raw
            if case.raw is not None
            else (None if case.body is None else json.dumps(case.body).encode())
        )
        if content is not None:
            headers.setdefault("Content-Type", "application/json")
        response = http.request(case.method, case.path, content=content, headers=headers)
        assert response.status_code >= 400
        assert (
            leaked_markers(response.text, (content or b"").decode(errors="replace") + case.path)
            == []
        ), (case.name, response.text)
        scanned += 1
    assert scanned == len(bad_requests.CASES) >= 40
