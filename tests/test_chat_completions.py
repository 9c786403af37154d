"""``POST /v1/chat/completions`` through the official ``openai`` SDK, on the real
server and engine: exact turns on the scripted model (text, reasoning as
``reasoning_content``, tool calls and their round trip, streaming with usage,
stop, structured output, forced calls), every object and chunk valid against
the published OpenAI schema, the prefix cache across resent histories, the
OpenAI error envelope before any stream byte, and a hang-up stopping the
generation. The embedded model gives a schema-valid tool call."""

from __future__ import annotations

import json

import httpx
import jsonschema
import openai
import pytest
import trio

from . import schemas
from .conftest import MODEL, SCRIPTED, RawConnection, Server, wait_until
from .scripted_model import LOOP_TOKEN
from .test_embedded_model import FORECAST, RUN

WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string"}},
            "required": ["city"],
        },
    },
}


def check(kind: str, instance: dict) -> None:
    problems = schemas.load().problems(schemas.OPENAI, kind, instance)
    assert not problems, [str(p) for p in problems]


async def post(server: Server, body: dict) -> httpx.Response:
    async with server.client() as client:
        return await client.post("/v1/chat/completions", json=body)


async def test_a_plain_turn(scripted: Server) -> None:
    async with scripted.openai() as client:
        raw = await client.chat.completions.with_raw_response.create(
            model=SCRIPTED, messages=[{"role": "user", "content": "Hi!"}]
        )
    completion = raw.parse()
    check("CreateChatCompletionResponse", json.loads(raw.text))
    choice = completion.choices[0]
    assert choice.message.content == "Hello world." and choice.finish_reason == "stop"
    assert choice.message.role == "assistant" and not choice.message.tool_calls
    assert completion.object == "chat.completion" and completion.id.startswith("chatcmpl-")
    usage = completion.usage
    assert usage is not None and usage.completion_tokens == 3  # two pieces and EOS
    assert usage.total_tokens == usage.prompt_tokens + usage.completion_tokens
    assert raw.headers["X-Session-Cache"] == "fresh"


async def test_system_and_developer_messages_and_text_parts(scripted: Server) -> None:
    r = await post(
        scripted,
        {
            "model": SCRIPTED,
            "messages": [
                {"role": "system", "content": "Be brief."},
                {"role": "developer", "content": [{"type": "text", "text": "Answer."}]},
                {
                    "role": "user",
                    "content": [{"type": "text", "text": "Hi"}, {"type": "text", "text": "!"}],
                },
            ],
        },
    )
    assert r.status_code == 200, r.text
    assert r.json()["choices"][0]["message"]["content"] == "Hello world."


async def test_a_tool_call_and_its_round_trip(scripted: Server) -> None:
    async with scripted.openai() as client:
        first = await client.chat.completions.create(
            model=SCRIPTED, messages=[{"role": "user", "content": "Weather?"}], tools=[WEATHER]
        )
        choice = first.choices[0]
        assert choice.finish_reason == "tool_calls" and choice.message.content is None
        (call,) = choice.message.tool_calls or []
        assert call.type == "function" and call.function.name == "get_weather"
        assert json.loads(call.function.arguments) == {"city": "Paris"}
        history = [
            {"role": "user", "content": "Weather?"},
            choice.message.model_dump(exclude_none=True),
            {"role": "tool", "tool_call_id": call.id, "content": "sunny"},
        ]
        raw = await client.chat.completions.with_raw_response.create(
            model=SCRIPTED, messages=history, tools=[WEATHER]
        )
    second = raw.parse()
    assert second.choices[0].message.content == "It is sunny."
    assert second.choices[0].finish_reason == "stop"
    # The resent history starts from the first turn's KV.
    usage = second.usage
    assert usage is not None and usage.prompt_tokens_details is not None
    assert usage.prompt_tokens_details.cached_tokens > 0
    assert raw.headers["X-Session-Cache"] == "prefix_hit"


async def test_streaming_with_usage_validates_chunk_by_chunk(scripted: Server) -> None:
    body = {
        "model": SCRIPTED,
        "messages": [{"role": "user", "content": "Hi"}],
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    async with scripted.client() as client:
        async with client.stream("POST", "/v1/chat/completions", json=body) as r:
            assert r.headers["content-type"].startswith("text/event-stream")
            lines = [line async for line in r.aiter_lines() if line.startswith("data: ")]
    assert lines[-1] == "data: [DONE]"
    chunks = [json.loads(line.removeprefix("data: ")) for line in lines[:-1]]
    for chunk in chunks:
        check("CreateChatCompletionStreamResponse", chunk)
    assert chunks[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    text = "".join(c["choices"][0]["delta"].get("content") or "" for c in chunks if c["choices"])
    assert text == "Hello world."
    finishing = [c for c in chunks if c["choices"] and c["choices"][0]["finish_reason"]]
    assert [c["choices"][0]["finish_reason"] for c in finishing] == ["stop"]
    last = chunks[-1]
    assert last["choices"] == [] and last["usage"]["completion_tokens"] == 3
    assert all("usage" not in c for c in chunks[:-1])
    assert len({c["id"] for c in chunks}) == 1


async def test_the_sdk_stream_accumulates_reasoning_and_calls(scripted: Server) -> None:
    async with scripted.openai() as client:
        stream = await client.chat.completions.create(
            model=SCRIPTED,
            messages=[{"role": "user", "content": "Weather in Oslo?"}],
            tools=[WEATHER],
            reasoning_effort="medium",
            stream=True,
        )
        reasoning, content, calls, reasons = "", "", {}, []
        async for chunk in stream:
            delta = chunk.choices[0].delta
            reasoning += getattr(delta, "reasoning_content", None) or ""
            content += delta.content or ""
            for call in delta.tool_calls or []:
                calls[call.index] = call
            reasons.append(chunk.choices[0].finish_reason)
    assert reasoning == "I should check Oslo."
    assert content == "Checking the weather."
    assert [json.loads(c.function.arguments) for c in calls.values()] == [{"city": "Oslo"}]
    assert reasons[-1] == "tool_calls"


async def test_reasoning_content_is_returned_and_read_back(scripted: Server) -> None:
    r = await post(
        scripted,
        {
            "model": SCRIPTED,
            "messages": [{"role": "user", "content": "Think, then answer."}],
            "chat_template_kwargs": {"enable_thinking": True},
        },
    )
    message = r.json()["choices"][0]["message"]
    assert message["reasoning_content"] == "Let me think." and message["content"] == "Sure!"
    check("CreateChatCompletionResponse", r.json())
    usage = r.json()["usage"]
    assert usage["completion_tokens_details"]["reasoning_tokens"] > 0
    # Sent back, the turn renders as it was generated: its KV is reused.
    again = await post(
        scripted,
        {
            "model": SCRIPTED,
            "messages": [
                {"role": "user", "content": "Think, then answer."},
                message,
                {"role": "user", "content": "Hi"},
            ],
        },
    )
    assert again.status_code == 200, again.text
    assert again.json()["usage"]["prompt_tokens_details"]["cached_tokens"] > 0


async def test_stop_and_length(scripted: Server) -> None:
    stopped = await post(
        scripted,
        {"model": SCRIPTED, "messages": [{"role": "user", "content": "Hi"}], "stop": " world"},
    )
    choice = stopped.json()["choices"][0]
    assert choice["message"]["content"] == "Hello" and choice["finish_reason"] == "stop"
    capped = await post(
        scripted,
        {"model": SCRIPTED, "messages": [{"role": "user", "content": "LOOP"}], "max_tokens": 5},
    )
    choice = capped.json()["choices"][0]
    assert choice["finish_reason"] == "length"
    assert capped.json()["usage"]["completion_tokens"] == 5


async def test_required_tool_choice_forces_a_schema_valid_call(scripted: Server) -> None:
    """``PLAIN`` makes the model answer in text; required makes it call."""
    city = {"type": "string", "enum": ["Lisbon", "Rome"]}
    tool = {
        "type": "function",
        "function": {
            "name": "get_weather",
            "parameters": {"type": "object", "properties": {"city": city}, "required": ["city"]},
        },
    }
    for choice in ("required", {"type": "function", "function": {"name": "get_weather"}}):
        r = await post(
            scripted,
            {
                "model": SCRIPTED,
                "messages": [{"role": "user", "content": "PLAIN please"}],
                "tools": [tool],
                "tool_choice": choice,
            },
        )
        got = r.json()["choices"][0]
        assert got["finish_reason"] == "tool_calls", r.text
        arguments = json.loads(got["message"]["tool_calls"][0]["function"]["arguments"])
        jsonschema.validate(arguments, tool["function"]["parameters"])


async def test_structured_output_follows_the_schema(scripted: Server) -> None:
    schema = {
        "type": "object",
        "properties": {"answer": {"type": "string", "maxLength": 20}},
        "required": ["answer"],
        "additionalProperties": False,
    }
    async with scripted.openai() as client:
        completion = await client.chat.completions.create(
            model=SCRIPTED,
            messages=[{"role": "user", "content": "Hi"}],
            response_format={
                "type": "json_schema",
                "json_schema": {"name": "reply", "schema": schema, "strict": True},
            },
            max_tokens=64,
        )
    jsonschema.validate(json.loads(completion.choices[0].message.content or ""), schema)


@pytest.mark.parametrize(
    ("body", "param", "words"),
    [
        ({"messages": []}, "messages", "non-empty"),
        ({"temperature": 3}, "temperature", "between 0 and 2"),
        ({"n": 2}, "n", "n must be 1"),
        ({"logprobs": True}, "logprobs", "not supported"),
        ({"functions": [{"name": "f"}]}, "functions", "send them as tools"),
        ({"stop": ["a", "b", "c", "d", "e"]}, "stop", "at most 4"),
        (
            {"tool_choice": {"type": "function", "function": {"name": "nope"}}},
            "tool_choice",
            "nope",
        ),
        (
            {"messages": [{"role": "tool", "tool_call_id": "c1", "content": "x"}]},
            "messages",
            "not preceded by an assistant message with tool_calls",
        ),
        (
            {
                "messages": [
                    {"role": "user", "content": "x"},
                    {
                        "role": "assistant",
                        "tool_calls": [
                            {
                                "id": "c",
                                "type": "function",
                                "function": {"name": "f", "arguments": "[1"},
                            }
                        ],
                    },
                ]
            },
            "messages.1.tool_calls.0.function.arguments",
            "JSON object",
        ),
        (
            {
                "messages": [
                    {"role": "user", "content": [{"type": "input_audio", "input_audio": {}}]}
                ]
            },
            "messages.0.content.0.type",
            "not supported",
        ),
        ({"messages": [{"role": "robot", "content": "x"}]}, "messages.0.role", "robot"),
    ],
)
async def test_bad_requests_get_the_openai_envelope(
    scripted: Server, body: dict, param: str, words: str
) -> None:
    base = {"model": SCRIPTED, "messages": [{"role": "user", "content": "hi"}], "tools": [WEATHER]}
    r = await post(scripted, {**base, **body, "stream": True})
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["type"] == "invalid_request_error" and error["param"] == param
    assert words in error["message"], error


async def test_an_unknown_model_is_a_404(scripted: Server) -> None:
    async with scripted.openai() as client:
        with pytest.raises(openai.NotFoundError):
            await client.chat.completions.create(
                model="nope", messages=[{"role": "user", "content": "hi"}]
            )


async def test_a_hang_up_stops_the_generation(scripted: Server) -> None:
    engine = scripted.engine
    conn = await RawConnection.open(scripted)
    await conn.post_json(
        "/v1/chat/completions",
        {"model": SCRIPTED, "messages": [{"role": "user", "content": "LOOP"}], "stream": True},
    )
    await conn.read_until(b'"content":" la"')
    await conn.close()
    await wait_until(lambda: engine.active_sequences == 0, what="the slot freed")
    assert engine.stats.last_cancelled is not None
    assert engine.stats.last_cancelled.generated_tokens < 30000


async def test_the_embedded_model_calls_an_offered_tool(server: Server) -> None:
    tools = [
        {"type": "function", "function": {k: v for k, v in t.items() if k != "type"}}
        for t in (FORECAST, RUN)
    ]
    async with server.openai() as client:
        completion = await client.chat.completions.create(
            model=MODEL,
            messages=[{"role": "user", "content": "What's the weather in Lisbon?"}],
            tools=tools,
            max_completion_tokens=256,
        )
    (call,) = completion.choices[0].message.tool_calls or []
    assert call.function.name == FORECAST["name"]
    jsonschema.validate(json.loads(call.function.arguments), FORECAST["parameters"])
    assert completion.choices[0].finish_reason == "tool_calls"


async def test_streams_share_the_batch(scripted: Server) -> None:
    """Several streams at once are decoded together (one engine step held all
    of them) and each gets its own text."""
    texts: list[str] = []

    async def one() -> None:
        async with scripted.openai() as client:
            stream = await client.chat.completions.create(
                model=SCRIPTED,
                messages=[{"role": "user", "content": "LOOP"}],
                max_tokens=400,
                stream=True,
            )
            texts.append(
                "".join([c.choices[0].delta.content or "" async for c in stream if c.choices])
            )

    async with trio.open_nursery() as nursery:
        for _ in range(3):
            nursery.start_soon(one)
    assert texts == [(LOOP_TOKEN * 400).strip()] * 3
    assert scripted.engine.stats.max_batch_size == 3
