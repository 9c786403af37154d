"""Requests are parsed into models at the edge: every field's type and official
range, the error envelope of each API (Messages, Responses, Chat Completions)
naming the field, the edge values that must pass, the real clients' bodies,
and the Response object's conformance."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import pytest

from mlxtrio.api.messages.convert import to_conversation
from mlxtrio.api.messages.requests import CountTokensRequest, MessagesRequest
from mlxtrio.api.responses.convert import map_items, offered_tools
from mlxtrio.api.responses.requests import ResponsesRequest
from mlxtrio.api.validation import parse
from mlxtrio.http.errors import ApiError

from . import agent_fixtures
from .conftest import SCRIPTED, Server
from .schemas import SCHEMA_DIR

SPEC_DIR = Path(os.environ.get("MLXTRIO_SPEC_DIR", "/work/shared/spec"))
WEATHER = {
    "type": "function",
    "name": "get_weather",
    "description": "Weather for a city.",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}},
}


def _captured(path_prefix: str) -> list[dict[str, Any]]:
    """Bodies the real clients sent (shared/spec/captures), if present here."""
    bodies = []
    for file in sorted((SPEC_DIR / "captures").glob("*.json")):
        for request in json.loads(file.read_text())["requests"]:
            if request["path"].startswith(path_prefix) and isinstance(request["body"], dict):
                bodies.append(request["body"])
    return bodies


# -- nothing a real client sends is rejected ----------------------------------------

CLAUDE_BODIES = _captured("/v1/messages") + [
    agent_fixtures.claude_plain(SCRIPTED),
    agent_fixtures.claude_toolcall(SCRIPTED),
]
CODEX_BODIES = _captured("/v1/responses") + [
    getattr(agent_fixtures, name)(SCRIPTED)
    for name in ("codex_plain", "codex_toolcall", "codex_patch", "codex_patch_first")
]


@pytest.mark.parametrize("body", CLAUDE_BODIES)
def test_claude_code_bodies_parse_and_map(body: dict[str, Any]) -> None:
    request = parse(MessagesRequest, body)
    assert parse(CountTokensRequest, body).model == request.model
    conversation = to_conversation(request)
    assert conversation.messages and conversation.tools and conversation.thinking
    assert request.wire() == body  # every field kept, none invented


@pytest.mark.parametrize("body", CODEX_BODIES)
def test_codex_bodies_parse_and_map(body: dict[str, Any]) -> None:
    request = parse(ResponsesRequest, body)
    assert map_items(request.items)
    assert offered_tools(request)
    assert request.wire() == body


def test_captures_were_replayed_when_present() -> None:
    if not (SPEC_DIR / "captures").is_dir():
        pytest.skip(f"no captures at {SPEC_DIR}")
    assert len(_captured("/v1/messages")) >= 3 and len(_captured("/v1/responses")) >= 5


def test_parse_reports_the_first_problem_with_its_location() -> None:
    body = {"model": "m", "input": [{"role": "user", "content": [{"type": "input_text"}]}]}
    with pytest.raises(ApiError) as info:
        parse(ResponsesRequest, {**body, "temperature": 3})
    error = info.value
    assert (error.status, error.type, error.param) == (
        400,
        "invalid_request_error",
        "input.0.content.0.text",
    )
    assert error.message == "Missing required field: input.0.content.0.text"
    assert "pydantic" not in error.message


# -- invalid fields: a 400 naming the field ---------------------------------------------

MESSAGE = [{"role": "user", "content": "hi"}]
MESSAGES_BASE: dict[str, Any] = {"model": SCRIPTED, "max_tokens": 4, "messages": MESSAGE}
NAN = float("nan")

# (fields replacing the base body, text the message must contain)
MESSAGES_CASES: list[tuple[dict[str, Any], str]] = [
    ({"model": 5}, 'Field "model" must be a string'),
    ({"model": ""}, 'Field "model" must be a non-empty string'),
    ({"temperature": 1.5}, 'Field "temperature" must be a number between 0 and 1'),
    ({"temperature": -0.1}, '"temperature"'),
    ({"temperature": "0.5"}, '"temperature"'),
    ({"temperature": True}, '"temperature"'),
    ({"temperature": NAN}, ""),
    ({"top_p": 1.01}, 'Field "top_p" must be a number between 0 and 1'),
    ({"top_k": 0}, 'Field "top_k" must be an integer of at least 1'),
    ({"top_k": 2.5}, '"top_k"'),
    ({"top_k": True}, '"top_k"'),
    ({"max_tokens": 0}, 'Field "max_tokens" must be an integer between 1 and 2147483647'),
    ({"max_tokens": 2**31}, '"max_tokens"'),
    ({"max_tokens": 1.5}, '"max_tokens"'),
    ({"max_tokens": "5"}, '"max_tokens"'),
    ({"stream": "true"}, 'Field "stream" must be a boolean'),
    ({"stop_sequences": "STOP"}, 'Field "stop_sequences" must be an array'),
    ({"stop_sequences": ["a", 1]}, 'Field "stop_sequences.1" must be a string'),
    ({"thinking": {"type": "enabled", "budget_tokens": 0}}, '"thinking.budget_tokens"'),
    ({"thinking": {"type": "sometimes"}}, 'Unsupported type "sometimes" at thinking.type'),
    ({"thinking": "on"}, 'Field "thinking" must be an object'),
    ({"tool_choice": "auto"}, 'Field "tool_choice" must be an object'),
    ({"tool_choice": {"type": "tool"}}, "Missing required field: tool_choice.name"),
    ({"tool_choice": {"type": "maybe"}}, "tool_choice.type"),
    ({"tools": [5]}, 'Field "tools.0" must be an object'),
    ({"tools": [{"description": "no name"}]}, "Missing required field: tools.0.name"),
    ({"tools": [{"name": "f", "input_schema": []}]}, '"tools.0.input_schema"'),
    ({"system": 5}, 'Field "system" must be a string or an array of text blocks'),
    ({"system": [{"type": "text", "text": 5}]}, '"system.0.text"'),
    ({"messages": [{"role": "user"}]}, "Missing required field: messages.0.content"),
    ({"messages": [{"content": "x"}]}, "Missing required field: messages.0.role"),
    ({"messages": [{"role": "user", "content": 5}]}, '"messages.0.content" must be a string'),
    (
        {"messages": [{"role": "user", "content": [{"type": "text", "text": 5}]}]},
        'Field "messages.0.content.0.text" must be a string',
    ),
    (
        {"messages": [{"role": "user", "content": [{"type": "tool_use", "id": "a"}]}]},
        'Unsupported type "tool_use" at messages.0.content.0.type',
    ),
    (
        {
            "messages": [
                {"role": "user", "content": "q"},
                {
                    "role": "assistant",
                    "content": [{"type": "tool_use", "id": "a", "name": "f", "input": "x"}],
                },
            ]
        },
        'Field "messages.1.content.0.input" must be an object',
    ),
    (
        {"messages": [{"role": "user", "content": [{"type": "tool_result", "tool_use_id": ""}]}]},
        '"messages.0.content.0.tool_use_id" must be a non-empty string',
    ),
    (
        {"messages": [{"role": "user", "content": [{"type": "document", "source": {}}]}]},
        'Unsupported content block type: "document"',
    ),
]


async def test_messages_rejects_bad_fields_naming_them(scripted: Server) -> None:
    failures = []
    async with scripted.client() as client:
        for fields, text in MESSAGES_CASES:
            body = {**MESSAGES_BASE, **fields}
            for path in ("/v1/messages", "/v1/messages/count_tokens"):
                if path.endswith("count_tokens") and "max_tokens" in fields:
                    continue  # count_tokens takes max_tokens but never needs it
                r = await client.post(
                    path, content=json.dumps(body), headers={"Content-Type": "application/json"}
                )
                payload = r.json()
                error = payload.get("error", {})
                ok = (
                    r.status_code == 400
                    and payload.get("type") == "error"
                    and error.get("type") == "invalid_request_error"
                    and text in error.get("message", "")
                )
                if not ok:
                    failures.append((path, fields, r.status_code, payload))
    assert not failures, failures


RESPONSES_BASE: dict[str, Any] = {"model": SCRIPTED, "input": "hi", "max_output_tokens": 4}

# (fields replacing the base body, the error's param)
RESPONSES_CASES: list[tuple[dict[str, Any], str]] = [
    ({"model": 5}, "model"),
    ({"input": None}, "input"),
    ({"temperature": 2.5}, "temperature"),
    ({"temperature": -1}, "temperature"),
    ({"temperature": "1"}, "temperature"),
    ({"temperature": True}, "temperature"),
    ({"top_p": 1.5}, "top_p"),
    ({"presence_penalty": 2.5}, "presence_penalty"),
    ({"presence_penalty": -3}, "presence_penalty"),
    ({"frequency_penalty": "0"}, "frequency_penalty"),
    ({"seed": 2**64}, "seed"),
    ({"seed": -(2**63) - 1}, "seed"),
    ({"seed": 1.5}, "seed"),
    ({"seed": "1"}, "seed"),
    ({"seed": True}, "seed"),
    ({"max_output_tokens": 1.5}, "max_output_tokens"),
    ({"top_logprobs": 21}, "top_logprobs"),
    ({"top_logprobs": -1}, "top_logprobs"),
    ({"tools": "x"}, "tools"),
    ({"tools": [5]}, "tools.0"),
    ({"tools": [{"type": "namespace", "name": "ns", "tools": 5}]}, "tools.0.tools"),
    ({"tools": [{"type": "function"}]}, "tools.0.name"),
    ({"tools": [{"type": "function", "name": "f", "parameters": "x"}]}, "tools.0.parameters"),
    (
        {"tools": [{"type": "custom", "name": "c", "format": {"type": "regex"}}]},
        "tools.0.format.type",
    ),
    ({"tools": [{"name": "no type"}]}, "tools.0.type"),
    ({"tool_choice": "sometimes"}, "tool_choice"),
    ({"tool_choice": 5}, "tool_choice"),
    ({"tool_choice": {"type": "function"}}, "tool_choice.name"),
    ({"cache_salt": "x" * 257}, "cache_salt"),
    ({"cache_salt": "é" * 129}, "cache_salt"),  # 258 bytes
    ({"cache_salt": 5}, "cache_salt"),
    ({"prompt_cache_key": 5}, "prompt_cache_key"),
    ({"user": ["x"]}, "user"),
    ({"previous_response_id": 5}, "previous_response_id"),
    ({"safety_identifier": 5}, "safety_identifier"),
    ({"instructions": 5}, "instructions"),
    ({"metadata": "x"}, "metadata"),
    ({"metadata": {"retention_seconds": 59}}, "metadata.retention_seconds"),
    ({"metadata": {"retention_seconds": "60"}}, "metadata.retention_seconds"),
    ({"include": "reasoning.encrypted_content"}, "include"),
    ({"include": [5]}, "include.0"),
    ({"stream": "yes"}, "stream"),
    ({"store": 1}, "store"),
    ({"parallel_tool_calls": "no"}, "parallel_tool_calls"),
    ({"reasoning": "high"}, "reasoning"),
    ({"reasoning": {"effort": 5}}, "reasoning.effort"),
    ({"text": {"format": {"type": "yaml"}}}, "text.format.type"),
    ({"input": [5]}, "input.0"),
    ({"input": [{"role": "user", "content": 5}]}, "input.0.content"),
    ({"input": [{"role": "user", "content": [{"type": "input_file"}]}]}, "input.0.content.0.type"),
    ({"input": [{"type": "function_call_output", "output": "x"}]}, "input.0.call_id"),
    ({"input": [{"type": "function_call", "name": "f", "arguments": 5}]}, "input.0.arguments"),
    ({"input": [{"type": "reasoning", "summary": "x"}]}, "input.0.summary"),
]


async def test_responses_rejects_bad_fields_naming_them(scripted: Server) -> None:
    failures = []
    async with scripted.client() as client:
        for fields, param in RESPONSES_CASES:
            r = await client.post("/v1/responses", json={**RESPONSES_BASE, **fields})
            error = r.json().get("error") or {}
            ok = (
                r.status_code == 400
                and error.get("type") == "invalid_request_error"
                and error.get("param") == param
                and param in error.get("message", "")
                and "pydantic" not in error.get("message", "")
            )
            if not ok:
                failures.append((fields, r.status_code, r.json()))
    assert not failures, failures


CHAT_BASE: dict[str, Any] = {"model": SCRIPTED, "messages": MESSAGE, "max_tokens": 4}
CHAT_WEATHER = {"type": "function", "function": {k: v for k, v in WEATHER.items() if k != "type"}}
CALLED = [
    {"role": "user", "content": "q"},
    {
        "role": "assistant",
        "tool_calls": [
            {"id": "c1", "type": "function", "function": {"name": "f", "arguments": "{}"}}
        ],
    },
]

# (fields replacing the base body, the error's param); the message names it too.
CHAT_CASES: list[tuple[dict[str, Any], str]] = [
    ({"model": 5}, "model"),
    ({"model": ""}, "model"),
    ({"messages": None}, "messages"),
    ({"messages": "hi"}, "messages"),
    ({"messages": []}, "messages"),
    ({"messages": [5]}, "messages.0"),
    ({"messages": [{"content": "x"}]}, "messages.0.role"),
    ({"messages": [{"role": "robot", "content": "x"}]}, "messages.0.role"),
    ({"messages": [{"role": "user"}]}, "messages.0.content"),
    ({"messages": [{"role": "user", "content": 5}]}, "messages.0.content"),
    ({"messages": [{"role": "system", "content": [5]}]}, "messages.0.content.0"),
    (
        {"messages": [{"role": "user", "content": [{"type": "text", "text": 5}]}]},
        "messages.0.content.0.text",
    ),
    ({"messages": [{"role": "user", "content": [{"type": "video"}]}]}, "messages.0.content.0.type"),
    ({"messages": [{"role": "tool", "content": "x"}]}, "messages.0.tool_call_id"),
    ({"messages": [CALLED[0], {"role": "assistant", "tool_calls": "x"}]}, "messages.1.tool_calls"),
    (
        {
            "messages": [
                CALLED[0],
                {
                    "role": "assistant",
                    "tool_calls": [{"id": "c", "type": "function", "function": {"name": "f"}}],
                },
            ]
        },
        "messages.1.tool_calls.0.function.arguments",
    ),
    (
        {
            "messages": [
                CALLED[0],
                {"role": "assistant", "tool_calls": [{"id": "", "function": {}}]},
            ]
        },
        "messages.1.tool_calls.0.id",
    ),
    ({"temperature": 2.5}, "temperature"),
    ({"temperature": -1}, "temperature"),
    ({"temperature": "1"}, "temperature"),
    ({"temperature": True}, "temperature"),
    ({"top_p": 1.5}, "top_p"),
    ({"presence_penalty": 2.5}, "presence_penalty"),
    ({"frequency_penalty": "0"}, "frequency_penalty"),
    ({"seed": 2**64}, "seed"),
    ({"seed": 1.5}, "seed"),
    ({"seed": True}, "seed"),
    ({"max_tokens": 0}, "max_tokens"),
    ({"max_tokens": 2**31}, "max_tokens"),
    ({"max_tokens": 1.5}, "max_tokens"),
    ({"max_completion_tokens": "5"}, "max_completion_tokens"),
    ({"max_completion_tokens": 0}, "max_completion_tokens"),
    ({"n": 0}, "n"),
    ({"n": 2}, "n"),
    ({"logprobs": "yes"}, "logprobs"),
    ({"logprobs": True}, "logprobs"),
    ({"top_logprobs": 21}, "top_logprobs"),
    ({"logit_bias": {"1": 5}}, "logit_bias"),
    ({"functions": [{"name": "f"}]}, "functions"),
    ({"function_call": "auto"}, "function_call"),
    ({"audio": {"voice": "alloy", "format": "wav"}}, "audio"),
    ({"modalities": ["audio"]}, "modalities.0"),
    ({"stream": "yes"}, "stream"),
    ({"stream_options": "x"}, "stream_options"),
    ({"stream_options": {"include_usage": "yes"}}, "stream_options.include_usage"),
    ({"stop": 5}, "stop"),
    ({"stop": ["a", 1]}, "stop.1"),
    ({"stop": ["a", "b", "c", "d", "e"]}, "stop"),
    ({"tools": "x"}, "tools"),
    ({"tools": [5]}, "tools.0"),
    ({"tools": [{"function": {"name": "f"}}]}, "tools.0.type"),
    ({"tools": [{"type": "retrieval"}]}, "tools.0.type"),
    ({"tools": [{"type": "function"}]}, "tools.0.function"),
    ({"tools": [{"type": "function", "function": {}}]}, "tools.0.function.name"),
    (
        {"tools": [{"type": "function", "function": {"name": "f", "parameters": "x"}}]},
        "tools.0.function.parameters",
    ),
    (
        {
            "tools": [
                {
                    "type": "custom",
                    "custom": {
                        "name": "c",
                        "format": {"type": "grammar", "grammar": {"definition": "x", "syntax": 5}},
                    },
                }
            ]
        },
        "tools.0.custom.format.grammar.syntax",
    ),
    ({"tool_choice": "sometimes"}, "tool_choice"),
    ({"tool_choice": 5}, "tool_choice"),
    ({"tool_choice": {"type": "function"}}, "tool_choice.function"),
    (
        {"tools": [CHAT_WEATHER], "tool_choice": {"type": "function", "function": {"name": "f"}}},
        "tool_choice",
    ),
    ({"parallel_tool_calls": "no"}, "parallel_tool_calls"),
    ({"response_format": "json"}, "response_format"),
    ({"response_format": {"type": "yaml"}}, "response_format.type"),
    ({"response_format": {"type": "json_schema"}}, "response_format.json_schema"),
    (
        {"response_format": {"type": "json_schema", "json_schema": {"schema": {}}}},
        "response_format.json_schema.name",
    ),
    ({"reasoning_effort": 5}, "reasoning_effort"),
    ({"chat_template_kwargs": "x"}, "chat_template_kwargs"),
    ({"chat_template_kwargs": {"enable_thinking": "yes"}}, "chat_template_kwargs.enable_thinking"),
    ({"prompt_cache_key": 5}, "prompt_cache_key"),
    ({"user": ["x"]}, "user"),
    ({"safety_identifier": 5}, "safety_identifier"),
]


async def test_chat_completions_rejects_bad_fields_naming_them(scripted: Server) -> None:
    """As on ``/v1/responses``: a 400 in the OpenAI envelope whose ``param`` is
    the field, streaming or not (nothing is streamed before the check)."""
    failures = []
    async with scripted.client() as client:
        for fields, param in CHAT_CASES:
            for stream in (False, True):
                body = {**CHAT_BASE, "stream": stream, **fields}
                r = await client.post("/v1/chat/completions", json=body)
                error = r.json().get("error") or {}
                ok = (
                    r.status_code == 400
                    and r.headers["content-type"].startswith("application/json")
                    and error.get("type") == "invalid_request_error"
                    and error.get("param") == param
                    and param in error.get("message", "")
                    and "pydantic" not in error.get("message", "")
                )
                if not ok:
                    failures.append((fields, stream, r.status_code, r.text[:300]))
    assert not failures, failures


async def test_retention_message_is_exact(scripted: Server) -> None:
    async with scripted.client() as client:
        r = await client.post(
            "/v1/responses", json={**RESPONSES_BASE, "metadata": {"retention_seconds": 5}}
        )
    assert r.json()["error"]["message"] == (
        "metadata.retention_seconds must be an integer in [60, 7776000]"
    )


# -- edge values that must pass -------------------------------------------------------


@pytest.mark.parametrize(
    "fields",
    [
        {"temperature": 1, "top_k": 100000},  # above the vocabulary: clamped, as the API does
        {"temperature": 0, "top_p": 0, "top_k": 1},
        {"temperature": 1, "top_p": 1, "max_tokens": 4.0},
        {"stop_sequences": [" "], "thinking": {"type": "disabled"}},
        {"thinking": {"type": "enabled", "budget_tokens": 1}, "tool_choice": {"type": "none"}},
        {"tools": None, "stop_sequences": None, "system": None, "thinking": None},
    ],
)
async def test_messages_edge_values_pass(scripted: Server, fields: dict[str, Any]) -> None:
    async with scripted.client() as client:
        r = await client.post("/v1/messages", json={**MESSAGES_BASE, **fields})
    assert r.status_code == 200, r.text
    assert r.json()["type"] == "message"


@pytest.mark.parametrize(
    "fields",
    [
        {"temperature": 1, "seed": -1},
        {"temperature": 1, "seed": 2**64 - 1},
        {"temperature": 1, "seed": -(2**63)},
        {"presence_penalty": 2, "frequency_penalty": -2},
        {"temperature": 2, "top_p": 0.5, "top_logprobs": 20},
        {"max_output_tokens": 4.0, "cache_salt": "é" * 128, "previous_response_id": ""},
        {"tools": None, "include": None, "tool_choice": None, "metadata": None, "text": None},
    ],
)
async def test_responses_edge_values_pass_and_echo_what_was_used(
    scripted: Server, fields: dict[str, Any]
) -> None:
    async with scripted.client() as client:
        r = await client.post("/v1/responses", json={**RESPONSES_BASE, **fields})
    assert r.status_code == 200, r.text
    body = r.json()
    defaults = {
        "temperature": 0.0,
        "top_p": 1.0,
        "presence_penalty": 0.0,
        "frequency_penalty": 0.0,
        "top_logprobs": 0,
    }
    for name, default in defaults.items():
        assert body[name] == fields.get(name, default), name
    assert body["previous_response_id"] is None


@pytest.mark.parametrize(
    "fields",
    [
        {"temperature": 2, "top_p": 0},
        {"temperature": 0, "top_p": 1, "max_tokens": 4.0},
        {"temperature": 1, "seed": -1},
        {"temperature": 1, "seed": 2**64 - 1},
        {"temperature": 1, "seed": -(2**63)},
        {"presence_penalty": 2, "frequency_penalty": -2},
        {"max_tokens": 2**31 - 1, "max_completion_tokens": 1},
        {"n": 1, "logprobs": False, "top_logprobs": 0, "logit_bias": {}},
        {"stop": "", "modalities": ["text"], "response_format": {"type": "text"}},
        {"stop": ["", "END"], "reasoning_effort": "minimal", "parallel_tool_calls": True},
        {
            "tools": None,
            "tool_choice": None,
            "response_format": None,
            "stop": None,
            "stream_options": None,
            "modalities": None,
            "seed": None,
            "n": None,
        },
        {"tools": [], "tool_choice": "none", "chat_template_kwargs": {"enable_thinking": None}},
        # Fields that steer only OpenAI's own service: accepted, ignored.
        {"store": False, "metadata": {"k": "v"}, "service_tier": "auto", "user": "u"},
        {
            "messages": [
                {"role": "developer", "content": "be brief"},
                {"role": "user", "name": "bob", "content": [{"type": "text", "text": "hi"}]},
            ]
        },
    ],
)
async def test_chat_completions_edge_values_pass(scripted: Server, fields: dict[str, Any]) -> None:
    async with scripted.client() as client:
        r = await client.post("/v1/chat/completions", json={**CHAT_BASE, **fields})
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["object"] == "chat.completion"
    (choice,) = body["choices"]
    assert choice["message"]["role"] == "assistant"
    expected = "Hello" if fields.get("max_completion_tokens") == 1 else "Hello world."
    assert choice["message"]["content"] == expected, body


# -- the Response object conforms to Open Responses -----------------------------------


async def test_response_object_matches_the_open_responses_schema(scripted: Server) -> None:
    import jsonschema
    import referencing

    schema_file = SCHEMA_DIR / "openresponses-openapi.json"
    from referencing.jsonschema import DRAFT202012

    uri = "urn:openresponses"
    document = json.loads(schema_file.read_text())
    registry = referencing.Registry().with_resource(uri, DRAFT202012.create_resource(document))
    validator = jsonschema.Draft202012Validator(
        {"$ref": f"{uri}#/components/schemas/ResponseResource"}, registry=registry
    )
    bodies = [
        {"model": SCRIPTED, "input": "hi"},
        # reasoning, text and a function call in one response
        {
            "model": SCRIPTED,
            "input": "Weather?",
            "tools": [WEATHER],
            "reasoning": {"effort": "high"},
        },
    ]
    async with scripted.client() as client:
        for body in bodies:
            r = await client.post("/v1/responses", json=body)
            assert r.status_code == 200, r.text
            errors = [
                f"{list(e.absolute_path)}: {e.message}" for e in validator.iter_errors(r.json())
            ]
            assert not errors, errors
