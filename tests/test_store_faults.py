"""Response store faults, with real parts: a real SQLite file, and the real
PostgreSQL on 127.0.0.1:5432 behind a Trio TCP proxy that can fail like a
server - stop (refuse and cut connections) or hang (accept, then never answer).

Every store call must return or raise within its deadline, errors must be safe to
show, and a write whose caller gave up must never stay in the database.
"""

from __future__ import annotations

import logging
import os
import sqlite3
import subprocess
import time
import traceback
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any
from urllib.parse import quote

import pytest
import trio
from sqlalchemy import Engine, create_engine, event
from sqlalchemy.exc import OperationalError
from sqlalchemy.orm import Session

from mlxtrio.store import (
    ResponseStore,
    StoreBusy,
    StoredResponse,
    StoreError,
    StoreReadOnly,
    StoreUnavailable,
)
from mlxtrio.store import store as store_module
from mlxtrio.store.connect import sqlite_url
from mlxtrio.store.errors import Redactor, translate
from mlxtrio.store.schema import ResponseRow

PG_HOST, PG_PORT = "127.0.0.1", 5432
PASSWORD = "s3cret"  # trust auth ignores it; it must never show up anywhere
TIMEOUT = 1.0  # the store's deadline in these tests
SLACK = 4.0  # how much later than the deadline a call may return on a busy machine


def _postgres_reachable() -> bool:
    try:
        import psycopg

        with psycopg.connect(
            host=PG_HOST, port=PG_PORT, dbname="postgres", user="postgres", connect_timeout=2
        ):
            return True
    except Exception:
        return False


PG = _postgres_reachable()
if not PG and os.environ.get("MLXTRIO_REQUIRE_POSTGRES"):
    # CI has a PostgreSQL: its absence there is a failure, not a reason to skip.
    raise RuntimeError("MLXTRIO_REQUIRE_POSTGRES is set but 127.0.0.1:5432 does not answer")
requires_pg = pytest.mark.skipif(not PG, reason="PostgreSQL not reachable on 127.0.0.1:5432")


# -- records ------------------------------------------------------------------------


def record(
    response_id: str | None = None, previous: str | None = None, expires_at: int | None = None
) -> StoredResponse:
    response_id = response_id or f"resp_{uuid.uuid4().hex}"
    return StoredResponse(
        id=response_id,
        previous_response_id=previous,
        created_at=1,
        expires_at=expires_at or int(time.time()) + 3600,
        model="m",
        status="completed",
        instructions=None,
        input_messages=[{"role": "user", "content": "hi"}],
        input_items=[],
        response={"id": response_id},
    )


async def eventually(predicate: Callable[[], bool], what: str, timeout: float = 10.0) -> None:
    with trio.move_on_after(timeout):
        while not predicate():
            await trio.sleep(0.01)
        return
    raise AssertionError(f"timed out waiting for {what}")


async def raises_within(
    kind: type[StoreError], call: Awaitable[Any], limit: float = TIMEOUT + SLACK
) -> StoreError:
    """Await ``call``; it must raise ``kind`` within ``limit`` seconds."""
    start = trio.current_time()
    with trio.fail_after(limit + 5):  # a hang fails the test instead of blocking it
        with pytest.raises(kind) as caught:
            await call
    elapsed = trio.current_time() - start
    assert elapsed < limit, f"{kind.__name__} after {elapsed:.2f} s (limit {limit} s)"
    return caught.value


def assert_safe(error: StoreError, *secrets: str) -> None:
    """A client may see str(error); logs get .detail and the traceback."""
    text = str(error)
    assert text.startswith("the response store "), text
    for secret in (PASSWORD, PG_HOST, "postgres", "psycopg", "sqlalchemy", "/", *secrets):
        assert secret.lower() not in text.lower(), (secret, text)
    logged = error.detail + "".join(traceback.format_exception(error))
    assert PASSWORD not in logged


@pytest.fixture(scope="module", autouse=True)
def _warm_imports(tmp_path_factory: pytest.TempPathFactory) -> None:
    """A first open imports Alembic and the drivers: pay that once, outside the
    tests' one-second deadlines."""
    trio.run(_migrate, sqlite_url(tmp_path_factory.mktemp("warm") / "responses.db"))


# -- PostgreSQL: a database per module, a fault-injecting proxy in front of it -------


@pytest.fixture(scope="module")
def pg_database() -> Iterator[str]:
    import psycopg

    name = f"mlxtrio_test_{uuid.uuid4().hex[:12]}"
    admin = f"host={PG_HOST} port={PG_PORT} dbname=postgres user=postgres"
    with psycopg.connect(admin, autocommit=True) as connection:
        connection.execute(f'CREATE DATABASE "{name}"')
    # Create the schema now, without a deadline (a first open imports the driver
    # and runs every migration): the tests' stores open in well under TIMEOUT.
    trio.run(_migrate, f"postgresql://postgres@{PG_HOST}:{PG_PORT}/{name}")
    yield name
    with psycopg.connect(admin, autocommit=True) as connection:
        # FORCE: connections of threads a test left blocked must not keep it alive.
        connection.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')


async def _migrate(url: str) -> None:
    store = ResponseStore(url, timeout=60.0)
    await store.open()
    await store.close()


def pg_row_exists(database: str, response_id: str) -> bool:
    """Look at the database directly, not through the store or the proxy."""
    import psycopg

    with psycopg.connect(
        host=PG_HOST, port=PG_PORT, dbname=database, user="postgres", connect_timeout=5
    ) as connection:
        row = connection.execute(
            "SELECT 1 FROM mlxtrio_responses WHERE id = %s", (response_id,)
        ).fetchone()
    return row is not None


class FaultyProxy:
    """A TCP proxy to PostgreSQL that can fail like the server behind it.

    ``stop()``: stop listening (new connections are refused) and cut every open
    connection - PostgreSQL stopped. ``hang()``: keep accepting, stop forwarding
    bytes either way - PostgreSQL hung (its kernel still accepts and acknowledges).
    ``hang_on(marker)``: hang as the client sends bytes containing ``marker``
    (e.g. ``b"COMMIT"``), setting ``held``. ``start()`` / ``resume()`` undo them.
    """

    def __init__(self, nursery: trio.Nursery) -> None:
        self._nursery = nursery
        self.port = 0
        self._listening: trio.CancelScope | None = None
        self._connections: set[trio.CancelScope] = set()
        self._forwarding = True
        self._resumed = trio.Event()
        self._marker: bytes | None = None
        self.held = trio.Event()

    async def start(self) -> None:
        (listener,) = await trio.open_tcp_listeners(self.port, host="127.0.0.1")
        self.port = listener.socket.getsockname()[1]
        self._listening = await self._nursery.start(self._accept, listener)

    def stop(self) -> None:
        assert self._listening is not None
        self._listening.cancel()
        for scope in self._connections:
            scope.cancel()

    def hang(self) -> None:
        self._forwarding = False
        self._resumed = trio.Event()

    def hang_on(self, marker: bytes) -> None:
        self._marker = marker
        self.held = trio.Event()

    def resume(self) -> None:
        self._forwarding = True
        self._resumed.set()

    async def _accept(
        self, listener: trio.SocketListener, task_status: trio.TaskStatus[trio.CancelScope]
    ) -> None:
        with trio.CancelScope() as scope:
            task_status.started(scope)
            async with listener:  # closing it makes new connections fail: refused
                while True:
                    client = await listener.accept()
                    self._nursery.start_soon(self._relay, client)

    async def _relay(self, client: trio.SocketStream) -> None:
        with trio.CancelScope() as scope:
            self._connections.add(scope)
            try:
                async with client:
                    upstream = await trio.open_tcp_stream(PG_HOST, PG_PORT)
                    async with upstream, trio.open_nursery() as nursery:
                        nursery.start_soon(self._pump, client, upstream, True, nursery.cancel_scope)
                        nursery.start_soon(
                            self._pump, upstream, client, False, nursery.cancel_scope
                        )
            except (trio.BrokenResourceError, trio.ClosedResourceError, OSError):
                pass
            finally:
                self._connections.discard(scope)

    async def _pump(
        self, source: trio.SocketStream, sink: trio.SocketStream, from_client: bool, pair: Any
    ) -> None:
        async for data in source:
            if from_client and self._marker is not None and self._marker in data:
                self._marker = None
                self.hang()
                self.held.set()
            while not self._forwarding:
                await self._resumed.wait()
            await sink.send_all(data)
        pair.cancel()  # one side closed: close both


@pytest.fixture
async def proxy(nursery: trio.Nursery) -> FaultyProxy:
    proxy = FaultyProxy(nursery)
    await proxy.start()
    return proxy


StoreFactory = Callable[..., Awaitable[ResponseStore]]


@pytest.fixture
async def pg_store(pg_database: str, proxy: FaultyProxy) -> AsyncIterator[StoreFactory]:
    """Open stores on the test database through the proxy (with a password)."""
    stores: list[ResponseStore] = []

    async def factory(**kwargs: Any) -> ResponseStore:
        url = f"postgresql://postgres:{PASSWORD}@127.0.0.1:{proxy.port}/{pg_database}"
        store = ResponseStore(url, **{"timeout": TIMEOUT, **kwargs})
        stores.append(store)
        await store.open()
        return store

    yield factory
    proxy.resume()
    for store in stores:
        await store.close()


def all_calls(
    store: ResponseStore, response_id: str, discarded_id: str
) -> dict[str, Callable[[], Awaitable[Any]]]:
    return {
        "get": lambda: store.get(response_id),
        "chain": lambda: store.chain(response_id),
        "delete": lambda: store.delete(response_id),
        "count": lambda: store.count(),
        "sweep": lambda: store.sweep(),
        "put": lambda: store.put(record()),
        "discard": lambda: store.discard(discarded_id),
    }


# -- PostgreSQL stopped or hung --------------------------------------------------------


@requires_pg
async def test_stopped_postgres_every_call_is_unavailable_then_recovers(
    pg_store: StoreFactory, proxy: FaultyProxy
) -> None:
    store = await pg_store()
    kept = record()
    await store.put(kept)
    proxy.stop()
    for name, call in all_calls(store, kept.id, kept.id).items():
        error = await raises_within(StoreUnavailable, call())
        assert_safe(error, str(proxy.port))
        assert error.detail != str(error), name  # the log line says why
    await proxy.start()  # PostgreSQL is back: the pool reconnects
    got = await store.get(kept.id)
    assert got is not None and got.id == kept.id


@requires_pg
async def test_open_against_stopped_or_hung_postgres(
    pg_store: StoreFactory, proxy: FaultyProxy
) -> None:
    proxy.stop()
    refused = await raises_within(StoreUnavailable, pg_store())
    assert_safe(refused, str(proxy.port))
    await proxy.start()
    proxy.hang()
    hung = await raises_within(StoreUnavailable, pg_store())
    assert_safe(hung, str(proxy.port))
    assert str(hung) == "the response store did not answer in time"


@requires_pg
async def test_hung_postgres_every_call_is_unavailable_then_recovers(
    pg_store: StoreFactory, proxy: FaultyProxy, pg_database: str
) -> None:
    store = await pg_store()
    kept, discarded = record(), record()
    await store.put(kept)
    await store.put(discarded)
    proxy.hang()
    errors: list[StoreError] = []

    async def attempt(call: Callable[[], Awaitable[Any]]) -> None:
        errors.append(await raises_within(StoreUnavailable, call()))

    async with trio.open_nursery() as nursery:  # concurrently: ~1 s in all
        for call in all_calls(store, kept.id, discarded.id).values():
            nursery.start_soon(attempt, call)
    for error in errors:
        assert_safe(error, str(proxy.port))
    assert store.threads_in_use <= store.threads  # blocked threads stay bounded
    proxy.resume()
    await eventually(lambda: store.threads_in_use == 0, "the blocked threads to finish")
    await store.sweep()  # retries the discard if it never got a thread
    # The abandoned delete was rolled back; the discard, a cleanup, went through.
    assert await trio.to_thread.run_sync(pg_row_exists, pg_database, kept.id)
    assert not await trio.to_thread.run_sync(pg_row_exists, pg_database, discarded.id)
    assert await store.get(kept.id) is not None


@requires_pg
async def test_stuck_threads_stay_bounded_and_later_calls_fail_fast(
    pg_store: StoreFactory, proxy: FaultyProxy
) -> None:
    store = await pg_store(threads=2)
    await store.count()
    proxy.hang()
    async with trio.open_nursery() as nursery:
        for _ in range(3):  # the third waits for a thread, and gives up in time too
            nursery.start_soon(raises_within, StoreUnavailable, store.count())
    assert store.threads_in_use == 2
    # Every thread is stuck on a call that timed out: fail at once, no waiting.
    await raises_within(StoreUnavailable, store.get("resp_x"), limit=0.2)
    proxy.resume()
    await eventually(lambda: store.threads_in_use == 0, "the stuck threads to finish")
    assert await store.get("resp_x") is None


@requires_pg
async def test_put_to_hung_postgres_times_out_and_never_lands(
    pg_store: StoreFactory, proxy: FaultyProxy, pg_database: str
) -> None:
    store = await pg_store()
    lost = record()
    proxy.hang()
    await raises_within(StoreUnavailable, store.put(lost))
    proxy.resume()
    await eventually(lambda: store.threads_in_use == 0, "the abandoned write to finish")
    assert not await trio.to_thread.run_sync(pg_row_exists, pg_database, lost.id)


@requires_pg
@pytest.mark.parametrize("marker", [b"INSERT INTO mlxtrio_responses", b"COMMIT"])
async def test_put_past_its_deadline_mid_write_never_lands(
    pg_store: StoreFactory,
    proxy: FaultyProxy,
    pg_database: str,
    marker: bytes,
    caplog: pytest.LogCaptureFixture,
) -> None:
    """The server hangs as the INSERT (rolled back) or the COMMIT (compensated)
    arrives; it answers after the caller gave up."""
    caplog.set_level(logging.INFO, logger="mlxtrio.store")
    store = await pg_store()
    await store.count()
    lost = record()
    proxy.hang_on(marker)
    await raises_within(StoreUnavailable, store.put(lost))
    assert proxy.held.is_set()
    proxy.resume()
    await eventually(lambda: store.threads_in_use == 0, "the abandoned write to finish")
    assert not await trio.to_thread.run_sync(pg_row_exists, pg_database, lost.id)
    took_back = f"took back the write of response {lost.id}" in caplog.text
    assert took_back == (marker == b"COMMIT")  # COMMIT in flight: compensated


@requires_pg
@pytest.mark.parametrize("marker", [b"INSERT INTO mlxtrio_responses", b"COMMIT"])
async def test_put_cancelled_by_its_caller_mid_write_never_lands(
    pg_store: StoreFactory,
    proxy: FaultyProxy,
    pg_database: str,
    marker: bytes,
    caplog: pytest.LogCaptureFixture,
) -> None:
    """The client hangs up (its task is cancelled) while the write is in flight."""
    caplog.set_level(logging.INFO, logger="mlxtrio.store")
    store = await pg_store(timeout=30.0)  # no deadline involved: only the cancel
    await store.count()
    lost = record()
    proxy.hang_on(marker)
    with trio.fail_after(10):
        async with trio.open_nursery() as nursery:
            nursery.start_soon(store.put, lost)
            await proxy.held.wait()
            nursery.cancel_scope.cancel()  # returns at once: the put is abandoned
    assert store.threads_in_use == 1
    proxy.resume()
    await eventually(lambda: store.threads_in_use == 0, "the abandoned write to finish")
    assert not await trio.to_thread.run_sync(pg_row_exists, pg_database, lost.id)
    took_back = f"took back the write of response {lost.id}" in caplog.text
    assert took_back == (marker == b"COMMIT")


@requires_pg
async def test_discard_runs_even_when_its_caller_is_cancelled(
    pg_store: StoreFactory, pg_database: str
) -> None:
    store = await pg_store()
    done = record()
    await store.put(done)
    with trio.CancelScope() as scope:
        scope.cancel()  # the client already left: cleanup code still runs
        assert await store.discard(done.id) is True
    assert not await trio.to_thread.run_sync(pg_row_exists, pg_database, done.id)


@requires_pg
async def test_errors_and_logs_never_show_the_password(
    pg_store: StoreFactory, proxy: FaultyProxy, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.DEBUG)
    store = await pg_store()
    assert PASSWORD not in store.redacted_url and "***" in store.redacted_url
    proxy.stop()
    with pytest.raises(StoreUnavailable) as caught:
        await store.get("resp_x")
    assert_safe(caught.value, str(proxy.port))
    assert PASSWORD not in caplog.text


def test_details_for_logs_are_redacted() -> None:
    password = "p@ss/w:rd s3cret"
    url = "postgresql://postgres:" + quote(password, safe="") + "@db.example:5432/x"
    quoted = f"could not connect to {url} with password {password!r}"
    error = translate(
        OperationalError("SELECT 1", None, sqlite3.OperationalError(quoted)), Redactor(url)
    )
    assert isinstance(error, StoreUnavailable)
    assert str(error) == "the response store is unavailable"
    assert "s3cret" not in error.detail and "p%40ss" not in error.detail
    assert "postgres:***@db.example" in error.detail


async def test_ids_no_row_can_have_are_unknown(sqlite_store: ResponseStore) -> None:
    for odd in ["\ud800", "a\x00b", "x" * 65]:
        assert await sqlite_store.get(odd) is None
        assert await sqlite_store.chain(odd) is None
        assert await sqlite_store.delete(odd) is False
        assert await sqlite_store.discard(odd) is False


# -- chains: one query, same answers as walking the parents one by one ----------------


def walk_chain(engine: Engine, response_id: str, now: int, limit: int) -> list[str] | None:
    """The store's chain semantics as they were: one ``session.get`` per ancestor."""
    ids: list[str] = []
    seen: set[str] = set()
    next_id: str | None = response_id
    with Session(engine) as session:
        while next_id is not None:
            if next_id in seen or len(ids) >= limit:
                return None
            seen.add(next_id)
            row = session.get(ResponseRow, next_id)
            if row is None or row.expires_at <= now:
                return None
            ids.append(row.id)
            next_id = row.previous_response_id
    return ids[::-1]


CHAIN_GRAPH: dict[str, tuple[str | None, bool]] = {  # id: (parent, expired)
    "a1": (None, False),
    "a2": ("a1", False),
    "a3": ("a2", False),
    "a4": ("a3", False),  # exactly the limit (4)
    "a5": ("a4", False),  # one over the limit
    "b1": (None, True),
    "b2": ("b1", False),  # expired ancestor
    "b3": ("b2", True),  # expired leaf
    "c2": ("c-gone", False),  # missing ancestor
    "c3": ("c2", False),
    "d1": ("d2", False),  # a cycle
    "d2": ("d1", False),
    "e1": ("e1", False),  # a self-loop
    "f1": (None, False),  # a lone root
    "f2": ("f1", False),  # a branch off f1
    "f3": ("f1", False),
}


async def check_chains(store: ResponseStore, monkeypatch: pytest.MonkeyPatch) -> None:
    limit = 4
    monkeypatch.setattr(store_module, "MAX_CHAIN", limit)
    now = int(time.time())
    prefix = uuid.uuid4().hex[:8]  # the PostgreSQL database is shared by the module
    key = {name: f"{prefix}_{name}" for name in [*CHAIN_GRAPH, "c-gone", "nope"]}
    for name, (parent, expired) in CHAIN_GRAPH.items():
        expires = now - 10 if expired else now + 3600
        await store.put(record(key[name], parent and key[parent], expires))
    statements: list[str] = []

    def count(_conn: Any, _cursor: Any, statement: str, *_args: Any) -> None:
        statements.append(statement)

    reference = create_engine(store.url)
    event.listen(Engine, "before_cursor_execute", count)
    try:
        for name in [*CHAIN_GRAPH, "nope"]:
            expected = await trio.to_thread.run_sync(walk_chain, reference, key[name], now, limit)
            statements.clear()
            chain = await store.chain(key[name], now=now)
            assert len(statements) == 1 and statements[0].lstrip().upper().startswith("WITH")
            assert (None if chain is None else [r.id for r in chain]) == expected, name
            if chain is not None:
                assert chain == [await store.get(r.id, now=now) for r in chain]  # whole records
    finally:
        event.remove(Engine, "before_cursor_execute", count)
        await trio.to_thread.run_sync(reference.dispose)
    chain = await store.chain(key["a4"], now=now)
    assert chain is not None and [r.id for r in chain] == [key[f"a{i}"] for i in range(1, 5)]


async def test_chain_is_one_query_on_sqlite(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    store = ResponseStore(sqlite_url(tmp_path / "responses.db"), timeout=TIMEOUT)
    await store.open()
    try:
        await check_chains(store, monkeypatch)
    finally:
        await store.close()


@requires_pg
async def test_chain_is_one_query_on_postgres(
    pg_store: StoreFactory, monkeypatch: pytest.MonkeyPatch
) -> None:
    await check_chains(await pg_store(), monkeypatch)


# -- SQLite: locked, read-only ----------------------------------------------------------


@pytest.fixture
async def sqlite_store(tmp_path: Path) -> AsyncIterator[ResponseStore]:
    store = ResponseStore(sqlite_url(tmp_path / "responses.db"), timeout=TIMEOUT)
    await store.open()
    yield store
    await store.close()


@contextmanager
def sqlite_write_lock(path: Path) -> Iterator[None]:
    """Another connection holds an open write transaction."""
    locker = sqlite3.connect(path, isolation_level=None)
    locker.execute("BEGIN IMMEDIATE")
    try:
        yield
    finally:
        locker.execute("ROLLBACK")
        locker.close()


async def test_locked_sqlite_delete_and_put_say_busy(
    sqlite_store: ResponseStore, tmp_path: Path
) -> None:
    kept, refused = record(), record()
    await sqlite_store.put(kept)
    with sqlite_write_lock(tmp_path / "responses.db"):
        busy = await raises_within(StoreBusy, sqlite_store.delete(kept.id))
        assert str(busy) == "the response store is busy"
        assert_safe(busy, str(tmp_path))
        await raises_within(StoreBusy, sqlite_store.put(refused))
        assert await sqlite_store.get(kept.id) is not None  # reads go on (WAL)
    assert await sqlite_store.get(refused.id) is None
    assert await sqlite_store.delete(kept.id) is True


async def test_locked_sqlite_past_the_deadline_is_unavailable(tmp_path: Path) -> None:
    store = ResponseStore(sqlite_url(tmp_path / "responses.db"), timeout=TIMEOUT, busy_timeout=10)
    await store.open()
    try:
        with sqlite_write_lock(tmp_path / "responses.db"):
            await raises_within(StoreUnavailable, store.delete("resp_x"))
    finally:
        await store.close()


async def test_put_cancelled_while_waiting_for_the_sqlite_lock_never_lands(
    tmp_path: Path,
) -> None:
    store = ResponseStore(sqlite_url(tmp_path / "responses.db"), timeout=30.0)
    await store.open()
    lost = record()
    try:
        with sqlite_write_lock(tmp_path / "responses.db"):
            with trio.move_on_after(0.3):
                await store.put(lost)  # waits on SQLite's busy handler
            assert store.threads_in_use == 1
        # The lock is free: the abandoned thread gets it, then must roll back.
        await eventually(lambda: store.threads_in_use == 0, "the abandoned write to finish")
        assert await store.get(lost.id) is None
        assert await store.count() == 0
    finally:
        await store.close()


@contextmanager
def read_only(*paths: Path) -> Iterator[None]:
    """Make files or directories read-only - for root too (``chattr +i``)."""
    if getattr(os, "geteuid", lambda: -1)() != 0:
        modes = {path: path.stat().st_mode for path in paths}
        for path in paths:
            path.chmod(0o555 if path.is_dir() else 0o444)
        try:
            yield
        finally:
            for path, mode in modes.items():
                path.chmod(mode)
        return
    try:
        subprocess.run(["chattr", "+i", *map(str, paths)], check=True, capture_output=True)
    except (OSError, subprocess.CalledProcessError):
        pytest.skip("running as root and chattr +i is not available here")
    try:
        yield
    finally:
        subprocess.run(["chattr", "-i", *map(str, paths)], check=True)


async def _store_with_one_record(path: Path) -> StoredResponse:
    store = ResponseStore(sqlite_url(path), timeout=TIMEOUT)
    await store.open()
    kept = record()
    await store.put(kept)
    await store.close()  # the last connection checkpoints and removes -wal / -shm
    return kept


async def test_delete_on_read_only_sqlite_file(tmp_path: Path) -> None:
    path = tmp_path / "responses.db"
    kept = await _store_with_one_record(path)
    with read_only(path):
        store = ResponseStore(sqlite_url(path), timeout=TIMEOUT)
        await store.open()  # migrations at head only read
        try:
            assert await store.get(kept.id) is not None
            error = await raises_within(StoreReadOnly, store.delete(kept.id))
            assert str(error) == "the response store is read-only"
            assert_safe(error, str(tmp_path))
            await raises_within(StoreReadOnly, store.put(record()))
        finally:
            await store.close()


async def test_delete_on_read_only_sqlite_uri(tmp_path: Path) -> None:
    path = tmp_path / "responses.db"
    kept = await _store_with_one_record(path)
    store = ResponseStore(f"sqlite:///file:{path}?mode=ro&uri=true", timeout=TIMEOUT)
    await store.open()
    try:
        assert await store.get(kept.id) is not None
        assert_safe(await raises_within(StoreReadOnly, store.delete(kept.id)), str(tmp_path))
    finally:
        await store.close()


async def test_read_only_sqlite_directory(tmp_path: Path) -> None:
    """WAL needs its -shm and -wal files beside the database: in a read-only
    directory SQLite cannot open it at all. Clear errors, no path."""
    directory = tmp_path / "store"
    directory.mkdir()
    path = directory / "responses.db"
    kept = await _store_with_one_record(path)
    with read_only(directory, path):
        store = ResponseStore(sqlite_url(path), timeout=TIMEOUT)
        error = await raises_within(StoreError, store.open())
        assert str(error) == "the response store cannot open its database file"
        assert_safe(error, str(tmp_path))
        not_open = await raises_within(StoreError, store.delete(kept.id))
        assert str(not_open) == "the response store is not open"


# -- start-up ----------------------------------------------------------------------------


async def test_open_is_quiet_at_info(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO)
    alembic_level = logging.getLogger("alembic").level
    store = ResponseStore(sqlite_url(tmp_path / "fresh" / "responses.db"), timeout=5.0)
    await store.open()  # creates the schema: every migration runs
    await store.close()
    assert [r for r in caplog.records if r.name.startswith("alembic")] == []
    assert [r.getMessage() for r in caplog.records if r.name == "mlxtrio.store"] == [
        f"response store ready: {store.redacted_url}"
    ]
    assert logging.getLogger("alembic").level == alembic_level  # left as it was


async def test_calls_on_a_store_that_is_not_open() -> None:
    store = ResponseStore("sqlite:///unused.db")
    error = await raises_within(StoreError, store.get("resp_x"), limit=0.1)
    assert str(error) == "the response store is not open"
