"""``/v1/messages`` and ``/v1/messages/count_tokens`` through the official
``anthropic`` SDK and raw HTTP, on the scripted model."""

from __future__ import annotations

import json

import anthropic
import pytest

from . import agent_fixtures
from .conftest import SCRIPTED, RawConnection, Server, parse_sse, wait_until

WEATHER = {
    "name": "get_weather",
    "description": "Weather for a city",
    "input_schema": {
        "type": "object",
        "properties": {"city": {"type": "string"}},
        "required": ["city"],
    },
}


def check_stream_grammar(events: list[tuple[str, dict]]) -> None:
    """The Anthropic event grammar, strictly."""
    names = [n for n, _ in events if n != "ping"]
    assert names[0] == "message_start"
    assert names[-2:] == ["message_delta", "message_stop"]
    open_index = None
    next_index = 0
    tool_json: dict[int, str] = {}
    for name, data in events:
        assert data["type"] == name
        if name == "content_block_start":
            assert open_index is None and data["index"] == next_index
            open_index = data["index"]
            if data["content_block"]["type"] == "tool_use":
                tool_json[open_index] = ""
                assert data["content_block"]["id"].startswith("toolu_")
        elif name == "content_block_delta":
            assert data["index"] == open_index
            if data["delta"]["type"] == "input_json_delta":
                tool_json[open_index] += data["delta"]["partial_json"]
        elif name == "content_block_stop":
            assert data["index"] == open_index
            open_index, next_index = None, next_index + 1
    assert open_index is None
    for text in tool_json.values():
        assert isinstance(json.loads(text), dict)


async def post_stream(
    server: Server, body: dict, path: str = "/v1/messages"
) -> list[tuple[str, dict]]:
    async with server.client() as client:
        r = await client.post(path, json={**body, "stream": True})
    assert r.status_code == 200, r.text
    assert r.headers["content-type"].startswith("text/event-stream")
    return parse_sse(r.text)


async def test_sdk_create_plain(scripted: Server) -> None:
    async with scripted.anthropic() as client:
        message = await client.messages.create(
            model=SCRIPTED, max_tokens=64, messages=[{"role": "user", "content": "Hi"}]
        )
    assert message.id.startswith("msg_")
    assert [b.type for b in message.content] == ["text"]
    assert message.content[0].text == "Hello world."
    assert message.stop_reason == "end_turn" and message.stop_sequence is None
    assert message.usage.input_tokens > 0 and message.usage.output_tokens == 3
    assert message.usage.cache_read_input_tokens == 0
    assert message.usage.cache_creation_input_tokens == 0


async def test_sdk_stream_thinking_then_text(scripted: Server) -> None:
    async with scripted.anthropic() as client:
        async with client.messages.stream(
            model=SCRIPTED,
            max_tokens=64,
            thinking={"type": "enabled", "budget_tokens": 2048},
            messages=[{"role": "user", "content": "Think, then answer."}],
        ) as stream:
            events = [event.type async for event in stream]
            final = await stream.get_final_message()
    assert events[0] == "message_start"
    thinking, text = final.content
    assert thinking.type == "thinking" and thinking.thinking == "Let me think."
    assert thinking.signature  # non-empty, so Claude Code can send it back
    assert text.type == "text" and text.text == "Sure!"
    assert final.stop_reason == "end_turn"


async def test_sdk_stream_tool_use(scripted: Server) -> None:
    async with scripted.anthropic() as client:
        async with client.messages.stream(
            model=SCRIPTED,
            max_tokens=64,
            tools=[WEATHER],
            messages=[{"role": "user", "content": "Weather?"}],
        ) as stream:
            final = await stream.get_final_message()
    (block,) = final.content
    assert block.type == "tool_use" and block.name == "get_weather"
    assert block.input == {"city": "Paris"}
    assert block.id.startswith("toolu_")
    assert final.stop_reason == "tool_use"


async def test_thinking_text_and_tool_use_in_one_turn(scripted: Server) -> None:
    async with scripted.anthropic() as client:
        async with client.messages.stream(
            model=SCRIPTED,
            max_tokens=128,
            thinking={"type": "enabled", "budget_tokens": 1024},
            tools=[WEATHER],
            messages=[{"role": "user", "content": "Weather in Oslo?"}],
        ) as stream:
            events = [event async for event in stream]
            final = await stream.get_final_message()
    thinking, text, tool = final.content
    assert thinking.thinking == "I should check Oslo." and thinking.signature
    assert text.text == "Checking the weather."
    assert tool.type == "tool_use" and tool.input == {"city": "Oslo"}
    assert final.stop_reason == "tool_use"
    deltas = [e.delta.type for e in events if e.type == "content_block_delta"]
    assert (
        deltas.index("signature_delta")
        < deltas.index("text_delta")
        < deltas.index("input_json_delta")
    )


async def test_two_tool_uses_and_event_grammar(scripted: Server) -> None:
    events = await post_stream(
        scripted,
        {
            "model": SCRIPTED,
            "max_tokens": 64,
            "tools": [WEATHER, {"name": "get_time", "input_schema": {"type": "object"}}],
            "messages": [{"role": "user", "content": "TWO please"}],
        },
    )
    check_stream_grammar(events)
    starts = [d["content_block"] for n, d in events if n == "content_block_start"]
    assert [b["name"] for b in starts] == ["get_weather", "get_time"]
    delta = [d for n, d in events if n == "message_delta"][0]
    assert delta["delta"]["stop_reason"] == "tool_use"


async def test_tool_round_trip(scripted: Server) -> None:
    async with scripted.anthropic() as client:
        first = await client.messages.create(
            model=SCRIPTED,
            max_tokens=64,
            tools=[WEATHER],
            messages=[{"role": "user", "content": "Weather?"}],
        )
        tool_use = first.content[0]
        second = await client.messages.create(
            model=SCRIPTED,
            max_tokens=64,
            tools=[WEATHER],
            messages=[
                {"role": "user", "content": "Weather?"},
                {"role": "assistant", "content": [b.model_dump() for b in first.content]},
                {
                    "role": "user",
                    "content": [
                        {"type": "tool_result", "tool_use_id": tool_use.id, "content": "sunny"}
                    ],
                },
            ],
        )
    assert second.content[0].text == "It is sunny."
    assert second.stop_reason == "end_turn"


async def test_message_start_carries_real_input_tokens_equal_to_count_tokens(
    scripted: Server,
) -> None:
    body = {
        "model": SCRIPTED,
        "max_tokens": 16,
        "tools": [WEATHER],
        "messages": [{"role": "user", "content": "Weather?"}],
    }
    async with scripted.anthropic() as client:
        counted = await client.messages.count_tokens(
            model=SCRIPTED, tools=[WEATHER], messages=body["messages"]
        )
        bigger = await client.messages.count_tokens(
            model=SCRIPTED,
            tools=[WEATHER],
            messages=[{"role": "user", "content": "Weather? " * 50}],
        )
        created = await client.messages.create(**body)
    events = await post_stream(scripted, body)
    start_usage = events[0][1]["message"]["usage"]
    # input_tokens is net of cache reads (Anthropic's convention): the repeat hits.
    assert (
        start_usage["input_tokens"] + start_usage["cache_read_input_tokens"] == counted.input_tokens
    )
    assert start_usage["cache_read_input_tokens"] > 0
    assert created.usage.input_tokens == counted.input_tokens > 0  # the first request ran cold
    assert created.usage.cache_read_input_tokens == 0
    assert bigger.input_tokens > counted.input_tokens
    assert scripted.engine.stats.submitted == 2  # count_tokens did no engine work


async def test_count_tokens_reflects_thinking_and_system(scripted: Server) -> None:
    async with scripted.anthropic() as client:
        plain = await client.messages.count_tokens(
            model=SCRIPTED, messages=[{"role": "user", "content": "x"}]
        )
        with_system = await client.messages.count_tokens(
            model=SCRIPTED, system="Be brief.", messages=[{"role": "user", "content": "x"}]
        )
        thinking = await client.messages.count_tokens(
            model=SCRIPTED,
            thinking={"type": "enabled", "budget_tokens": 1024},
            messages=[{"role": "user", "content": "x"}],
        )
    assert with_system.input_tokens > plain.input_tokens
    assert thinking.input_tokens != plain.input_tokens


async def test_stop_sequence_across_deltas_stops_generation(scripted: Server) -> None:
    body = {
        "model": SCRIPTED,
        "max_tokens": 4000,
        "stop_sequences": [" la la"],
        "messages": [{"role": "user", "content": "LOOP"}],
    }
    async with scripted.anthropic() as client:
        message = await client.messages.create(**body)
    assert message.stop_reason == "stop_sequence" and message.stop_sequence == " la la"
    assert message.content[0].text == "la"
    assert message.usage.output_tokens < 10
    events = await post_stream(scripted, body)
    check_stream_grammar(events)
    text = "".join(d["delta"]["text"] for n, d in events if n == "content_block_delta")
    assert text == "la"
    assert events[-2][1]["delta"] == {"stop_reason": "stop_sequence", "stop_sequence": " la la"}
    await wait_until(lambda: scripted.engine.active_sequences == 0, what="generation stopped")


async def test_thinking_budget_closes_reasoning(scripted: Server) -> None:
    async with scripted.anthropic() as client:
        message = await client.messages.create(
            model=SCRIPTED,
            max_tokens=64,
            thinking={"type": "enabled", "budget_tokens": 1},
            messages=[{"role": "user", "content": "Think."}],
        )
    thinking, text = message.content
    assert thinking.thinking == "Let me"  # cut after one token
    assert text.text == "Sure!"


async def test_max_tokens_stop_reason(scripted: Server) -> None:
    async with scripted.anthropic() as client:
        message = await client.messages.create(
            model=SCRIPTED, max_tokens=2, messages=[{"role": "user", "content": "LOOP"}]
        )
    assert message.stop_reason == "max_tokens"
    assert message.usage.output_tokens == 2


@pytest.mark.parametrize("path", ["/v1/messages", "/v1/messages?beta=true"])
async def test_claude_code_replays_give_valid_streams(scripted: Server, path: str) -> None:
    plain = await post_stream(scripted, agent_fixtures.claude_plain("claude-sonnet-4-5"), path)
    check_stream_grammar(plain)
    assert plain[0][1]["message"]["model"] == "claude-sonnet-4-5"
    kinds = [d["content_block"]["type"] for n, d in plain if n == "content_block_start"]
    assert kinds == ["thinking", "text", "tool_use"]
    toolcall = await post_stream(scripted, agent_fixtures.claude_toolcall("claude-opus-4-1"), path)
    check_stream_grammar(toolcall)
    # thinking is on (adaptive) and the scripted answer after a tool result never
    # closes <think>: it arrives as a thinking block, and as the answer's text.
    blocks = [d["content_block"]["type"] for n, d in toolcall if n == "content_block_start"]
    assert blocks == ["thinking", "text"]
    thought = "".join(
        d["delta"].get("thinking", "") for n, d in toolcall if n == "content_block_delta"
    )
    text = "".join(d["delta"].get("text", "") for n, d in toolcall if n == "content_block_delta")
    assert thought == text == "It is sunny."
    assert any(
        d["delta"]["type"] == "signature_delta" for n, d in toolcall if n == "content_block_delta"
    )


async def test_billing_header_never_reaches_the_prompt(scripted: Server) -> None:
    body = agent_fixtures.claude_plain(SCRIPTED)
    other = json.loads(json.dumps(body))
    other["system"][0]["text"] = "x-anthropic-billing-header: cc_version=1.0.0; cch=zzz999;"
    async with scripted.client() as client:
        a = await client.post("/v1/messages/count_tokens", json=body)
        b = await client.post("/v1/messages/count_tokens", json=other)
        no_header = dict(body, system=body["system"][1:])
        c = await client.post("/v1/messages/count_tokens", json=no_header)
    assert a.json()["input_tokens"] == b.json()["input_tokens"] == c.json()["input_tokens"]


VALIDATION_CASES = [
    ([], "Request body must be a JSON object"),
    (
        {"messages": [{"role": "user", "content": "x"}], "max_tokens": 5},
        "Missing required field: model",
    ),
    ({"model": SCRIPTED, "max_tokens": 5}, "Missing required field: messages"),
    ({"model": SCRIPTED, "max_tokens": 5, "messages": []}, 'Field "messages" must be a non-empty'),
    (
        {"model": SCRIPTED, "messages": [{"role": "user", "content": "x"}]},
        "Missing required field: max_tokens",
    ),
    (
        {"model": SCRIPTED, "max_tokens": 0, "messages": [{"role": "user", "content": "x"}]},
        'Field "max_tokens" must be an integer',
    ),
    (
        {"model": SCRIPTED, "max_tokens": True, "messages": [{"role": "user", "content": "x"}]},
        'Field "max_tokens" must be an integer',
    ),
    (
        {
            "model": SCRIPTED,
            "max_tokens": 2147483648,
            "messages": [{"role": "user", "content": "x"}],
        },
        "between 1 and 2147483647",
    ),
    (
        {"model": SCRIPTED, "max_tokens": 5, "messages": [None]},
        'Field "messages.0" must be an object',
    ),
    (
        {"model": SCRIPTED, "max_tokens": 5, "messages": [{"role": "wizard", "content": "x"}]},
        'Unsupported role "wizard" at messages.0.role',
    ),
    (
        {
            "model": SCRIPTED,
            "max_tokens": 5,
            "system": [{"type": "image"}],
            "messages": [{"role": "user", "content": "x"}],
        },
        'Unsupported type "image" at system.0.type',
    ),
    (
        {
            "model": SCRIPTED,
            "max_tokens": 5,
            "messages": [{"role": "user", "content": [{"type": "video"}]}],
        },
        'Unsupported type "video" at messages.0.content.0.type',
    ),
    (
        {
            "model": SCRIPTED,
            "max_tokens": 5,
            "messages": [{"role": "assistant", "content": [{"type": "audio"}]}],
        },
        'Unsupported type "audio" at messages.0.content.0.type',
    ),
    (
        {
            "model": SCRIPTED,
            "max_tokens": 5,
            "thinking": {"type": "sometimes"},
            "messages": [{"role": "user", "content": "x"}],
        },
        "thinking.type",
    ),
    (
        {
            "model": SCRIPTED,
            "max_tokens": 5,
            "tool_choice": {"type": "tool"},
            "tools": [WEATHER],
            "messages": [{"role": "user", "content": "x"}],
        },
        "Missing required field: tool_choice.name",
    ),
    (
        {
            "model": SCRIPTED,
            "max_tokens": 5,
            "tool_choice": {"type": "tool", "name": "nope"},
            "tools": [WEATHER],
            "messages": [{"role": "user", "content": "x"}],
        },
        'tool_choice references tool "nope"',
    ),
    (
        {
            "model": SCRIPTED,
            "max_tokens": 5,
            "temperature": 3,
            "messages": [{"role": "user", "content": "x"}],
        },
        "temperature",
    ),
    (
        {
            "model": SCRIPTED,
            "max_tokens": 5,
            "stop_sequences": "STOP",
            "messages": [{"role": "user", "content": "x"}],
        },
        "stop_sequences",
    ),
]


@pytest.mark.parametrize(("body", "message"), VALIDATION_CASES)
async def test_validation_rules(scripted: Server, body: object, message: str) -> None:
    async with scripted.client() as client:
        r = await client.post("/v1/messages", json=body)
    assert r.status_code == 400, r.text
    payload = r.json()
    assert payload["type"] == "error"
    assert payload["error"]["type"] == "invalid_request_error"
    assert message in payload["error"]["message"]


def _turns(*blocks: list) -> list[dict]:
    return [{"role": role, "content": content} for role, content in blocks]


def _use(i: str) -> dict:
    return {"type": "tool_use", "id": i, "name": "get_weather", "input": {"city": "x"}}


def _result(i: str) -> dict:
    return {"type": "tool_result", "tool_use_id": i, "content": "ok"}


TOOL_ORDER_CASES = [
    (_turns(("user", "q"), ("user", [_result("a")])), "is not preceded by"),
    (_turns(("user", "q"), ("assistant", [_use("a")])), "trailing turn"),
    (
        _turns(
            ("user", "q"),
            ("assistant", [_use("a"), _use("b")]),
            ("user", [_result("a"), {"type": "text", "text": "more"}]),
        ),
        "unresolved sibling tool calls: b",
    ),
    (
        _turns(("user", "q"), ("assistant", [_use("a")]), ("user", [_result("zz")])),
        'tool_use_id "zz"',
    ),
    (
        _turns(("user", "q"), ("assistant", [_use("a"), _use("a")]), ("user", [_result("a")])),
        "duplicate tool_use_id",
    ),
    (
        _turns(("user", "q"), ("assistant", [_use("a")]), ("user", [_result("a"), _result("a")])),
        "duplicate tool message",
    ),
    (_turns(("user", "q"), ("assistant", [_use("a")]), ("assistant", "x")), "next message"),
]


@pytest.mark.parametrize(("messages", "fragment"), TOOL_ORDER_CASES)
async def test_tool_order_matrix(scripted: Server, messages: list, fragment: str) -> None:
    async with scripted.client() as client:
        r = await client.post(
            "/v1/messages", json={"model": SCRIPTED, "max_tokens": 5, "messages": messages}
        )
    assert r.status_code == 400
    assert fragment in r.json()["error"]["message"]


async def test_reordered_tool_results_are_accepted(scripted: Server) -> None:
    messages = _turns(
        ("user", "q"), ("assistant", [_use("a"), _use("b")]), ("user", [_result("b"), _result("a")])
    )
    async with scripted.client() as client:
        r = await client.post(
            "/v1/messages", json={"model": SCRIPTED, "max_tokens": 8, "messages": messages}
        )
    assert r.status_code == 200
    assert r.json()["content"][0]["text"] == "It is sunny."


async def test_errors_use_the_anthropic_envelope(server_factory, scripted_model_path) -> None:
    server = await server_factory(
        model=scripted_model_path, model_name=SCRIPTED, capacity=1, waiting_room=0
    )
    async with server.client() as client:
        missing = await client.post(
            "/v1/messages",
            json={
                "model": "gpt-4o",
                "max_tokens": 5,
                "messages": [{"role": "user", "content": "x"}],
            },
        )
        holder = await RawConnection.open(server)
        await holder.post_json(
            "/v1/messages",
            {
                "model": SCRIPTED,
                "max_tokens": 10**6,
                "stream": True,
                "messages": [{"role": "user", "content": "LOOP"}],
            },
        )
        await holder.read_until(b"text_delta")
        full = await client.post(
            "/v1/messages",
            json={
                "model": SCRIPTED,
                "max_tokens": 5,
                "messages": [{"role": "user", "content": "x"}],
            },
        )
        await holder.close()
    assert missing.status_code == 404
    assert missing.json()["error"]["type"] == "not_found_error"
    assert full.status_code == 429
    assert full.headers["retry-after"] == "1"
    assert full.json() == {
        "type": "error",
        "error": {"type": "rate_limit_error", "message": full.json()["error"]["message"]},
    }


@pytest.mark.parametrize("stream", [True, False])
async def test_hangup_stops_generation(scripted: Server, stream: bool) -> None:
    conn = await RawConnection.open(scripted)
    body = {
        "model": SCRIPTED,
        "max_tokens": 10**6,
        "stream": stream,
        "messages": [{"role": "user", "content": "LOOP"}],
    }
    await conn.post_json("/v1/messages?beta=true", body)
    await wait_until(lambda: scripted.engine.stats.generated_tokens > 20, what="decoding")
    await conn.close()
    await wait_until(lambda: scripted.engine.stats.cancelled == 1, what="cancelled")
    assert scripted.engine.stats.cancel_latency_steps[-1] <= 2
    await wait_until(lambda: scripted.engine.active_sequences == 0, what="idle")


async def test_ping_keepalive_while_queued(server_factory, scripted_model_path) -> None:
    server = await server_factory(
        model=scripted_model_path, model_name=SCRIPTED, capacity=1, sse_keepalive=0.2
    )
    holder = await RawConnection.open(server)
    await holder.post_json(
        "/v1/messages",
        {
            "model": SCRIPTED,
            "max_tokens": 10**6,
            "stream": True,
            "messages": [{"role": "user", "content": "LOOP"}],
        },
    )
    await holder.read_until(b"text_delta")
    waiter = await RawConnection.open(server)
    await waiter.post_json(
        "/v1/messages",
        {
            "model": SCRIPTED,
            "max_tokens": 9,
            "stream": True,
            "messages": [{"role": "user", "content": "hi"}],
        },
    )
    raw = await waiter.read_until(b"event: ping", timeout=5)
    assert b"event: message_start" in raw
    await holder.close()
    raw = await waiter.read_until(b"event: message_stop")
    await waiter.close()


async def test_a_turn_that_ends_inside_its_reasoning_answers_with_it(scripted: Server) -> None:
    """Never a turn with nothing visible: reasoning the model never closed is
    its answer (Claude Code drops a compaction reply without a text block)."""
    body = {
        "model": SCRIPTED,
        "max_tokens": 200,
        "thinking": {"type": "enabled", "budget_tokens": 100},
        "messages": [{"role": "user", "content": "ONLY think"}],
    }
    async with anthropic.AsyncAnthropic(
        base_url=scripted.url, api_key="unused", max_retries=0
    ) as client:
        message = await client.messages.create(**body)
        async with client.messages.stream(**body) as stream:
            streamed = await stream.get_final_message()
    for reply in (message, streamed):
        kinds = [block.type for block in reply.content]
        assert kinds == ["thinking", "text"], kinds
        assert reply.content[0].thinking == reply.content[1].text == "Meet at ten."
        assert reply.stop_reason == "end_turn"
