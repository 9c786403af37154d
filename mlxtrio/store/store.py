"""SQLAlchemy response store, driven from Trio.

SQLAlchemy's async layer is asyncio-only, so the store uses a synchronous engine
and runs every database call on a worker thread (``trio.to_thread``) under its own
limiter: the event loop never blocks on SQL. Every async method here is a Trio
checkpoint; if its caller is cancelled the database call is abandoned to finish
in the background (a write may still land; a read's result is dropped).

SQLite (the default) runs in WAL mode with a busy timeout; any SQLAlchemy URL
works (``postgresql://`` is mapped to the psycopg 3 driver). The schema is created
and upgraded by Alembic at start-up.
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any, TypeVar, cast

import trio
from sqlalchemy import CursorResult, Engine, create_engine, delete, event, select
from sqlalchemy.exc import SQLAlchemyError
from sqlalchemy.orm import Session

from .schema import Base, ResponseRow

log = logging.getLogger("mlxtrio.store")

T = TypeVar("T")
MIGRATIONS = Path(__file__).parent / "migrations"
# Longest chain followed for a continuation; deeper chains are a client bug.
MAX_CHAIN = 10_000


class StoreError(RuntimeError):
    """The database could not do what was asked (locked, read-only, gone...)."""


@dataclass
class StoredResponse:
    id: str
    previous_response_id: str | None
    created_at: int
    expires_at: int
    model: str
    status: str
    instructions: str | None
    input_messages: list[dict[str, Any]]
    input_items: list[dict[str, Any]]
    response: dict[str, Any]
    owner: str = ""

    # Fields stored as JSON text; every other field maps to its column as is.
    JSON_FIELDS = ("input_messages", "input_items", "response")

    def to_row(self) -> ResponseRow:
        values = {f.name: getattr(self, f.name) for f in fields(self)}
        for name in self.JSON_FIELDS:
            values[name] = json.dumps(values[name], ensure_ascii=False)
        return ResponseRow(**values)

    @classmethod
    def from_row(cls, row: ResponseRow) -> StoredResponse:
        values = {f.name: getattr(row, f.name) for f in fields(cls)}
        for name in cls.JSON_FIELDS:
            values[name] = json.loads(values[name])
        return cls(**values)


def normalize_url(url: str) -> str:
    if url.startswith("postgresql://") or url.startswith("postgres://"):
        return "postgresql+psycopg://" + url.split("://", 1)[1]
    return url


def sqlite_url(path: Path) -> str:
    return f"sqlite:///{path}"


class ResponseStore:
    def __init__(self, url: str, *, busy_timeout: float = 5.0, threads: int = 4) -> None:
        self.url = normalize_url(url)
        self.busy_timeout = busy_timeout
        self._limiter = trio.CapacityLimiter(threads)
        self._engine: Engine | None = None

    @property
    def is_sqlite(self) -> bool:
        return self.url.startswith("sqlite")

    async def _run(self, fn: Callable[..., T], *args: Any) -> T:
        try:
            return await trio.to_thread.run_sync(
                fn, *args, limiter=self._limiter, abandon_on_cancel=True
            )
        except SQLAlchemyError as exc:
            raise StoreError(f"{type(exc).__name__}: {exc}".splitlines()[0]) from exc

    async def open(self) -> None:
        """Connect and apply migrations. Raises :class:`StoreError`."""
        await self._run(self._open_sync)

    def _open_sync(self) -> None:
        from alembic import command
        from alembic.config import Config

        if self.is_sqlite and self.url.startswith("sqlite:///"):
            Path(self.url.removeprefix("sqlite:///")).parent.mkdir(parents=True, exist_ok=True)
        connect_args = (
            {"check_same_thread": False, "timeout": self.busy_timeout} if self.is_sqlite else {}
        )
        engine = create_engine(self.url, pool_pre_ping=True, connect_args=connect_args)
        if self.is_sqlite:
            event.listen(engine, "connect", _sqlite_pragmas)
        config = Config()
        config.set_main_option("script_location", str(MIGRATIONS))
        with engine.begin() as connection:
            config.attributes["connection"] = connection
            config.attributes["target_metadata"] = Base.metadata
            command.upgrade(config, "head")
        self._engine = engine
        log.info("response store ready: %s", engine.url.render_as_string(hide_password=True))

    async def close(self) -> None:
        engine, self._engine = self._engine, None
        if engine is not None:
            await trio.to_thread.run_sync(engine.dispose)

    def _session(self) -> Session:
        if self._engine is None:
            raise StoreError("the response store is not open")
        return Session(self._engine, expire_on_commit=False)

    async def put(self, record: StoredResponse, lock_wait: float | None = None) -> None:
        """Commit one record (replacing one with the same id).

        With ``lock_wait``, a write that cannot take the database's write lock
        within that many seconds is rolled back (on its worker thread) and raises
        :class:`StoreError` - it never lands later, so a caller that gave up can
        rely on it being absent.
        """
        deadline = None if lock_wait is None else time.monotonic() + lock_wait

        def write() -> None:
            with self._session() as session, session.begin():
                session.merge(record.to_row())
                session.flush()  # takes the write lock (may wait for other writers)
                if deadline is not None and time.monotonic() > deadline:
                    raise StoreError(
                        f"write of {record.id} waited over {lock_wait:.1f} s for the lock"
                    )

        try:
            await self._run(write)
        except StoreError:
            raise
        except Exception as exc:  # DBAPI errors not wrapped by SQLAlchemy
            raise StoreError(str(exc)) from exc

    async def get(self, response_id: str, now: int | None = None) -> StoredResponse | None:
        """A live record, or None if unknown or expired."""

        def read() -> StoredResponse | None:
            with self._session() as session:
                row = session.get(ResponseRow, response_id)
                if row is None or row.expires_at <= (now or int(time.time())):
                    return None
                return StoredResponse.from_row(row)

        return await self._run(read)

    async def chain(self, response_id: str, now: int | None = None) -> list[StoredResponse] | None:
        """Records from the root to ``response_id``; None if any is unknown or
        expired (one expired ancestor makes the whole chain unusable)."""

        def read() -> list[StoredResponse] | None:
            current_time = now or int(time.time())
            records: list[StoredResponse] = []
            seen: set[str] = set()
            next_id: str | None = response_id
            with self._session() as session:
                while next_id is not None:
                    if next_id in seen or len(records) >= MAX_CHAIN:
                        return None
                    seen.add(next_id)
                    row = session.get(ResponseRow, next_id)
                    if row is None or row.expires_at <= current_time:
                        return None
                    records.append(StoredResponse.from_row(row))
                    next_id = row.previous_response_id
            records.reverse()
            return records

        return await self._run(read)

    async def delete(self, response_id: str) -> bool:
        def remove() -> bool:
            with self._session() as session, session.begin():
                result = session.execute(delete(ResponseRow).where(ResponseRow.id == response_id))
                return bool(cast(CursorResult[Any], result).rowcount)

        return await self._run(remove)

    async def sweep(self, now: int | None = None) -> int:
        """Delete expired records; returns how many."""

        def remove() -> int:
            with self._session() as session, session.begin():
                result = session.execute(
                    delete(ResponseRow).where(ResponseRow.expires_at <= (now or int(time.time())))
                )
                return int(cast(CursorResult[Any], result).rowcount or 0)

        return await self._run(remove)

    async def count(self) -> int:
        def read() -> int:
            with self._session() as session:
                return len(session.scalars(select(ResponseRow.id)).all())

        return await self._run(read)


def _sqlite_pragmas(dbapi_connection: Any, _record: Any) -> None:
    cursor = dbapi_connection.cursor()
    cursor.execute("PRAGMA journal_mode=WAL")
    cursor.execute("PRAGMA synchronous=NORMAL")
    cursor.close()
