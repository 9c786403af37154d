"""``POST /v1/responses/input_tokens`` and ``POST /v1/responses/compact`` through
the real server and the official ``openai`` SDK, on the scripted model (whose
greedy output, and so every summary, is exactly known)."""

from __future__ import annotations

from typing import Any

import openai
import pytest

from mlxtrio.api.responses.convert import SUMMARY_HEADING

from . import schemas
from .conftest import SCRIPTED, Server

WEATHER = {
    "type": "function",
    "name": "get_weather",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}},
}
TOKEN_COUNTS = {schemas.OPENAI: "TokenCountsResource", schemas.OPEN_RESPONSES: None}
COMPACTED = {schemas.OPENAI: "CompactResource", schemas.OPEN_RESPONSES: "CompactResource"}
HISTORY: list[dict[str, Any]] = [
    {"role": "user", "content": "Plan a trip to Oslo."},
    {"role": "assistant", "content": "Hello world."},
    {"role": "user", "content": "Make it three days."},
]


def conforms(names: dict[str, str | None], body: Any) -> None:
    problems = schemas.load().check(names, body)
    assert not problems, "\n".join(map(str, problems))


async def compact(client: openai.AsyncOpenAI, **body: Any) -> dict[str, Any]:
    """``client.responses.compact`` as the raw JSON, checked against both
    schemas. (The SDK parses the returned user messages as assistant output
    messages - it does so for OpenAI's own - so its model is not dumped back.)"""
    raw = await client.responses.with_raw_response.compact(**body)
    parsed = raw.parse()
    body = raw.http_response.json()
    assert parsed.id == body["id"] and parsed.object == "response.compaction"
    conforms(COMPACTED, body)
    return dict(body)


async def _count(server: Server, **body: Any) -> int:
    async with server.client() as client:
        r = await client.post("/v1/responses/input_tokens", json=body)
    assert r.status_code == 200, r.text
    conforms(TOKEN_COUNTS, r.json())
    assert r.json()["object"] == "response.input_tokens"
    return int(r.json()["input_tokens"])


async def test_input_tokens_are_exactly_what_generation_renders(scripted: Server) -> None:
    requests: list[dict[str, Any]] = [
        {"input": "Hi!"},
        {"input": HISTORY, "instructions": "Be brief."},
        {"input": "Weather in Paris?", "tools": [WEATHER], "tool_choice": "auto"},
        {"input": "Think.", "reasoning": {"effort": "high"}},
    ]
    async with scripted.openai() as client:
        for request in requests:
            counted = await client.responses.input_tokens.count(model=SCRIPTED, **request)
            created = await client.responses.create(model=SCRIPTED, max_output_tokens=1, **request)
            assert created.usage is not None
            assert counted.input_tokens == created.usage.input_tokens, request
        # A continuation counts the stored chain, as its create would.
        first = await client.responses.create(model=SCRIPTED, input="Hi!", instructions="Be nice.")
        more = {"previous_response_id": first.id, "input": "And Oslo?"}
        counted = await client.responses.input_tokens.count(model=SCRIPTED, **more)
        created = await client.responses.create(model=SCRIPTED, **more)
    assert created.usage is not None and counted.input_tokens == created.usage.input_tokens
    # The schema makes model optional: the default model counts then.
    assert await _count(scripted, input="Hi!") == await _count(
        scripted, model=SCRIPTED, input="Hi!"
    )


async def test_input_tokens_errors_are_creates(scripted: Server) -> None:
    bodies = [
        {"model": "no-such-model", "input": "Hi!"},
        {"model": SCRIPTED, "input": "Hi!", "previous_response_id": "resp_missing"},
        {"model": SCRIPTED, "input": 3},
        {"model": SCRIPTED, "input": [{"type": "function_call_output", "output": "x"}]},
    ]
    async with scripted.client() as client:
        for body in bodies:
            counted = await client.post("/v1/responses/input_tokens", json=body)
            created = await client.post("/v1/responses", json=body)
            assert counted.status_code == created.status_code != 200, body
            assert counted.json() == created.json()
        scripted.engine.loaded.config["max_position_embeddings"] = 40  # a tiny context
        body = {"model": SCRIPTED, "input": "word " * 60}
        counted = await client.post("/v1/responses/input_tokens", json=body)
        created = await client.post("/v1/responses", json=body)
    assert counted.status_code == created.status_code == 400
    assert counted.json()["error"]["code"] == "context_length_exceeded"
    assert counted.json() == created.json()


async def test_compact_then_continue_with_the_compaction_item(scripted: Server) -> None:
    async with scripted.openai() as client:
        raw = await compact(client, model=SCRIPTED, input=HISTORY, instructions="Be brief.")
    assert raw["id"].startswith("resp_") and raw["object"] == "response.compaction"
    *kept, item = raw["output"]
    assert [m["content"] for m in kept] == [
        [{"type": "input_text", "text": "Plan a trip to Oslo."}],
        [{"type": "input_text", "text": "Make it three days."}],
    ]
    assert {m["role"] for m in kept} == {"user"}
    assert item["type"] == "compaction" and item["id"].startswith("cmp_")
    assert "Hello world." not in item["encrypted_content"]  # opaque
    usage = raw["usage"]
    assert usage["output_tokens"] > 0
    assert usage["total_tokens"] == usage["input_tokens"] + usage["output_tokens"]
    assert usage["input_tokens"] > await _count(scripted, model=SCRIPTED, input=HISTORY)

    # The summary (the scripted model's "Hello world.") reaches the model as a user message.
    follow_up = [*raw["output"], {"role": "user", "content": "Go on."}]
    plain = [*kept, {"role": "user", "content": SUMMARY_HEADING + "Hello world."}, follow_up[-1]]
    counted = await _count(scripted, model=SCRIPTED, input=follow_up)
    assert counted == await _count(scripted, model=SCRIPTED, input=plain)
    async with scripted.openai() as client:
        continued = await client.responses.create(model=SCRIPTED, input=follow_up)
    assert continued.output_text == "Hello world."
    assert continued.usage is not None and continued.usage.input_tokens == counted


async def test_compact_a_stored_chain_and_compact_again(scripted: Server) -> None:
    async with scripted.openai() as client:
        first = await client.responses.create(model=SCRIPTED, input="Plan a trip to Oslo.")
        compacted = await compact(
            client, model=SCRIPTED, previous_response_id=first.id, input="Make it three days."
        )
        once = compacted["output"]
        again = await compact(
            client, model=SCRIPTED, input=[*once, {"role": "user", "content": "And Bergen."}]
        )
        with pytest.raises(openai.NotFoundError):  # never stored: not a turn of a chain
            await client.responses.retrieve(compacted["id"])
    texts = [m["content"][0]["text"] for m in once[:-1]]
    assert texts == ["Plan a trip to Oslo.", "Make it three days."]
    twice = again["output"]
    # The earlier summary is replaced by the new one, not kept as a user message.
    assert [m["content"][0]["text"] for m in twice[:-1]] == [*texts, "And Bergen."]
    assert twice[-1]["type"] == "compaction"


async def test_compact_errors(scripted: Server) -> None:
    async with scripted.openai() as client:
        good = await compact(client, model=SCRIPTED, input="Hi!")
        reasoned = await client.responses.create(
            model=SCRIPTED,
            input="Think.",
            reasoning={"effort": "high"},
            include=["reasoning.encrypted_content"],
            store=False,
        )
    blob = good["output"][-1]["encrypted_content"]
    reasoning_blob = reasoned.output[0].model_dump()["encrypted_content"]
    forged = [
        {"type": "compaction", "id": "cmp_tampered", "encrypted_content": blob[:-4] + "AAAA"},
        {"type": "compaction", "encrypted_content": "gAAAAABpM0Yj-not-ours"},
        {"type": "compaction", "id": "cmp_reasoning", "encrypted_content": reasoning_blob},
    ]
    async with scripted.client() as client:
        missing = await client.post("/v1/responses/compact", json={"input": "Hi!"})
        unknown = await client.post("/v1/responses/compact", json={"model": "nope", "input": "x"})
        unknown_create = await client.post("/v1/responses", json={"model": "nope", "input": "x"})
        empty = await client.post("/v1/responses/compact", json={"model": SCRIPTED})
        for item in forged:
            for path in ("/v1/responses", "/v1/responses/compact", "/v1/responses/input_tokens"):
                r = await client.post(path, json={"model": SCRIPTED, "input": [item]})
                assert r.status_code == 400, (path, r.text)
                message = r.json()["error"]["message"]
                assert message.startswith("compaction item ") and "cannot be read" in message
                assert item.get("id", "number 1") in message
    assert missing.status_code == 400
    assert missing.json()["error"]["message"] == "Missing required field: model"
    assert unknown.status_code == unknown_create.status_code == 404
    assert unknown.json() == unknown_create.json()
    assert empty.status_code == 400 and "nothing to compact" in empty.json()["error"]["message"]


async def test_compact_needs_room_for_a_summary_and_a_summary(scripted: Server) -> None:
    async with scripted.openai() as client:
        done = await compact(client, model=SCRIPTED, input="Hi!")
    async with scripted.client() as client:
        # Offered tools: the scripted model opens a tool call and writes no summary.
        r = await client.post(
            "/v1/responses/compact",
            json={"model": SCRIPTED, "input": "Weather?", "tools": [WEATHER]},
        )
        assert r.status_code == 500 and r.json()["error"]["code"] == "empty_summary"
        # The summarization prompt fits, but leaves too little room for a summary.
        prompt = done["usage"]["input_tokens"]
        scripted.engine.loaded.config["max_position_embeddings"] = prompt + 100
        r = await client.post("/v1/responses/compact", json={"model": SCRIPTED, "input": "Hi!"})
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["code"] == "context_length_exceeded" and error["param"] == "input"
    assert error["message"].startswith(f"prompt is too long: {prompt} tokens ")
    assert "leave 100 of" in error["message"]


async def test_routes_under_responses_are_not_taken_for_response_ids(scripted: Server) -> None:
    async with scripted.client() as client:
        compact = await client.post("/v1/responses/compact", json={"model": SCRIPTED})
        tokens = await client.post("/v1/responses/input_tokens", json={"input": "x"})
        fetched = await client.get("/v1/responses/compact")
    assert compact.status_code == 400 and tokens.status_code == 200
    assert fetched.status_code == 404  # a response id like any other
