"""Every Response object and streaming event the server sends on /v1/responses
validates against both published schemas (Open Responses and OpenAI's OpenAPI):
messages, reasoning (plain and sealed), function and custom tool calls, length
cuts, engine failures, shutdown, background mode (queued, cancelled), the
last-resort ``error`` event; the stored copy (``GET``), the input item list and
JSON error bodies. Through the real server on the scripted model, over real
sockets; the official SDK's stream helpers parse every stream."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import openai
import pytest
import trio
from mlx_lm.generate import GenerationBatch
from openai.types.responses import ResponseCompletedEvent, ResponseIncompleteEvent

from . import agent_fixtures
from .conftest import SCRIPTED, Server, parse_sse
from .schemas import (
    DOCUMENTS,
    ERROR_BODY,
    EVENT_SCHEMAS,
    INPUT_ITEMS,
    OPEN_RESPONSES,
    OPENAI,
    UNDEFINED_EVENTS,
    Problem,
    Schemas,
    load,
)
from .scripted_model import EXPECTED_REASONING, PATCH_TEXT

WEATHER = {
    "type": "function",
    "name": "get_weather",
    "description": "Current weather for a city",
    "parameters": {
        "type": "object",
        "properties": {"city": {"type": "string"}},
        "required": ["city"],
    },
}
TIME = {
    "type": "function",
    "name": "get_time",
    "parameters": {"type": "object", "properties": {"zone": {"type": "string"}}},
}
APPLY_PATCH = {
    "type": "custom",
    "name": "apply_patch",
    "description": "Edit files with a patch.",
    "format": {"type": "grammar", "syntax": "lark", "definition": "start: /.+/s"},
}
SEALED = ["reasoning.encrypted_content"]

# name -> request body (without model/stream): every output shape the server has.
SCENARIOS: dict[str, dict[str, Any]] = {
    "message": {
        "input": "hi",
        "instructions": "Be brief.",
        "metadata": {"k": "v"},
        "temperature": 0.7,
        "top_p": 0.9,
        "presence_penalty": 0.5,
        "frequency_penalty": -0.5,
        "top_logprobs": 3,
        "text": {"format": {"type": "text"}, "verbosity": "low"},
        "prompt_cache_key": "k1",
        "safety_identifier": "u1",
        "user": "someone",
    },
    "reasoning": {"input": "Think first.", "reasoning": {"effort": "medium"}},
    "reasoning_sealed": {
        "input": "Think first.",
        "reasoning": {"effort": "high", "summary": "auto"},
        "include": SEALED,
    },
    "function_call": {"input": "Weather in Paris?", "tools": [WEATHER]},
    "function_call_forced": {
        "input": "Weather in Paris?",
        "tools": [WEATHER, TIME],
        "tool_choice": {"type": "function", "name": "get_weather"},
        "parallel_tool_calls": False,
    },
    "two_function_calls": {"input": "TWO things please", "tools": [WEATHER, TIME]},
    "reasoning_text_and_call": {
        "input": "Weather in Oslo?",
        "tools": [WEATHER],
        "tool_choice": "required",
        "reasoning": {"effort": "low"},
        "include": SEALED,
    },
    "custom_tool_call": {"input": "Add hello.txt", "tools": [WEATHER, APPLY_PATCH]},
    "incomplete_message": {"input": "LOOP", "max_output_tokens": 4},
    "incomplete_reasoning": {
        "input": "Think first.",
        "reasoning": {"effort": "high"},
        "max_output_tokens": 2,
    },
    "codex": agent_fixtures.codex_patch_first(SCRIPTED),
}
EXPECTED_OUTPUT = {
    "message": ["message"],
    "reasoning": ["reasoning", "message"],
    "reasoning_sealed": ["reasoning", "message"],
    "function_call": ["function_call"],
    "function_call_forced": ["function_call"],
    "two_function_calls": ["function_call", "function_call"],
    "reasoning_text_and_call": ["reasoning", "message", "function_call"],
    "custom_tool_call": ["message", "custom_tool_call"],
    "incomplete_message": ["message"],
    "incomplete_reasoning": ["reasoning"],
    "codex": ["reasoning", "custom_tool_call"],
}
TERMINAL = {"response.completed", "response.incomplete", "response.failed", "error"}


def body_of(name: str) -> dict[str, Any]:
    body = {"model": SCRIPTED, **SCENARIOS[name]}
    body.pop("stream", None)
    return body


def report(problems: list[Problem], what: str) -> str:
    return f"{what}: {len(problems)} schema problems\n" + "\n".join(map(str, problems[:30]))


def assert_valid(schemas: Schemas, names: dict[str, str | None], instance: Any, what: str) -> None:
    problems = schemas.check(names, instance)
    assert not problems, report(problems, what)


def assert_response(schemas: Schemas, response: Any, what: str) -> None:
    problems = schemas.check_response(response)
    assert not problems, report(problems, what)


def assert_valid_stream(schemas: Schemas, events: list[tuple[str, dict[str, Any]]]) -> None:
    """Every event against both documents, plus the grammar the schemas cannot
    say: SSE name = ``type``, numbered from 0, one terminal event, last."""
    problems = []
    for name, data in events:
        assert data.get("type") == name, (name, data)
        problems += [
            Problem(p.document, p.schema, f"{name}#{data['sequence_number']}/{p.path}", p.message)
            for p in schemas.check_event(data)
        ]
    assert not problems, report(problems, "stream")
    assert [d["sequence_number"] for _, d in events] == list(range(len(events)))
    names = [n for n, _ in events]
    assert names[-1] in TERMINAL and not TERMINAL & set(names[:-1]), names
    if names[0] == "response.created":
        opening = names[1:3] if names[1] == "response.queued" else names[1:2]
        assert opening[-1] == "response.in_progress", names


async def stream_events(
    server: Server, body: dict[str, Any]
) -> tuple[list[tuple[str, dict[str, Any]]], str]:
    async with server.client() as client:
        r = await client.post("/v1/responses", json={**body, "stream": True})
    assert r.status_code == 200, r.text
    return parse_sse(r.text), r.text


# -- the helper itself ---------------------------------------------------------------


def test_every_event_the_server_emits_has_a_schema_in_both_documents() -> None:
    """The event names in the server's source (the Responses routes, their
    assembler and its last resort), each mapped to a schema in both
    documents - or recorded as not defined there - and each mapped schema
    exists with that ``type``."""
    schemas = load()
    root = Path(__file__).parent.parent / "mlxtrio"
    # every name in the assembler is an event; elsewhere, the "type" of a dict
    emitted = set(
        re.findall(
            r'"(response\.[a-z_.]+)"', (root / "api" / "responses" / "events.py").read_text()
        )
    )
    for file in sorted((root / "api" / "responses").glob("*.py")):
        emitted |= set(re.findall(r'"type": *"(response\.[a-z_.]+|error)"', file.read_text()))
    assert len(emitted) > 10, emitted
    for document in DOCUMENTS:
        mapped = EVENT_SCHEMAS[document]
        missing = emitted - set(mapped) - UNDEFINED_EVENTS[document]
        assert not missing, f"{document}: no schema mapped for {sorted(missing)}"
        for kind, name in mapped.items():
            schema = schemas.documents[document]["components"]["schemas"][name]
            declared = schema["properties"]["type"]
            assert kind in declared.get("enum", [declared.get("const")]), (document, name)
        for kind in UNDEFINED_EVENTS[document]:  # really not defined there
            text = json.dumps(schemas.documents[document]["components"]["schemas"])
            assert f'"{kind}"' not in text, (document, kind)


# -- streams ---------------------------------------------------------------------


async def test_every_stream_validates(scripted: Server) -> None:
    schemas = load()
    seen: set[str] = set()
    for name in SCENARIOS:
        events, _ = await stream_events(scripted, body_of(name))
        try:
            assert_valid_stream(schemas, events)
        except AssertionError as exc:
            raise AssertionError(f"scenario {name}: {exc}") from None
        seen |= {n for n, _ in events}
        final = events[-1][1]["response"]
        assert [i["type"] for i in final["output"]] == EXPECTED_OUTPUT[name], name
        done = [d["item"] for n, d in events if n == "response.output_item.done"]
        assert final["output"] == done, name
    # everything a successful or cut turn can send (failures: the tests below)
    expected = {
        "response.created",
        "response.in_progress",
        "response.output_item.added",
        "response.output_item.done",
        "response.content_part.added",
        "response.content_part.done",
        "response.output_text.delta",
        "response.output_text.done",
        "response.reasoning_summary_part.added",
        "response.reasoning_summary_part.done",
        "response.reasoning_summary_text.delta",
        "response.reasoning_summary_text.done",
        "response.function_call_arguments.delta",
        "response.function_call_arguments.done",
        "response.custom_tool_call_input.delta",
        "response.custom_tool_call_input.done",
        "response.completed",
        "response.incomplete",
    }
    assert expected <= seen, expected - seen


async def test_final_responses_report_what_was_used(scripted: Server) -> None:
    """The sampling fields are the values used; incomplete and sealed turns say so."""
    results = {}
    for name in (
        "message",
        "reasoning_sealed",
        "custom_tool_call",
        "incomplete_message",
        "incomplete_reasoning",
    ):
        events, _ = await stream_events(scripted, body_of(name))
        results[name] = events[-1][1]["response"]
    message = results["message"]
    for field in ("temperature", "top_p", "presence_penalty", "frequency_penalty", "top_logprobs"):
        assert message[field] == SCENARIOS["message"][field], field
    assert message["text"] == {"format": {"type": "text"}, "verbosity": "low"}
    sealed = results["reasoning_sealed"]
    reasoning = sealed["output"][0]
    assert reasoning["summary"] == [{"type": "summary_text", "text": EXPECTED_REASONING}]
    assert isinstance(reasoning["encrypted_content"], str) and reasoning["encrypted_content"]
    assert sealed["temperature"] == 0.0 and sealed["top_p"] == 1.0  # the defaults used
    call = results["custom_tool_call"]["output"][-1]
    assert (call["type"], call["name"], call["input"]) == (
        "custom_tool_call",
        "apply_patch",
        PATCH_TEXT,
    )
    assert call["status"] == "completed"
    for name in ("incomplete_message", "incomplete_reasoning"):
        cut = results[name]
        assert cut["status"] == "incomplete", name
        assert cut["incomplete_details"] == {"reason": "max_output_tokens"}
        assert all(item["status"] == "incomplete" for item in cut["output"]), cut["output"]
        assert cut["completed_at"] is None


async def test_sdk_parses_every_stream(scripted: Server) -> None:
    """The official SDK's stream helpers accept every stream (typed events, an
    accumulated final response equal to the server's)."""
    async with openai.AsyncOpenAI(
        base_url=scripted.url + "/v1", api_key="x", max_retries=0
    ) as client:
        for name in SCENARIOS:
            rest = body_of(name)
            del rest["model"], rest["input"]
            given = {"model": SCRIPTED, "input": SCENARIOS[name]["input"], "extra_body": rest}
            async with client.responses.stream(**given) as stream:
                events = [event async for event in stream]
                last = events[-1]
                assert isinstance(last, ResponseCompletedEvent | ResponseIncompleteEvent), name
                # (the helper's final response exists for completed turns only)
                if isinstance(last, ResponseCompletedEvent):
                    assert (await stream.get_final_response()).output == last.response.output
            assert [i.type for i in last.response.output] == EXPECTED_OUTPUT[name], name
            raw = [event async for event in await client.responses.create(stream=True, **given)]
            for event in (*events, *raw):
                # a known event type, parsed into its own model (not a fallback)
                assert type(event).__name__.startswith("Response"), (name, event)
            assert raw[-1].type == last.type, name


# -- bodies, stored copies, item lists ---------------------------------------------


async def test_json_bodies_stored_copies_and_input_items_validate(scripted: Server) -> None:
    schemas = load()
    async with scripted.client() as client:
        for name in SCENARIOS:
            r = await client.post("/v1/responses", json={**body_of(name), "store": True})
            assert r.status_code == 200, r.text
            body = r.json()
            assert_response(schemas, body, f"{name}: JSON body")
            assert [i["type"] for i in body["output"]] == EXPECTED_OUTPUT[name], name
            stored = await client.get(f"/v1/responses/{body['id']}")
            assert stored.status_code == 200, stored.text
            assert stored.json() == body
            assert_response(schemas, stored.json(), f"{name}: GET")
            items = await client.get(f"/v1/responses/{body['id']}/input_items")
            assert items.status_code == 200, items.text
            assert_valid(schemas, INPUT_ITEMS, items.json(), f"{name}: input_items")
        # a continuation: function call output in, message out
        first = (await client.post("/v1/responses", json=body_of("function_call"))).json()
        call = first["output"][0]
        second = await client.post(
            "/v1/responses",
            json={
                "model": SCRIPTED,
                "previous_response_id": first["id"],
                "tools": [WEATHER],
                "input": [
                    {"type": "function_call_output", "call_id": call["call_id"], "output": "21C"}
                ],
            },
        )
        assert second.status_code == 200, second.text
        assert second.json()["previous_response_id"] == first["id"]
        assert_response(schemas, second.json(), "continuation")
        # the deleted object: no schema in either document (OpenAI's DELETE
        # /responses/{id} documents a bare 200), so its shape is checked here
        deleted = await client.delete(f"/v1/responses/{first['id']}")
        assert deleted.json() == {"id": first["id"], "object": "response.deleted", "deleted": True}
        # error bodies: OpenAI's ErrorResponse; Open Responses documents no HTTP
        # error body, its error object shape is the stream's ErrorPayload
        for bad in (
            {"model": SCRIPTED, "input": "hi", "temperature": 3},
            {"model": "nope", "input": "hi"},
        ):
            r = await client.post("/v1/responses", json=bad)
            assert r.status_code >= 400
            assert_valid(schemas, {OPENAI: ERROR_BODY[OPENAI]}, r.json(), f"error {r.text}")
            assert_valid(
                schemas, {OPEN_RESPONSES: ERROR_BODY[OPEN_RESPONSES]}, r.json()["error"], "error"
            )
        missing = await client.get("/v1/responses/resp_missing")
        assert missing.status_code == 404
        assert_valid(schemas, {OPENAI: ERROR_BODY[OPENAI]}, missing.json(), "404")


# Input items of every kind the server takes: string and part messages of every
# role, reasoning with ``content: null``, function and custom calls and outputs.
EVERY_INPUT_ITEM: list[dict[str, Any]] = [
    {"role": "system", "content": "Be brief."},
    {"role": "user", "content": "Hello"},
    {"role": "assistant", "content": "Hi."},
    {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": "Hi."}]},
    *agent_fixtures.codex_toolcall(SCRIPTED)["input"],
    *agent_fixtures.codex_patch(SCRIPTED)["input"][-2:],
]


def test_input_item_resources_validate() -> None:
    """What the input_items endpoint lists is built by
    ``input_item_resources`` (its listed form of each item the client sent)."""
    from mlxtrio.api.responses.objects import input_item_resources

    schemas = load()
    listed = input_item_resources(EVERY_INPUT_ITEM)
    page = {
        "object": "list",
        "data": listed,
        "first_id": listed[0]["id"],
        "last_id": listed[-1]["id"],
        "has_more": False,
    }
    assert_valid(schemas, INPUT_ITEMS, page, "input items")
    assert input_item_resources(listed) == listed  # idempotent: stored ones stay
    assert [i["type"] for i in listed] == [i.get("type", "message") for i in EVERY_INPUT_ITEM]


async def test_listed_input_items_validate(scripted: Server) -> None:
    schemas = load()
    async with scripted.client() as client:
        for body in (
            {"model": SCRIPTED, "input": EVERY_INPUT_ITEM},
            {**agent_fixtures.codex_patch(SCRIPTED), "stream": False, "store": True},
        ):
            r = await client.post("/v1/responses", json=body)
            assert r.status_code == 200, r.text
            items = await client.get(f"/v1/responses/{r.json()['id']}/input_items")
            assert items.status_code == 200, items.text
            assert_valid(schemas, INPUT_ITEMS, items.json(), "input_items")


# -- background mode -------------------------------------------------------------


async def test_background_responses_validate(scripted: Server) -> None:
    """``background: true``: the queued body, its stream (``response.queued``
    included), the resumed stream, polls, and a cancelled one."""
    schemas = load()
    async with scripted.client() as client:
        queued = await client.post(
            "/v1/responses", json=body_of("reasoning") | {"background": True}
        )
        assert queued.status_code == 200, queued.text
        assert_response(schemas, queued.json(), "queued body")
        events, _ = await stream_events(scripted, body_of("message") | {"background": True})
        assert_valid_stream(schemas, events)
        assert "response.queued" in [n for n, _ in events]
        response_id = events[0][1]["response"]["id"]
        resumed = await client.get(
            f"/v1/responses/{response_id}", params={"stream": "true", "starting_after": "1"}
        )
        assert parse_sse(resumed.text) == events[2:]
        with trio.fail_after(30):
            while (polled := await client.get(f"/v1/responses/{queued.json()['id']}")).json()[
                "status"
            ] in ("queued", "in_progress"):
                assert_response(schemas, polled.json(), "polled")
                await trio.sleep(0.02)
        assert_response(schemas, polled.json(), "polled")
        assert polled.json()["status"] == "completed"
        # cancelled while streaming: the stream still ends, the object says cancelled
        body = {"model": SCRIPTED, "input": "LOOP", "background": True, "max_output_tokens": 30000}
        lines = []
        async with client.stream("POST", "/v1/responses", json={**body, "stream": True}) as r:
            stream = r.aiter_lines()
            async for line in stream:
                lines.append(line)
                if "output_text.delta" in line:
                    break
            response_id = parse_sse("\n".join(lines))[0][1]["response"]["id"]
            cancelled = await client.post(f"/v1/responses/{response_id}/cancel")
            lines += [line async for line in stream]
        assert cancelled.status_code == 200, cancelled.text
        assert cancelled.json()["status"] == "cancelled"
        assert_response(schemas, cancelled.json(), "cancel body")
        events = parse_sse("\n".join(lines))
        assert_valid_stream(schemas, events)
        assert events[-1][1]["response"]["status"] == "cancelled"
        stored = await client.get(f"/v1/responses/{response_id}")
        assert_response(schemas, stored.json(), "cancelled, stored")


# -- failures ---------------------------------------------------------------------


def fail_steps_after(monkeypatch: pytest.MonkeyPatch, good_steps: int) -> None:
    """The engine's batch step raises after ``good_steps`` steps (an engine bug:
    the sequences of that batch end with an error, the engine goes on)."""
    real_step = GenerationBatch._step
    calls = {"n": 0}

    def failing(self):  # type: ignore[no-untyped-def]
        calls["n"] += 1
        if calls["n"] > good_steps:
            raise RuntimeError("step bug")
        return real_step(self)

    monkeypatch.setattr(GenerationBatch, "_step", failing)


async def test_a_failed_turn_validates(scripted: Server, monkeypatch: pytest.MonkeyPatch) -> None:
    """An engine failure mid-message ends the stream with response.failed; the
    open message is closed as incomplete first."""
    schemas = load()
    fail_steps_after(monkeypatch, 4)
    events, text = await stream_events(scripted, body_of("incomplete_message") | {"input": "LOOP"})
    assert_valid_stream(schemas, events)
    name, last = events[-1]
    assert name == "response.failed", [n for n, _ in events]
    response = last["response"]
    assert response["status"] == "failed" and response["error"]["code"] == "server_error"
    assert [i["status"] for i in response["output"]] == ["incomplete"]
    assert "step bug" not in text
    # the same failure without a stream: a JSON error body
    monkeypatch.undo()
    fail_steps_after(monkeypatch, 0)
    async with scripted.client() as client:
        r = await client.post("/v1/responses", json=body_of("message"))
    assert r.status_code == 500, r.text
    assert_valid(schemas, {OPENAI: ERROR_BODY[OPENAI]}, r.json(), "500 body")


async def test_a_failed_turn_in_reasoning_validates(
    scripted: Server, monkeypatch: pytest.MonkeyPatch
) -> None:
    schemas = load()
    fail_steps_after(monkeypatch, 2)
    events, _ = await stream_events(scripted, body_of("reasoning_sealed"))
    assert_valid_stream(schemas, events)
    assert events[-1][0] == "response.failed"
    assert [i["type"] for i in events[-1][1]["response"]["output"]] == ["reasoning"]


async def test_a_stream_cut_by_shutdown_validates(scripted: Server) -> None:
    """Shutdown while streaming: the turn ends as failed (``cancelled`` is for a
    client's own cancel of a background response, tested above), with a code
    from the official list; our own code stays in the message."""
    schemas = load()
    body = {"model": SCRIPTED, "input": "LOOP", "stream": True, "max_output_tokens": 30000}
    lines = []
    async with scripted.client() as client, client.stream("POST", "/v1/responses", json=body) as r:
        stream = r.aiter_lines()
        async for line in stream:
            lines.append(line)
            if "output_text.delta" in line:
                break
        async with trio.open_nursery() as nursery:
            nursery.start_soon(scripted.services.drain, 0)
            lines += [line async for line in stream]
    events = parse_sse("\n".join(lines))
    assert_valid_stream(schemas, events)
    name, last = events[-1]
    assert name == "response.failed"
    assert last["response"]["error"]["code"] == "server_error"
    assert last["response"]["error"]["message"].endswith(
        "shutting down; retry (server_shutting_down)"
    )


async def last_resort_events(
    server: Server, monkeypatch: pytest.MonkeyPatch
) -> list[tuple[str, dict[str, Any]]]:
    """A bug in the failure path itself: the SSE layer ends the stream with an
    ``error`` event (its last resort)."""
    from mlxtrio.api.responses.events import ResponseAssembler

    async def broken(self, *args, **kwargs):  # type: ignore[no-untyped-def]
        raise RuntimeError("assembler bug")

    for method in ("complete", "announce", "mark_failed", "fail"):
        monkeypatch.setattr(ResponseAssembler, method, broken, raising=False)
    events, _ = await stream_events(server, body_of("message"))
    assert events[-1][0] == "error"
    problems = [p for _, event in events[:-1] for p in load().check_event(event)]
    assert not problems, report(problems, "events before the error")
    assert [d["sequence_number"] for _, d in events] == list(range(len(events)))
    return events


async def test_the_last_resort_error_event_validates_for_openai(
    scripted: Server, monkeypatch: pytest.MonkeyPatch
) -> None:
    events = await last_resort_events(scripted, monkeypatch)
    problems = load().problems(OPENAI, EVENT_SCHEMAS[OPENAI]["error"], events[-1][1])
    assert not problems, report(problems, "error event")


async def test_the_last_resort_error_event_validates_for_open_responses(
    scripted: Server, monkeypatch: pytest.MonkeyPatch
) -> None:
    events = await last_resort_events(scripted, monkeypatch)
    name = EVENT_SCHEMAS[OPEN_RESPONSES]["error"]
    problems = load().problems(OPEN_RESPONSES, name, events[-1][1])
    assert not problems, report(problems, "error event")
