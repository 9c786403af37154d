"""Fuzzing every API (Messages, Responses, Chat Completions) over real sockets:
whatever a client sends, the answer is a 4xx or a success - never a 5xx, never
a hang, never a traceback in the log - and the engine is still serving at the
end.

The server runs as ``mlxtrio serve`` in its own process (Hypothesis drives a
synchronous client), on the scripted model with small output caps so that the
bodies that are valid generate quickly. Bodies come from four families:

* the request models' own JSON schemas (``hypothesis-jsonschema``): valid-shaped
  requests with values at the edges of every range;
* a valid request with fields replaced by arbitrary JSON, or deleted, anywhere
  in its tree (wrong types, huge numbers, surrogates, deep structures);
* raw bytes: hand-written nasties that break parsers, and random bytes;
* odd paths and ids on the retrieval routes.

Bounded to about a minute; examples are derandomized so CI runs are repeatable.
"""

from __future__ import annotations

import json
import subprocess
import sys
import tempfile
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from mlxtrio.api.chat_completions.requests import ChatCompletionRequest
from mlxtrio.api.messages.requests import MessagesRequest
from mlxtrio.api.responses.requests import ResponsesRequest

from .conftest import SCRIPTED, free_port

BIN = Path(sys.executable).parent
PORT = free_port()
FUZZ = settings(
    derandomize=True,
    database=None,
    deadline=None,
    suppress_health_check=list(HealthCheck),
)
JSON_HEADERS = {"Content-Type": "application/json"}


@pytest.fixture(scope="module")
def server(scripted_model_path: str) -> Iterator[httpx.Client]:
    data_dir = tempfile.mkdtemp(prefix="mlxtrio-fuzz-")
    log_path = Path(data_dir) / "server.log"
    with open(log_path, "wb") as log:
        proc = subprocess.Popen(
            [
                str(BIN / "mlxtrio"),
                "serve",
                "--port",
                str(PORT),
                "--model",
                scripted_model_path,
                "--model-name",
                SCRIPTED,
                "--data-dir",
                data_dir,
                "--default-max-tokens",
                "4",
                "--max-output-tokens",
                "8",
                "--waiting-room",
                "64",
            ],
            stdout=log,
            stderr=subprocess.STDOUT,
        )
    client = httpx.Client(base_url=f"http://127.0.0.1:{PORT}", timeout=30)
    try:
        _wait_healthy(client, proc)
        yield client
        # The engine is still serving, and nothing reached the log as a crash.
        health = client.get("/health")
        assert health.status_code == 200, health.text
        r = client.post("/v1/responses", json={"model": SCRIPTED, "input": "hi"})
        assert r.status_code == 200 and r.json()["output_text"] == "Hello world."
        logged = log_path.read_text(errors="replace")
        for sign in ("Traceback", "unhandled error", "stream producer failed", "engine thread"):
            assert sign not in logged, logged[-4000:]
    finally:
        client.close()
        proc.terminate()
        proc.wait(timeout=30)


def _wait_healthy(client: httpx.Client, proc: subprocess.Popen[bytes]) -> None:
    import time

    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        assert proc.poll() is None, "the server exited"
        try:
            if client.get("/health").status_code == 200:
                return
        except httpx.TransportError:
            pass
        time.sleep(0.1)
    raise AssertionError("the fuzz server did not become ready")


def check(r: httpx.Response) -> None:
    """Every answer is a success or a client error in a JSON envelope (or SSE)."""
    assert r.status_code < 500, (r.status_code, r.text[:500])
    if r.headers.get("content-type", "").startswith("text/event-stream"):
        assert r.status_code == 200
        return
    body = r.json()
    if r.status_code >= 400:
        assert "error" in body, body


def post(client: httpx.Client, path: str, body: Any) -> None:
    content = json.dumps(body) if not isinstance(body, bytes) else body
    r = client.post(path, content=content, headers=JSON_HEADERS)
    check(r)
    if path == CHAT_PATH:
        check_openai_envelope(r)


CHAT_PATH = "/v1/chat/completions"


def check_openai_envelope(r: httpx.Response) -> None:
    """A client error on an OpenAI route is JSON in OpenAI's envelope:
    ``{"error": {"type", "message", "param", "code"}}``."""
    if r.status_code < 400:
        return
    assert r.headers.get("content-type", "").startswith("application/json"), r.headers
    body = r.json()
    assert set(body) == {"error"}, body
    error = body["error"]
    assert set(error) == {"type", "message", "param", "code"}, error
    assert isinstance(error["type"], str) and error["type"], error
    assert isinstance(error["message"], str) and error["message"], error
    assert error["param"] is None or isinstance(error["param"], str), error


# -- arbitrary JSON ----------------------------------------------------------------

SCALARS = (
    st.none()
    | st.booleans()
    | st.integers(min_value=-(2**70), max_value=2**70)
    | st.floats(allow_nan=False, allow_infinity=False)
    | st.text(max_size=20)  # lone surrogates included: json.dumps escapes them
    | st.sampled_from(["", "auto", "none", "required", "any", "tool", "text", "user", "-1"])
)
ANY_JSON = st.recursive(
    SCALARS,
    lambda children: (
        st.lists(children, max_size=4)
        | st.dictionaries(
            st.sampled_from(["type", "name", "text", "content", "role", "input", "tools"])
            | st.text(max_size=8),
            children,
            max_size=4,
        )
    ),
    max_leaves=12,
)

# -- a valid body, then replaced or deleted fields anywhere in it ---------------------

MESSAGES_BASE: dict[str, Any] = {
    "model": SCRIPTED,
    "max_tokens": 4,
    "system": [{"type": "text", "text": "be brief"}],
    "messages": [
        {"role": "user", "content": [{"type": "text", "text": "hi"}]},
        {
            "role": "assistant",
            "content": [
                {"type": "thinking", "thinking": "hm", "signature": "x"},
                {"type": "tool_use", "id": "toolu_1", "name": "get_weather", "input": {}},
            ],
        },
        {
            "role": "user",
            "content": [{"type": "tool_result", "tool_use_id": "toolu_1", "content": "sunny"}],
        },
    ],
    "tools": [
        {
            "name": "get_weather",
            "description": "weather",
            "input_schema": {"type": "object", "properties": {"city": {"type": "string"}}},
        }
    ],
    "tool_choice": {"type": "auto"},
    "thinking": {"type": "enabled", "budget_tokens": 16},
    "stop_sequences": ["END"],
    "temperature": 0.5,
    "top_p": 0.9,
    "top_k": 5,
    "metadata": {"user_id": "u"},
}
RESPONSES_BASE: dict[str, Any] = {
    "model": SCRIPTED,
    "instructions": "be brief",
    "input": [
        {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "hi"}]},
        {"type": "function_call", "call_id": "c1", "name": "get_weather", "arguments": "{}"},
        {"type": "function_call_output", "call_id": "c1", "output": "sunny"},
        {"type": "reasoning", "summary": [{"type": "summary_text", "text": "hm"}]},
    ],
    "tools": [
        {"type": "function", "name": "get_weather", "parameters": {"type": "object"}},
        {"type": "custom", "name": "apply_patch", "format": {"type": "text"}},
        {
            "type": "namespace",
            "name": "ns",
            "tools": [{"type": "function", "name": "inner", "parameters": {}}],
        },
        {"type": "web_search"},
    ],
    "tool_choice": "auto",
    "reasoning": {"effort": "low", "summary": "auto"},
    "text": {"format": {"type": "text"}, "verbosity": "low"},
    "max_output_tokens": 4,
    "temperature": 1.0,
    "top_p": 0.5,
    "seed": 7,
    "presence_penalty": 0.5,
    "frequency_penalty": -0.5,
    "top_logprobs": 2,
    "include": ["reasoning.encrypted_content"],
    "prompt_cache_key": "k",
    "cache_salt": "s",
    "metadata": {"retention_seconds": 600},
    "store": True,
    "parallel_tool_calls": False,
}


CHAT_BASE: dict[str, Any] = {
    "model": SCRIPTED,
    "messages": [
        {"role": "system", "content": "be brief"},
        {"role": "developer", "content": [{"type": "text", "text": "answer"}]},
        {
            "role": "user",
            "name": "u",
            "content": [
                {"type": "text", "text": "hi"},
                {"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}},
            ],
        },
        {
            "role": "assistant",
            "content": None,
            "reasoning_content": "hm",
            "tool_calls": [
                {
                    "id": "call_1",
                    "type": "function",
                    "function": {"name": "get_weather", "arguments": '{"city": "Oslo"}'},
                },
                {"id": "call_2", "type": "custom", "custom": {"name": "apply_patch", "input": "x"}},
            ],
        },
        {"role": "tool", "tool_call_id": "call_1", "content": "sunny"},
        {"role": "tool", "tool_call_id": "call_2", "content": [{"type": "text", "text": "ok"}]},
    ],
    "tools": [
        {
            "type": "function",
            "function": {
                "name": "get_weather",
                "description": "weather",
                "parameters": {"type": "object", "properties": {"city": {"type": "string"}}},
                "strict": False,
            },
        },
        {"type": "custom", "custom": {"name": "apply_patch", "format": {"type": "text"}}},
    ],
    "tool_choice": "auto",
    "parallel_tool_calls": False,
    "response_format": {
        "type": "json_schema",
        "json_schema": {"name": "r", "schema": {"type": "object"}, "strict": False},
    },
    "max_tokens": 4,
    "max_completion_tokens": 4,
    "temperature": 0.5,
    "top_p": 0.9,
    "presence_penalty": 0.5,
    "frequency_penalty": -0.5,
    "seed": 7,
    "stop": ["END"],
    "n": 1,
    "logprobs": False,
    "stream_options": {"include_usage": True},
    "reasoning_effort": "low",
    "chat_template_kwargs": {"enable_thinking": False},
    "prompt_cache_key": "k",
    "user": "u",
    "metadata": {"k": "v"},
    "store": False,
}


def _paths(node: Any, prefix: tuple[Any, ...] = ()) -> Iterator[tuple[Any, ...]]:
    yield prefix
    if isinstance(node, dict):
        for key, value in node.items():
            yield from _paths(value, (*prefix, key))
    elif isinstance(node, list):
        for index, value in enumerate(node):
            yield from _paths(value, (*prefix, index))


def _edit(body: Any, path: tuple[Any, ...], value: Any, delete: bool) -> Any:
    """A copy of ``body`` with the node at ``path`` replaced (or deleted)."""
    if not path:
        return value
    copy = json.loads(json.dumps(body))
    parent = copy
    for step in path[:-1]:
        parent = parent[step]
    if delete:
        del parent[path[-1]]
    else:
        parent[path[-1]] = value
    return copy


def mutated(base: dict[str, Any]) -> st.SearchStrategy[Any]:
    paths = [p for p in _paths(base) if p]
    edit = st.tuples(st.sampled_from(paths), ANY_JSON, st.booleans())

    def apply(edits: list[tuple[tuple[Any, ...], Any, bool]], stream: bool) -> Any:
        body: Any = {**base, "stream": stream}
        for path, value, delete in edits:
            try:
                body = _edit(body, path, value, delete)
            except (KeyError, IndexError, TypeError):
                pass  # an earlier edit removed or replaced the path
        return body

    return st.builds(apply, st.lists(edit, min_size=1, max_size=3), st.booleans())


@settings(FUZZ, max_examples=250)
@given(body=mutated(MESSAGES_BASE), count=st.booleans())
def test_messages_bodies_with_broken_fields(server: httpx.Client, body: Any, count: bool) -> None:
    post(server, "/v1/messages/count_tokens" if count else "/v1/messages", body)


@settings(FUZZ, max_examples=250)
@given(body=mutated(RESPONSES_BASE))
def test_responses_bodies_with_broken_fields(server: httpx.Client, body: Any) -> None:
    post(server, "/v1/responses", body)


@settings(FUZZ, max_examples=250)
@given(body=mutated(CHAT_BASE))
def test_chat_completions_bodies_with_broken_fields(server: httpx.Client, body: Any) -> None:
    post(server, CHAT_PATH, body)


# -- bodies from the request models' JSON schemas ------------------------------------


def from_model_schema(model: Any) -> st.SearchStrategy[Any]:
    from hypothesis_jsonschema import from_schema

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        schema = model.model_json_schema()
    # The generated model name is not served: point every body at ours.
    return from_schema(schema).map(lambda body: {**body, "model": SCRIPTED})


@settings(FUZZ, max_examples=12)
@given(body=from_model_schema(MessagesRequest))
def test_messages_bodies_from_the_schema(server: httpx.Client, body: Any) -> None:
    post(server, "/v1/messages", body)


@settings(FUZZ, max_examples=12)
@given(body=from_model_schema(ResponsesRequest))
def test_responses_bodies_from_the_schema(server: httpx.Client, body: Any) -> None:
    post(server, "/v1/responses", body)


@settings(FUZZ, max_examples=12)
@given(body=from_model_schema(ChatCompletionRequest))
def test_chat_completions_bodies_from_the_schema(server: httpx.Client, body: Any) -> None:
    post(server, CHAT_PATH, body)


# -- raw bytes ------------------------------------------------------------------------

NASTIES = [
    b"[" * 100_000 + b"]" * 100_000,
    b'{"a":' * 50_000 + b"1" + b"}" * 50_000,
    b'{"model": "scripted", "max_tokens": ' + b"9" * 5000 + b', "messages": []}',
    b'{"model": "scripted", "input": "hi", "user": "\\ud800"}',
    b'{"model": "scripted", "input": "hi", "tool_choice": "\\udfff"}',
    b'{"model": "scripted", "input": "hi", "prompt_cache_key": "\\ud800\\ud800"}',
    b'{"model": "scripted", "input": "hi", "cache_salt": "\\udc00"}',
    b'{"model": "scripted", "input": "hi", "previous_response_id": "\\ud800"}',
    b'{"model": "scripted", "input": "hi", "tools": [{"type": "namespace", "tools": 5}]}',
    b'{"model": "scripted", "input": "hi", "temperature": 1e999}',
    b'{"model": "scripted", "input": "hi", "seed": -1e308}',
    b'{"model": "scripted", "input": "hi", "seed": 18446744073709551616}',
    b'{"model": "scripted", "input": "hi", "max_output_tokens": 0.5}',
    b'{"model": "\x00", "input": "hi"}',
    # JSON inside a JSON string: tool-call arguments the server parses itself.
    b'{"model": "scripted", "input": [{"type": "function_call", "call_id": "c", "name": "f", '
    b'"arguments": "' + b"9" * 5000 + b'"}, {"type": "function_call_output", "call_id": "c", '
    b'"output": "x"}]}',
    b'{"model": "scripted", "input": [{"type": "function_call", "call_id": "c", "name": "f", '
    b'"arguments": "' + b"[" * 100_000 + b'"}, {"type": "function_call_output", "call_id": "c", '
    b'"output": "x"}]}',
    b"\xef\xbb\xbf{}",
    b"\x00" * 64,
    b"null",
    b'"hi"',
    b"",
    # Chat Completions: the same traps in its own fields.
    b'{"model": "scripted", "messages": [{"role": "user", "content": "\ud800"}]}',
    b'{"model": "scripted", "messages": [{"role": "user", "content": "hi"}], "stop": "\udfff"}',
    b'{"model": "scripted", "messages": [{"role": "user", "content": "hi"}], "max_tokens": '
    + b"9" * 5000
    + b"}",
    b'{"model": "scripted", "messages": [{"role": "user", "content": "hi"}], "seed": 1e999}',
    b'{"model": "scripted", "messages": [{"role": "user", "content": "hi"}], "n": 1e308}',
    b'{"model": "scripted", "messages": [{"role": "user", "content": "hi"}], '
    b'"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": '
    + b"[" * 100_000
    + b"]" * 100_000
    + b"}}}",
    b'{"model": "scripted", "messages": [{"role": "user", "content": "q"}, {"role": "assistant", '
    b'"tool_calls": [{"id": "c", "type": "function", "function": {"name": "f", "arguments": "'
    + b"[" * 100_000
    + b'"}}]}, {"role": "tool", "tool_call_id": "c", "content": "x"}]}',
    b'{"model": "scripted", "messages": [{"role": "user", "content": "hi"}], "tools": '
    b'[{"type": "function", "function": {"name": "f", "parameters": {"$ref": "#"}}}], '
    b'"tool_choice": "required"}',
]


@pytest.mark.parametrize("raw", NASTIES, ids=range(len(NASTIES)))
@pytest.mark.parametrize(
    "path", ["/v1/responses", "/v1/messages", "/v1/messages/count_tokens", CHAT_PATH]
)
def test_nasty_bytes(server: httpx.Client, raw: bytes, path: str) -> None:
    post(server, path, raw)


@settings(FUZZ, max_examples=60)
@given(raw=st.binary(max_size=300), path=st.sampled_from(["/v1/responses", "/v1/messages"]))
def test_random_bytes(server: httpx.Client, raw: bytes, path: str) -> None:
    post(server, path, raw)


@settings(FUZZ, max_examples=60)
@given(raw=st.binary(max_size=300))
def test_random_bytes_on_chat_completions(server: httpx.Client, raw: bytes) -> None:
    post(server, CHAT_PATH, raw)


@settings(FUZZ, max_examples=60)
@given(
    response_id=st.text(min_size=1, max_size=80).filter(lambda s: "/" not in s and s not in ".."),
    method=st.sampled_from(["GET", "DELETE"]),
    suffix=st.sampled_from(["", "/input_items", "/input_items?limit=abc&order=x&after=%00"]),
)
def test_retrieval_with_odd_ids(
    server: httpx.Client, response_id: str, method: str, suffix: str
) -> None:
    from urllib.parse import quote

    path = "/v1/responses/" + quote(response_id, safe="", errors="surrogatepass") + suffix
    check(server.request(method, path))
