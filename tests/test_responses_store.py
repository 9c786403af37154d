"""Responses store, continuations, retrieval and Codex-style requests."""

from __future__ import annotations

import json
import sqlite3
import uuid
from pathlib import Path
from typing import Any

import openai
import pytest
import trio

from . import agent_fixtures
from .conftest import SCRIPTED, RawConnection, Server, parse_sse, start_server, wait_until

WEATHER = {
    "type": "function",
    "name": "get_weather",
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


async def answer_weather(client: openai.AsyncOpenAI, first: Any) -> Any:
    """Continue ``first`` (a weather tool call) with the tool's answer."""
    return await client.responses.create(
        model=SCRIPTED,
        previous_response_id=first.id,
        input=[
            {"type": "function_call_output", "call_id": first.output[0].call_id, "output": "sunny"}
        ],
    )


async def test_retrieve_input_items_and_delete(scripted: Server) -> None:
    async with scripted.openai() as client:
        created = await client.responses.create(
            model=SCRIPTED, input="Hi!", instructions="Be nice."
        )
        fetched = await client.responses.retrieve(created.id)
        items = await client.responses.input_items.list(created.id)
        await client.responses.delete(created.id)
        with pytest.raises(openai.NotFoundError):
            await client.responses.retrieve(created.id)
    assert fetched.model_dump() == created.model_dump()
    assert fetched.store is True
    (item,) = items.data
    assert item.type == "message" and item.role == "user"
    assert item.content[0].text == "Hi!"


async def test_store_false_is_honoured(scripted: Server) -> None:
    async with scripted.openai() as client:
        created = await client.responses.create(model=SCRIPTED, input="Hi!", store=False)
        with pytest.raises(openai.NotFoundError):
            await client.responses.retrieve(created.id)
    assert created.store is False


async def test_function_tool_round_trip_via_previous_response_id(scripted: Server) -> None:
    async with scripted.openai() as client:
        first = await client.responses.create(
            model=SCRIPTED, input="Weather in Paris?", tools=[WEATHER], instructions="Use tools."
        )
        call = first.output[0]
        assert call.type == "function_call"
        second = await client.responses.create(
            model=SCRIPTED,
            previous_response_id=first.id,
            tools=[WEATHER],
            input=[{"type": "function_call_output", "call_id": call.call_id, "output": "sunny"}],
        )
    assert second.output_text == "It is sunny."
    assert second.previous_response_id == first.id
    assert second.instructions == "Use tools."  # inherited from the chain


async def test_streamed_turn_is_stored_before_completed_is_sent(scripted: Server) -> None:
    """Continue the instant response.completed arrives: the chain must be there."""
    async with scripted.openai() as client:
        async with client.responses.stream(
            model=SCRIPTED, input="Weather?", tools=[WEATHER]
        ) as stream:
            async for event in stream:
                if event.type == "response.completed":
                    first = event.response
                    break
        call = first.output[0]
        second = await client.responses.create(
            model=SCRIPTED,
            previous_response_id=first.id,
            tools=[WEATHER],
            input=[{"type": "function_call_output", "call_id": call.call_id, "output": "sunny"}],
        )
    assert second.output_text == "It is sunny."


async def _two_calls(client: openai.AsyncOpenAI) -> tuple[str, str, str]:
    first = await client.responses.create(model=SCRIPTED, input="TWO things", tools=[WEATHER, TIME])
    a, b = (item.call_id for item in first.output)
    return first.id, a, b


def _out(call_id: str, text: str = "ok") -> dict:
    return {"type": "function_call_output", "call_id": call_id, "output": text}


async def test_continuation_tool_order_matrix(scripted: Server) -> None:
    async with scripted.openai() as client:
        prev, a, b = await _two_calls(client)
        cases = [
            ([_out(a)], "Missing function_call_output items for outstanding tool calls: " + b),
            ([_out(a), {"role": "user", "content": "x"}, _out(b)], "contiguous prefix"),
            ([_out(a), _out("x"), _out(a)], 'Unexpected function_call_output call_id "x"'),
            ([_out(a), _out(a)], 'Duplicate function_call_output call_id "' + a + '"'),
            (
                [{"role": "user", "content": "hello"}],
                "Previous assistant turn has 2 unresolved tool calls",
            ),
            (
                [
                    {"type": "function_call", "call_id": "forged", "name": "f", "arguments": "{}"},
                    _out(a),
                ],
                'unknown call_id "forged"',
            ),
        ]
        for items, fragment in cases:
            with pytest.raises(openai.BadRequestError) as info:
                await client.responses.create(
                    model=SCRIPTED, previous_response_id=prev, tools=[WEATHER, TIME], input=items
                )
            error = info.value.body
            assert error["param"] == "input", items
            assert fragment in error["message"], (fragment, error["message"])
        # Outputs in reverse order are accepted and stored in call order.
        done = await client.responses.create(
            model=SCRIPTED,
            previous_response_id=prev,
            tools=[WEATHER, TIME],
            input=[_out(b, "B"), _out(a, "A")],
        )
        assert done.output_text == "It is sunny."
        # Echoed calls of the stored turn are dropped, not duplicated.
        echoed = await client.responses.create(
            model=SCRIPTED,
            previous_response_id=prev,
            tools=[WEATHER, TIME],
            input=[
                {"type": "function_call", "call_id": a, "name": "get_weather", "arguments": "{}"},
                _out(a),
                _out(b),
            ],
        )
        assert echoed.output_text == "It is sunny."
        # Nothing outstanding any more: further outputs are rejected.
        with pytest.raises(openai.BadRequestError) as info:
            await client.responses.create(
                model=SCRIPTED, previous_response_id=done.id, input=[_out(a)]
            )
        assert "no outstanding tool call" in info.value.body["message"]
    stored = await scripted.services.store.get(done.id)
    assert [m["tool_call_id"] for m in stored.input_messages] == [a, b]


async def test_stateless_history_reorders_and_rejects_trailing_fanout(scripted: Server) -> None:
    calls = [
        {
            "type": "function_call",
            "call_id": "c1",
            "name": "get_weather",
            "arguments": '{"city": "Paris"}',
        },
        {"type": "function_call", "call_id": "c2", "name": "get_time", "arguments": "{}"},
    ]
    async with scripted.client() as client:
        ok = await client.post(
            "/v1/responses",
            json={
                "model": SCRIPTED,
                "input": [{"role": "user", "content": "q"}, *calls, _out("c2"), _out("c1")],
            },
        )
        trailing = await client.post(
            "/v1/responses",
            json={"model": SCRIPTED, "input": [{"role": "user", "content": "q"}, *calls]},
        )
        orphan = await client.post(
            "/v1/responses",
            json={"model": SCRIPTED, "input": [{"role": "user", "content": "q"}, _out("zz")]},
        )
    assert ok.status_code == 200 and ok.json()["output_text"] == "It is sunny."
    assert trailing.status_code == 400 and "trailing turn" in trailing.json()["error"]["message"]
    assert (
        orphan.status_code == 400
        and "not preceded by an assistant fan-out" in orphan.json()["error"]["message"]
    )


async def test_continuation_errors(server_factory, scripted_model_path) -> None:
    server = await server_factory(
        model=scripted_model_path, model_name=SCRIPTED, database_url="none"
    )
    async with server.client() as client:
        no_store = await client.post(
            "/v1/responses",
            json={"model": SCRIPTED, "input": "x", "previous_response_id": "resp_1"},
        )
    assert no_store.status_code == 400
    assert "requires a response store" in no_store.json()["error"]["message"]


async def test_unknown_previous_response_is_404(scripted: Server) -> None:
    async with scripted.client() as client:
        r = await client.post(
            "/v1/responses",
            json={"model": SCRIPTED, "input": "x", "previous_response_id": "resp_nope"},
        )
        fetched = await client.get("/v1/responses/resp_nope")
        items = await client.get("/v1/responses/resp_nope/input_items")
        deleted = await client.delete("/v1/responses/resp_nope")
    assert r.status_code == 404 and r.json()["error"]["type"] == "not_found_error"
    assert "resp_nope" in r.json()["error"]["message"]
    assert fetched.status_code == items.status_code == deleted.status_code == 404


async def test_expired_responses_are_gone(scripted: Server) -> None:
    async with scripted.client() as client:
        r = await client.post(
            "/v1/responses",
            json={"model": SCRIPTED, "input": "x", "metadata": {"retention_seconds": 60}},
        )
    response_id = r.json()["id"]
    store = scripted.services.store
    record = await store.get(response_id)
    assert 55 <= record.expires_at - record.created_at <= 65
    assert await store.get(response_id, now=record.expires_at + 1) is None
    assert await store.sweep(now=record.expires_at + 1) >= 1
    async with scripted.client() as client:
        gone = await client.get(f"/v1/responses/{response_id}")
    assert gone.status_code == 404


async def test_disconnected_turn_is_never_stored(scripted: Server) -> None:
    conn = await RawConnection.open(scripted)
    await conn.post_json(
        "/v1/responses",
        {"model": SCRIPTED, "input": "LOOP", "stream": True, "max_output_tokens": 10**6},
    )
    raw = await conn.read_until(b"response.output_text.delta")
    response_id = json.loads(raw.split(b"data: ", 1)[1].split(b"\n", 1)[0])["response"]["id"]
    await conn.close()
    await wait_until(lambda: scripted.engine.stats.cancelled == 1, what="cancelled")
    assert await scripted.services.store.get(response_id) is None


async def test_chain_survives_a_restart(scripted_model_path, tmp_path: Path) -> None:
    settings = {"model": scripted_model_path, "model_name": SCRIPTED, "data_dir": str(tmp_path)}
    async with trio.open_nursery() as nursery:
        server = await start_server(nursery, **settings)
        async with server.openai() as client:
            first = await client.responses.create(
                model=SCRIPTED, input="Weather?", tools=[WEATHER], instructions="Rules."
            )
        nursery.cancel_scope.cancel()
    async with trio.open_nursery() as nursery:
        server = await start_server(nursery, **settings)
        async with server.openai() as client:
            second = await answer_weather(client, first)
        nursery.cancel_scope.cancel()
    assert second.output_text == "It is sunny."
    assert second.instructions == "Rules."


async def test_stored_responses_belong_to_their_api_key(server_factory, scripted_model_path):
    """With several keys, another key's response is as good as absent: reading,
    listing its input, deleting and continuing it all answer 404."""
    server = await server_factory(model=scripted_model_path, model_name=SCRIPTED, api_key="a,b")

    def client(key: str) -> openai.AsyncOpenAI:
        return openai.AsyncOpenAI(base_url=server.url + "/v1", api_key=key, max_retries=0)

    async with client("a") as a, client("b") as b:
        first = await a.responses.create(model=SCRIPTED, input="Weather?", tools=[WEATHER])
        output = {
            "type": "function_call_output",
            "call_id": first.output[0].call_id,
            "output": "sunny",
        }
        for attempt in (
            b.responses.retrieve(first.id),
            b.responses.input_items.list(first.id),
            b.responses.delete(first.id),
            b.responses.create(model=SCRIPTED, previous_response_id=first.id, input=[output]),
        ):
            with pytest.raises(openai.NotFoundError):
                await attempt
        assert (await a.responses.retrieve(first.id)).id == first.id
        second = await a.responses.create(
            model=SCRIPTED, previous_response_id=first.id, input=[output]
        )
    assert second.output_text == "It is sunny."


async def test_a_store_from_before_owners_upgrades_in_place(tmp_path: Path) -> None:
    """Alembic 0001 -> head on a real SQLite file: old rows belong to owner ""."""
    from alembic import command
    from alembic.config import Config
    from sqlalchemy import create_engine

    from mlxtrio.store import ResponseStore
    from mlxtrio.store.connect import MIGRATIONS, sqlite_url
    from mlxtrio.store.schema import Base

    url = sqlite_url(tmp_path / "old.db")
    config = Config()
    config.set_main_option("script_location", str(MIGRATIONS))
    with create_engine(url).begin() as connection:
        config.attributes["connection"] = connection
        config.attributes["target_metadata"] = Base.metadata
        command.upgrade(config, "0001")
    db = sqlite3.connect(tmp_path / "old.db")
    db.execute(
        "INSERT INTO mlxtrio_responses VALUES ('resp_old', NULL, 1, 4102444800, 'm', "
        "'completed', NULL, '[]', '[]', '{\"id\": \"resp_old\"}')"
    )
    db.commit()
    db.close()

    store = ResponseStore(url)
    await store.open()  # upgrades to head
    try:
        record = await store.get("resp_old")
    finally:
        await store.close()
    assert record is not None and record.owner == "" and record.response["id"] == "resp_old"


async def test_store_fault_still_delivers_output(
    server_factory, scripted_model_path, tmp_path: Path
) -> None:
    server = await server_factory(
        model=scripted_model_path,
        model_name=SCRIPTED,
        data_dir=str(tmp_path),
        store_write_timeout=0.5,
    )
    locker = sqlite3.connect(tmp_path / "responses.db", timeout=1, isolation_level=None)
    locker.execute("BEGIN EXCLUSIVE")  # another process holds the write lock
    try:
        async with server.openai() as client:
            with trio.fail_after(20):
                async with client.responses.stream(
                    model=SCRIPTED, input="Weather?", tools=[WEATHER]
                ) as stream:
                    final = await stream.get_final_response()
            assert final.output[0].type == "function_call"  # the client got its output
    finally:
        locker.execute("ROLLBACK")
        locker.close()
    async with server.client() as client:
        r = await client.post(
            "/v1/responses",
            json={
                "model": SCRIPTED,
                "previous_response_id": final.id,
                "input": [_out(final.output[0].call_id)],
            },
        )
    assert r.status_code == 404  # a clear 404, never a wrong chain or a hang


def _postgres_url() -> str | None:
    try:
        import psycopg
    except ImportError:
        return None
    try:
        with psycopg.connect(
            "host=127.0.0.1 port=5432 dbname=test user=postgres", connect_timeout=2
        ):
            return "postgresql://postgres@127.0.0.1:5432/test"
    except Exception:
        return None


async def test_store_suite_on_postgresql(server_factory, scripted_model_path) -> None:
    url = _postgres_url()
    if url is None:
        pytest.skip(
            "PostgreSQL is not reachable on 127.0.0.1:5432 (database test); SQLite runs cover the store"
        )
    server = await server_factory(model=scripted_model_path, model_name=SCRIPTED, database_url=url)
    assert server.services.store is not None and server.services.store.url.startswith(
        "postgresql+psycopg"
    )
    async with server.openai() as client:
        first = await client.responses.create(
            model=SCRIPTED, input="Weather?", tools=[WEATHER], metadata={"run": uuid.uuid4().hex}
        )
        second = await client.responses.create(
            model=SCRIPTED,
            previous_response_id=first.id,
            input=[
                {
                    "type": "function_call_output",
                    "call_id": first.output[0].call_id,
                    "output": "sunny",
                }
            ],
        )
        fetched = await client.responses.retrieve(second.id)
        await client.responses.delete(first.id)
        with pytest.raises(openai.NotFoundError):
            await client.responses.retrieve(first.id)
    assert second.output_text == "It is sunny." and fetched.id == second.id


@pytest.mark.parametrize("fixture", ["codex_plain", "codex_toolcall", "codex_patch"])
async def test_codex_replays_stream_to_completed(scripted: Server, fixture: str) -> None:
    body = getattr(agent_fixtures, fixture)(SCRIPTED)
    async with scripted.client() as client:
        r = await client.post("/v1/responses", json=body, headers={"accept": "text/event-stream"})
    assert r.status_code == 200, r.text
    events = parse_sse(r.text)
    assert events[-1][0] == "response.completed"
    added = [d["item"]["id"] for n, d in events if n == "response.output_item.added"]
    done = {d["item"]["id"]: d["item"] for n, d in events if n == "response.output_item.done"}
    assert added and set(added) == set(done)
    final = events[-1][1]["response"]
    assert [i["id"] for i in final["output"]] == added
    assert final["store"] is False
    usage = final["usage"]
    for key in ("input_tokens", "output_tokens", "total_tokens"):
        assert isinstance(usage[key], int)
    assert (
        "cached_tokens" in usage["input_tokens_details"]
        and "reasoning_tokens" in usage["output_tokens_details"]
    )
    async with scripted.client() as client:
        assert (await client.get(f"/v1/responses/{final['id']}")).status_code == 404  # store: false


async def test_custom_tool_call_output_for_apply_patch(scripted: Server) -> None:
    from .scripted_model import PATCH_TEXT

    async with scripted.client() as client:
        r = await client.post("/v1/responses", json=agent_fixtures.codex_patch_first(SCRIPTED))
    events = parse_sse(r.text)
    names = [n for n, _ in events]
    assert (
        "response.custom_tool_call_input.delta" in names
        and "response.custom_tool_call_input.done" in names
    )
    final = events[-1][1]["response"]
    kinds = [item["type"] for item in final["output"]]
    assert kinds[-1] == "custom_tool_call"
    call = final["output"][-1]
    assert (
        call["name"] == "apply_patch"
        and call["input"] == PATCH_TEXT
        and call["call_id"].startswith("call_")
    )
    async with openai.AsyncOpenAI(
        base_url=scripted.url + "/v1", api_key="x", max_retries=0
    ) as sdk_client:
        async with sdk_client.responses.stream(
            **{
                k: v
                for k, v in agent_fixtures.codex_patch_first(SCRIPTED).items()
                if k not in ("stream", "client_metadata")
            },
            extra_body={"client_metadata": {"x": "y"}},
        ) as stream:
            final_sdk = await stream.get_final_response()
    assert final_sdk.output[-1].type == "custom_tool_call"


async def test_sealed_reasoning_round_trip(scripted: Server) -> None:
    body = {
        "model": SCRIPTED,
        "input": "Think.",
        "reasoning": {"effort": "high"},
        "store": False,
        "include": ["reasoning.encrypted_content"],
    }
    async with scripted.client() as client:
        first = (await client.post("/v1/responses", json=body)).json()
        reasoning = first["output"][0]
        assert reasoning["type"] == "reasoning" and reasoning["encrypted_content"]

        async def input_tokens(blob: str) -> int:
            history = [
                {"role": "user", "content": "Think."},
                {
                    "type": "reasoning",
                    "id": "rs_x",
                    "summary": [],
                    "content": None,
                    "encrypted_content": blob,
                },
                {"role": "assistant", "content": "Sure!"},
                {"role": "user", "content": "Again."},
            ]
            r = await client.post(
                "/v1/responses", json={**body, "input": history, "max_output_tokens": 1}
            )
            assert r.status_code == 200, r.text  # a foreign blob is ignored, never a 400
            return r.json()["usage"]["input_tokens"]

        readable = await input_tokens(reasoning["encrypted_content"])
        foreign = await input_tokens("gAAAAA-not-ours")
        tampered = await input_tokens(reasoning["encrypted_content"][:-4] + "AAAA")
    assert readable > foreign == tampered  # only our own blob brought the reasoning back


async def test_text_format_with_a_broken_schema_is_a_clear_400(scripted: Server) -> None:
    """Structured output is served (tests/test_constrained_decoding.py); a
    schema the grammar engine cannot read is the request's fault."""
    schema = {"type": "object", "properties": {"a": {"type": "strin"}}}
    async with scripted.client() as client:
        r = await client.post(
            "/v1/responses",
            json={
                "model": SCRIPTED,
                "input": "x",
                "text": {"format": {"type": "json_schema", "name": "x", "schema": schema}},
            },
        )
    assert r.status_code == 400
    assert r.json()["error"]["param"] == "text.format"
    assert "strin" in r.json()["error"]["message"]


async def test_image_inputs(scripted: Server) -> None:
    png = "iVBORw0KGgoAAAANSUhEUgAAAAIAAAACCAIAAAD91JpzAAAAFklEQVR4nGP8z8DAwMDAxMDAwMDAAAANHQEDasKb6QAAAABJRU5ErkJggg=="
    image = {"type": "input_image", "image_url": f"data:image/png;base64,{png}"}
    remote = {"type": "input_image", "image_url": "https://example.com/cat.png"}
    async with scripted.client() as client:
        ok = await client.post(
            "/v1/responses",
            json={"model": SCRIPTED, "input": [{"role": "user", "content": [image]}]},
        )
        bad = await client.post(
            "/v1/responses",
            json={"model": SCRIPTED, "input": [{"role": "user", "content": [remote]}]},
        )
    assert ok.status_code == 200
    assert bad.status_code == 400 and "data URL" in bad.json()["error"]["message"]
