"""The first generation route through the official ``openai`` SDK and raw HTTP."""

from __future__ import annotations

import trio

from .conftest import MODEL, SCRIPTED, Server, parse_sse

REQUIRED_RESPONSE_FIELDS = {
    "id",
    "object",
    "created_at",
    "completed_at",
    "status",
    "error",
    "incomplete_details",
    "instructions",
    "model",
    "output",
    "output_text",
    "parallel_tool_calls",
    "previous_response_id",
    "reasoning",
    "max_output_tokens",
    "temperature",
    "top_p",
    "presence_penalty",
    "frequency_penalty",
    "text",
    "tool_choice",
    "tools",
    "truncation",
    "usage",
    "user",
    "service_tier",
    "store",
    "background",
    "metadata",
}


async def test_sdk_create_returns_full_response_object(server: Server) -> None:
    async with server.openai() as client:
        response = await client.responses.create(
            model=MODEL, input="Say hello.", max_output_tokens=8
        )
    assert response.id.startswith("resp_")
    assert response.status in ("completed", "incomplete")
    assert response.output and response.output[0].type == "message"
    usage = response.usage
    assert usage is not None and usage.input_tokens > 0
    assert usage.output_tokens <= 8
    assert usage.total_tokens == usage.input_tokens + usage.output_tokens
    assert usage.input_tokens_details.cached_tokens == 0
    assert usage.output_tokens_details.reasoning_tokens == 0
    raw = response.model_dump()
    assert REQUIRED_RESPONSE_FIELDS <= set(raw)


async def test_length_finish_is_incomplete(server: Server) -> None:
    async with server.client() as client:
        r = await client.post(
            "/v1/responses", json={"model": MODEL, "input": "hi", "max_output_tokens": 3}
        )
    body = r.json()
    assert r.status_code == 200
    if body["usage"]["output_tokens"] == 3 and body["status"] == "incomplete":
        assert body["incomplete_details"] == {"reason": "max_output_tokens"}
        assert body["output"][0]["status"] == "incomplete"
    else:  # the model stopped by itself within 3 tokens
        assert body["status"] == "completed"


async def test_sdk_stream_accumulates_events(scripted: Server) -> None:
    async with scripted.openai() as client:
        async with client.responses.stream(
            model=SCRIPTED, input="Hi!", max_output_tokens=16
        ) as stream:
            kinds = [event.type async for event in stream]
            final = await stream.get_final_response()
    assert kinds[0] == "response.created"
    assert kinds[1] == "response.in_progress"
    assert kinds[-1] == "response.completed"
    assert "response.output_text.delta" in kinds
    assert final.status == "completed"
    assert final.output_text == "Hello world."
    # Hello, " world.", EOS
    assert final.usage is not None and final.usage.output_tokens == 3


async def test_stream_sequence_numbers_and_item_lifecycle(server: Server) -> None:
    async with server.client() as client:
        r = await client.post(
            "/v1/responses",
            json={"model": MODEL, "input": "hi", "max_output_tokens": 6, "stream": True},
        )
    assert r.headers["content-type"].startswith("text/event-stream")
    events = parse_sse(r.text)
    assert [data["sequence_number"] for _, data in events] == list(range(len(events)))
    assert all(name == data["type"] for name, data in events)
    added = [d["item"]["id"] for n, d in events if n == "response.output_item.added"]
    done = [d["item"]["id"] for n, d in events if n == "response.output_item.done"]
    assert added == done and added
    terminal = [
        n
        for n, _ in events
        if n in ("response.completed", "response.incomplete", "response.failed")
    ]
    assert len(terminal) == 1 and events[-1][0] == terminal[0]


async def test_two_concurrent_requests_share_a_batch(server: Server) -> None:
    async def one() -> None:
        async with server.client() as client:
            r = await client.post(
                "/v1/responses", json={"model": MODEL, "input": "hi", "max_output_tokens": 64}
            )
            assert r.status_code == 200

    async with trio.open_nursery() as nursery:
        nursery.start_soon(one)
        nursery.start_soon(one)
    assert server.engine.stats.max_batch_size >= 2
    assert server.engine.stats.submitted == 2


async def test_instructions_and_item_input_are_accepted(server: Server) -> None:
    async with server.client() as client:
        r = await client.post(
            "/v1/responses",
            json={
                "model": MODEL,
                "instructions": "Be brief.",
                "input": [
                    {"type": "message", "role": "developer", "content": "System rules."},
                    {"role": "user", "content": [{"type": "input_text", "text": "hello"}]},
                ],
                "max_output_tokens": 4,
            },
        )
    assert r.status_code == 200
    assert r.json()["instructions"] == "Be brief."
