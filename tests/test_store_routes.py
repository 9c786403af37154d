"""Store faults as clients see them: a PostgreSQL that stopped or hung gives a
clear 503 on reads and a served-but-unstored turn on creation, never a 500 with
internals or a hang; a busy SQLite answers DELETE clearly; the password never
reaches a log or a body; and a turn whose client left before its terminal event
is not left stored."""

from __future__ import annotations

import logging
import sqlite3
from pathlib import Path

import httpx
import pytest
import trio

from mlxtrio.serving.services import STORE_RETRY

from .conftest import SCRIPTED, RawConnection, Server, wait_until
from .test_store_faults import (  # noqa: F401 - fixtures
    PASSWORD,
    PG_HOST,
    FaultyProxy,
    pg_database,
    proxy,
    requires_pg,
)

HI = {"model": SCRIPTED, "input": "hi", "max_output_tokens": 8}
DEADLINE = 1.0  # the servers' store deadlines here
SLACK = 3.0  # a request may take this much longer than the deadline


async def pg_server(
    server_factory, scripted_model_path: str, database: str, port: int, *, wait_open: bool = True
) -> Server:
    """A server on PostgreSQL with short store deadlines, once its store is open
    (unless ``wait_open`` is False).

    Opening (connect, create the schema) may miss the short deadline on a busy
    machine; the server then retries every ``STORE_RETRY`` seconds (what
    production wants), so wait for the store rather than racing that retry."""
    server = await server_factory(
        model=scripted_model_path,
        model_name=SCRIPTED,
        database_url=f"postgresql://postgres:{PASSWORD}@127.0.0.1:{port}/{database}",
        store_timeout=DEADLINE,
        store_write_timeout=DEADLINE,
    )
    if not wait_open:
        return server
    await wait_until(
        lambda: server.services.store is not None,
        timeout=STORE_RETRY + 10,
        what="the response store to open",
    )
    return server


def assert_clear_503(r: httpx.Response) -> None:
    assert r.status_code == 503, r.text
    error = r.json()["error"]
    assert error["type"] == "server_error" and "response store" in error["message"]
    for secret in (PASSWORD, PG_HOST, "psycopg", "sqlalchemy", "postgresql"):
        assert secret not in r.text, secret


@requires_pg
@pytest.mark.parametrize("fault", ["stopped", "hung"])
async def test_postgres_faults_are_clear_and_bounded(
    server_factory,
    scripted_model_path: str,
    pg_database: str,  # noqa: F811
    proxy: FaultyProxy,  # noqa: F811
    fault: str,
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.INFO)
    server = await pg_server(server_factory, scripted_model_path, pg_database, proxy.port)
    async with server.client() as client:
        first = (await client.post("/v1/responses", json=HI)).json()
        assert (await client.get(f"/v1/responses/{first['id']}")).status_code == 200
        proxy.stop() if fault == "stopped" else proxy.hang()
        with trio.fail_after(DEADLINE + SLACK):
            read = await client.get(f"/v1/responses/{first['id']}")
        assert_clear_503(read)
        with trio.fail_after(DEADLINE + SLACK):
            continued = await client.post(
                "/v1/responses", json={**HI, "previous_response_id": first["id"]}
            )
        assert_clear_503(continued)
        with trio.fail_after(DEADLINE + SLACK):
            deleted = await client.delete(f"/v1/responses/{first['id']}")
        assert_clear_503(deleted)
        with trio.fail_after(2 * DEADLINE + SLACK):  # served, just not stored
            fresh = await client.post("/v1/responses", json=HI)
        assert fresh.status_code == 200 and fresh.json()["output_text"] == "Hello world."
        assert (await client.get("/health")).status_code == 200
    logged = "\n".join(r.getMessage() for r in caplog.records)
    assert PASSWORD not in logged
    assert "could not store response" in logged


async def test_delete_on_a_locked_sqlite_store_is_a_clear_error(
    server_factory, scripted_model_path: str, tmp_path: Path
) -> None:
    server = await server_factory(
        model=scripted_model_path,
        model_name=SCRIPTED,
        data_dir=str(tmp_path),
        store_timeout=DEADLINE,
    )
    async with server.client() as client:
        created = (await client.post("/v1/responses", json=HI)).json()
        locker = sqlite3.connect(tmp_path / "responses.db", timeout=0.1)
        try:
            locker.execute("BEGIN IMMEDIATE")  # another writer holds the lock
            with trio.fail_after(DEADLINE + SLACK):
                r = await client.delete(f"/v1/responses/{created['id']}")
        finally:
            locker.rollback()
            locker.close()
        assert_clear_503(r)
        # Busy when the delete meets the lock; on a loaded machine the read
        # before it may already miss the store's deadline: unavailable.
        message = r.json()["error"]["message"]
        assert "busy" in message or "the response store is unavailable" in message
        again = await client.delete(f"/v1/responses/{created['id']}")
    assert again.status_code == 200 and again.json()["deleted"] is True


async def test_a_turn_whose_client_left_before_completed_is_not_kept(
    scripted: Server, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The turn is committed before ``response.completed`` is sent; a client that
    hangs up in between never saw it complete, so it must not stay stored (it
    used to: 34/34 in a soak). The terminal event is held until the client has
    gone, to make that window certain."""
    from mlxtrio.api.responses.events import ResponseAssembler

    store = scripted.services.store
    assert store is not None
    announce = ResponseAssembler.announce
    held = trio.Event()

    async def held_until_the_client_leaves(self: ResponseAssembler) -> None:
        held.set()
        await trio.sleep_forever()  # cancelled when the client hangs up

    monkeypatch.setattr(ResponseAssembler, "announce", held_until_the_client_leaves)
    conn = await RawConnection.open(scripted)
    await conn.post_json("/v1/responses", {**HI, "stream": True})
    with trio.fail_after(30):
        await held.wait()
    assert await store.count() == 1  # written ahead of the announcement
    await conn.close()
    with trio.fail_after(10):
        while await store.count():
            await trio.sleep(0.02)
    # A client that stays to the end keeps its turn.
    monkeypatch.setattr(ResponseAssembler, "announce", announce)
    async with scripted.client() as client:
        async with client.stream("POST", "/v1/responses", json={**HI, "stream": True}) as r:
            text = (await r.aread()).decode()
    assert "response.completed" in text
    assert await store.count() == 1


@requires_pg
async def test_a_store_down_at_start_up_is_retried_in_the_background(
    server_factory,
    scripted_model_path: str,
    pg_database: str,  # noqa: F811
    proxy: FaultyProxy,  # noqa: F811
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from mlxtrio.serving import services as services_module

    monkeypatch.setattr(services_module, "STORE_RETRY", 0.2)
    proxy.stop()  # PostgreSQL is down when the server starts
    server = await pg_server(
        server_factory, scripted_model_path, pg_database, proxy.port, wait_open=False
    )
    async with server.client() as client:
        served = await client.post("/v1/responses", json=HI)  # generation works meanwhile
        assert served.status_code == 200
        down = await client.get("/v1/responses/resp_x")
        assert_clear_503(down)
        assert down.headers["retry-after"] == "30"
        await proxy.start()  # it comes back
        await wait_until(lambda: server.services.store is not None, timeout=20, what="store")
        first = (await client.post("/v1/responses", json=HI)).json()
        continued = await client.post(
            "/v1/responses", json={**HI, "previous_response_id": first["id"]}
        )
    assert continued.status_code == 200, continued.text
