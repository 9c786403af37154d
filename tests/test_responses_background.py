"""Background mode of /v1/responses: polling, resuming a stream, cancelling
(real server, scripted model, SQLite store, the official openai SDK)."""

from __future__ import annotations

import httpx
import openai
import pytest
import trio

from .conftest import SCRIPTED, Server, parse_sse, wait_until


async def _poll(client: openai.AsyncOpenAI, response_id: str, until: set[str]) -> object:
    with trio.fail_after(30):
        while True:
            response = await client.responses.retrieve(response_id)
            if response.status in until:
                return response
            await trio.sleep(0.05)


async def test_background_response_is_queued_then_polled_to_completion(scripted: Server) -> None:
    async with scripted.openai() as client:
        created = await client.responses.create(model=SCRIPTED, input="Hi!", background=True)
        assert created.background is True
        assert created.status in ("queued", "in_progress")
        done = await _poll(client, created.id, {"completed"})
    assert done.output_text == "Hello world."  # type: ignore[attr-defined]
    assert done.background is True  # type: ignore[attr-defined]


async def test_background_stream_can_be_resumed_after_any_event(scripted: Server) -> None:
    async with scripted.client() as http:
        async with http.stream(
            "POST",
            "/v1/responses",
            json={"model": SCRIPTED, "input": "Hi!", "background": True, "stream": True},
        ) as live:
            first = parse_sse((await live.aread()).decode())
        types = [data["type"] for _, data in first]
        assert types[:3] == ["response.created", "response.queued", "response.in_progress"]
        assert types[-1] == "response.completed"
        assert [data["sequence_number"] for _, data in first] == list(range(len(first)))
        response_id = first[0][1]["response"]["id"]
        resumed = await http.get(
            f"/v1/responses/{response_id}", params={"stream": "true", "starting_after": "2"}
        )
    again = parse_sse(resumed.text)
    assert again == first[3:]


async def test_cancel_stops_a_running_background_response(scripted: Server) -> None:
    engine = scripted.engine
    async with scripted.openai() as client:
        created = await client.responses.create(
            model=SCRIPTED, input="LOOP forever", background=True, max_output_tokens=4000
        )
        await wait_until(lambda: engine.active_sequences > 0, what="generating")
        cancelled = await client.responses.cancel(created.id)
        assert cancelled.status == "cancelled"
        assert (await client.responses.retrieve(created.id)).status == "cancelled"
        again = await client.responses.cancel(created.id)  # idempotent
        assert again.status == "cancelled"
    await wait_until(lambda: engine.active_sequences == 0, what="engine slot freed")


async def test_background_client_leaving_does_not_stop_the_job(scripted: Server) -> None:
    async with scripted.client() as http:
        async with http.stream(
            "POST",
            "/v1/responses",
            json={"model": SCRIPTED, "input": "Hi!", "background": True, "stream": True},
        ) as live:
            async for line in live.aiter_lines():
                if line.startswith("data:") and '"response.created"' in line:
                    response_id = line.split('"id":"', 1)[1].split('"', 1)[0]
                    break
    async with scripted.openai() as client:
        done = await _poll(client, response_id, {"completed"})
    assert done.output_text == "Hello world."  # type: ignore[attr-defined]


async def test_background_errors(scripted: Server) -> None:
    async with scripted.client() as http:
        no_store = await http.post(
            "/v1/responses",
            json={"model": SCRIPTED, "input": "Hi", "background": True, "store": False},
        )
        unknown = await http.post(
            "/v1/responses", json={"model": "nope", "input": "Hi", "background": True}
        )
        plain = await http.post("/v1/responses", json={"model": SCRIPTED, "input": "Hi"})
        not_background = await http.post(f"/v1/responses/{plain.json()['id']}/cancel")
        not_streamable = await http.get(
            f"/v1/responses/{plain.json()['id']}", params={"stream": "true"}
        )
        missing = await http.post("/v1/responses/resp_nope/cancel")
    assert no_store.status_code == 400 and no_store.json()["error"]["param"] == "store"
    assert unknown.status_code == 404
    assert not_background.status_code == 400
    assert not_streamable.status_code == 400
    assert missing.status_code == 404


async def test_orphaned_background_response_reads_as_failed(scripted: Server) -> None:
    """A background record left queued by a server that stopped: never pending forever."""
    async with scripted.openai() as client:
        created = await client.responses.create(model=SCRIPTED, input="Hi!", background=True)
        await _poll(client, created.id, {"completed"})
    store = scripted.services.store
    record = await store.get(created.id)
    record.response = {**record.response, "status": "in_progress"}
    await store.put(record)
    scripted.services.jobs._jobs.clear()  # as after a restart
    async with httpx.AsyncClient(base_url=scripted.url) as http:
        polled = (await http.get(f"/v1/responses/{created.id}")).json()
    assert polled["status"] == "failed"
    assert "stopped before" in polled["error"]["message"]


async def test_an_unfinished_response_cannot_be_continued_and_delete_stops_the_job(
    scripted: Server,
) -> None:
    engine = scripted.engine
    async with scripted.openai() as client:
        running = await client.responses.create(
            model=SCRIPTED, input="LOOP forever", background=True, max_output_tokens=4000
        )
        await wait_until(lambda: engine.active_sequences > 0, what="generating")
        with pytest.raises(openai.BadRequestError) as refused:
            await client.responses.create(
                model=SCRIPTED, input="next", previous_response_id=running.id
            )
        assert "has not finished" in str(refused.value)
        await client.responses.delete(running.id)
        await wait_until(lambda: engine.active_sequences == 0, what="job stopped")
        with pytest.raises(openai.NotFoundError):
            await client.responses.retrieve(running.id)


async def test_a_failing_job_ends_failed_and_the_server_goes_on(
    scripted: Server, monkeypatch: pytest.MonkeyPatch
) -> None:
    from mlxtrio.api.responses.events import ResponseAssembler

    async def broken(self, *args, **kwargs):  # type: ignore[no-untyped-def]
        raise RuntimeError("assembler bug")

    monkeypatch.setattr(ResponseAssembler, "complete", broken)
    monkeypatch.setattr(ResponseAssembler, "mark_failed", broken)  # the failure path too
    async with scripted.openai() as client:
        first = await client.responses.create(model=SCRIPTED, input="Hi!", background=True)
        failed = await _poll(client, first.id, {"failed", "completed", "incomplete"})
        assert failed.status == "failed"  # type: ignore[attr-defined]
        monkeypatch.undo()
        second = await client.responses.create(model=SCRIPTED, input="Hi!", background=True)
        done = await _poll(client, second.id, {"completed"})
    assert done.output_text == "Hello world."  # type: ignore[attr-defined]


async def test_a_job_waiting_for_a_slot_reads_queued(server_factory, scripted_model_path) -> None:
    """in_progress is announced when the job is admitted, not when it starts."""
    server = await server_factory(model=scripted_model_path, model_name=SCRIPTED, capacity=1)
    engine = server.engine
    async with server.openai() as client:
        hog = await client.responses.create(
            model=SCRIPTED, input="LOOP forever", background=True, max_output_tokens=4000
        )
        await wait_until(lambda: engine.active_sequences == 1, what="slot taken")
        waiting = await client.responses.create(model=SCRIPTED, input="Hi!", background=True)
        await trio.sleep(0.3)
        assert (await client.responses.retrieve(waiting.id)).status == "queued"
        await client.responses.cancel(hog.id)
        done = await _poll(client, waiting.id, {"completed"})
    assert done.output_text == "Hello world."  # type: ignore[attr-defined]
