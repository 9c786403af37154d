"""Exact Responses event sequences through the real engine on the scripted model."""

from __future__ import annotations

import json

import openai

from .conftest import SCRIPTED, Server, parse_sse
from .scripted_model import EXPECTED_REASONING

WEATHER_TOOL = {
    "type": "function",
    "name": "get_weather",
    "description": "Current weather for a city",
    "parameters": {
        "type": "object",
        "properties": {"city": {"type": "string"}},
        "required": ["city"],
    },
}
TIME_TOOL = {
    "type": "function",
    "name": "get_time",
    "parameters": {"type": "object", "properties": {"zone": {"type": "string"}}},
}


async def stream_events(server: Server, body: dict) -> list[tuple[str, dict]]:
    async with server.client() as client:
        r = await client.post("/v1/responses", json={"model": SCRIPTED, "stream": True, **body})
    assert r.status_code == 200, r.text
    return parse_sse(r.text)


async def test_tool_call_event_sequence(scripted: Server) -> None:
    events = await stream_events(scripted, {"input": "Weather in Paris?", "tools": [WEATHER_TOOL]})
    assert [name for name, _ in events] == [
        "response.created",
        "response.in_progress",
        "response.output_item.added",
        "response.function_call_arguments.delta",
        "response.function_call_arguments.done",
        "response.output_item.done",
        "response.completed",
    ]
    item = events[5][1]["item"]
    assert item["type"] == "function_call" and item["status"] == "completed"
    assert item["name"] == "get_weather"
    assert json.loads(item["arguments"]) == {"city": "Paris"}
    assert item["call_id"].startswith("call_")
    final = events[-1][1]["response"]
    assert final["status"] == "completed"
    assert final["output"] == [item]
    assert final["tools"][0]["strict"] is True  # function tools echo strict


async def test_two_tool_calls_in_one_turn(scripted: Server) -> None:
    events = await stream_events(
        scripted, {"input": "TWO things please", "tools": [WEATHER_TOOL, TIME_TOOL]}
    )
    done = [d["item"] for n, d in events if n == "response.output_item.done"]
    assert [i["name"] for i in done] == ["get_weather", "get_time"]
    assert [d["output_index"] for n, d in events if n == "response.output_item.added"] == [0, 1]
    assert not [n for n, _ in events if n.startswith("response.output_text")]


async def test_reasoning_item_closes_before_message(scripted: Server) -> None:
    events = await stream_events(
        scripted, {"input": "Think first.", "reasoning": {"effort": "medium"}}
    )
    names = [name for name, _ in events]
    assert names == [
        "response.created",
        "response.in_progress",
        "response.output_item.added",
        "response.reasoning_summary_part.added",
        *["response.reasoning_summary_text.delta"]
        * names.count("response.reasoning_summary_text.delta"),
        "response.reasoning_summary_text.done",
        "response.reasoning_summary_part.done",
        "response.output_item.done",
        "response.output_item.added",
        "response.content_part.added",
        *["response.output_text.delta"] * names.count("response.output_text.delta"),
        "response.output_text.done",
        "response.content_part.done",
        "response.output_item.done",
        "response.completed",
    ]
    final = events[-1][1]["response"]
    reasoning, message = final["output"]
    assert reasoning["type"] == "reasoning"
    assert reasoning["summary"] == [{"type": "summary_text", "text": EXPECTED_REASONING}]
    assert message["content"][0]["text"] == "Sure!"
    assert final["output_text"] == "Sure!"
    assert final["usage"]["output_tokens_details"]["reasoning_tokens"] >= 2


async def test_tool_round_trip_by_full_history(scripted: Server) -> None:
    async with openai.AsyncOpenAI(
        base_url=scripted.url + "/v1", api_key="x", max_retries=0
    ) as client:
        first = await client.responses.create(
            model=SCRIPTED, input="Weather?", tools=[WEATHER_TOOL]
        )
        call = first.output[0]
        assert call.type == "function_call"
        second = await client.responses.create(
            model=SCRIPTED,
            tools=[WEATHER_TOOL],
            input=[
                {"role": "user", "content": "Weather?"},
                {
                    "type": "function_call",
                    "call_id": call.call_id,
                    "name": call.name,
                    "arguments": call.arguments,
                },
                {"type": "function_call_output", "call_id": call.call_id, "output": "sunny, 21C"},
            ],
        )
    assert second.status == "completed"
    assert second.output_text == "It is sunny."


async def test_sdk_stream_with_tool_call(scripted: Server) -> None:
    async with openai.AsyncOpenAI(
        base_url=scripted.url + "/v1", api_key="x", max_retries=0
    ) as client:
        async with client.responses.stream(
            model=SCRIPTED, input="Weather?", tools=[WEATHER_TOOL]
        ) as stream:
            async for _ in stream:
                pass
            final = await stream.get_final_response()
    (call,) = final.output
    assert call.type == "function_call"
    assert json.loads(call.arguments) == {"city": "Paris"}


async def test_non_streaming_matches_streaming_output(scripted: Server) -> None:
    async with scripted.client() as client:
        r = await client.post(
            "/v1/responses",
            json={"model": SCRIPTED, "input": "Think.", "reasoning": {"effort": "high"}},
        )
    body = r.json()
    assert [item["type"] for item in body["output"]] == ["reasoning", "message"]
    assert body["output"][1]["status"] == "completed"
    assert body["completed_at"] is not None


async def test_required_tool_choice_opens_a_call_the_model_would_not_make(
    scripted: Server,
) -> None:
    """The "LOOP" script babbles until the cap; a required tool choice forces the
    tool-call marker first, after which the scripted model finishes a real call."""
    body = {"input": "LOOP", "tools": [WEATHER_TOOL], "max_output_tokens": 40}
    async with scripted.client() as client:
        free = (await client.post("/v1/responses", json={"model": SCRIPTED, **body})).json()
        forced = (
            await client.post(
                "/v1/responses", json={"model": SCRIPTED, "tool_choice": "required", **body}
            )
        ).json()
    assert free["status"] == "incomplete"
    assert [i["type"] for i in free["output"]] == ["message"]
    assert forced["status"] == "completed"
    assert [(i["type"], i["name"]) for i in forced["output"]] == [("function_call", "get_weather")]
    assert json.loads(forced["output"][0]["arguments"]) == {"city": "Paris"}


async def test_additional_tools_items_offer_their_tools(scripted: Server) -> None:
    """Codex sends its tools to its own models as an ``additional_tools`` input
    item: they are offered like the request's ``tools``."""
    weather = {
        "type": "function",
        "name": "get_weather",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}},
    }
    async with scripted.client() as client:
        r = await client.post(
            "/v1/responses",
            json={
                "model": SCRIPTED,
                "input": [
                    {"type": "additional_tools", "role": "developer", "tools": [weather]},
                    {"role": "user", "content": "Weather?"},
                ],
            },
        )
    assert r.status_code == 200, r.text
    calls = [i for i in r.json()["output"] if i["type"] == "function_call"]
    assert [c["name"] for c in calls] == ["get_weather"]


async def test_a_turn_that_ends_inside_its_reasoning_answers_with_it(scripted: Server) -> None:
    async with scripted.client() as client:
        r = await client.post(
            "/v1/responses",
            json={"model": SCRIPTED, "input": "ONLY think", "reasoning": {"effort": "medium"}},
        )
    body = r.json()
    assert [i["type"] for i in body["output"]] == ["reasoning", "message"]
    assert body["output_text"] == "Meet at ten."
    assert body["status"] == "completed"


async def test_named_outputs_that_answer_no_call(scripted: Server) -> None:
    """Codex follows its ``create_goal`` call's output with one that answers
    no call, named instead of carrying a ``call_id``: the model reads it as
    context. An output with neither is a 400 naming ``call_id``."""
    async with scripted.client() as client:
        first = await client.post(
            "/v1/responses", json={"model": SCRIPTED, "input": "Weather?", "tools": [WEATHER_TOOL]}
        )
        (call,) = first.json()["output"]
        output = {"type": "function_call_output", "call_id": call["call_id"], "output": "sunny"}
        named = {
            "type": "function_call_output",
            "name": "goal_objective",
            "namespace": "agent",
            "output": "type.txt",
        }
        body = {"model": SCRIPTED, "tools": [WEATHER_TOOL], "store": True}
        second = await client.post(
            "/v1/responses",
            json={**body, "previous_response_id": first.json()["id"], "input": [output, named]},
        )
        anonymous = {"type": "function_call_output", "output": "x"}
        refused = await client.post(
            "/v1/responses",
            json={**body, "previous_response_id": first.json()["id"], "input": [anonymous]},
        )
        counted = await client.post(
            "/v1/responses/input_tokens",
            json={"model": SCRIPTED, "input": [{"role": "user", "content": "hi"}, named]},
        )
    assert second.status_code == 200, second.text
    assert second.json()["status"] == "completed"
    assert refused.status_code == 400
    assert refused.json()["error"]["param"] == "input.0.call_id"
    assert counted.status_code == 200, counted.text
