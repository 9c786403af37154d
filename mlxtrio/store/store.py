"""SQLAlchemy response store, driven from Trio.

SQLAlchemy's async layer is asyncio-only, so the store uses a synchronous engine
and runs every database call on a worker thread (``trio.to_thread``) under its own
:class:`trio.CapacityLimiter`: the event loop never blocks on SQL.

**Deadlines.** Every public async method returns or raises within the store's
``timeout`` (``put`` may take its own), whatever the database does: then the Trio
side stops waiting for the thread and raises :class:`StoreUnavailable`. Nothing can
stop a thread blocked on a hung server, so it keeps its limiter token until the
database answers: at most ``threads`` threads are ever stuck, and once all of
them are stuck on calls that timed out, calls fail at once rather than wait for
a thread. Driver timeouts
(psycopg's ``connect_timeout`` and TCP keepalives, SQLite's busy timeout) free
stuck threads sooner where they can; the Trio-side deadline is the guarantee.

**Cancellation.** Every async method is a Trio checkpoint. A read whose caller is
cancelled or times out is abandoned and its result dropped. A ``put`` whose
caller gives up is not left in the database: rolled back before COMMIT, or
deleted again right after a COMMIT that was in flight (see
:meth:`ResponseStore.put` and ``calls.py``). ``discard`` is cleanup: it runs
even in a cancelled task.

**Errors.** Every failure is a :class:`StoreError` whose ``str()`` is safe to show
to clients and whose ``.detail`` is for logs (password redacted).

SQLite (the default) runs in WAL mode with a busy timeout; any SQLAlchemy URL
works (``postgresql://`` is mapped to the psycopg 3 driver). The schema is created
and upgraded by Alembic at start-up.
"""

from __future__ import annotations

import json
import logging
import math
import sqlite3
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, fields
from functools import partial
from pathlib import Path
from typing import Any, Generic, TypeVar, cast

import trio
from sqlalchemy import (
    URL,
    CursorResult,
    Engine,
    Integer,
    Select,
    create_engine,
    delete,
    event,
    func,
    literal_column,
    make_url,
    or_,
    select,
)
from sqlalchemy.orm import Session, aliased

from .calls import Call, Gauge, Undo, run_undo
from .errors import Abandoned, Redactor, StoreError, StoreUnavailable, translate
from .schema import Base, ResponseRow

log = logging.getLogger("mlxtrio.store")

T = TypeVar("T")
MIGRATIONS = Path(__file__).parent / "migrations"
# Longest chain followed for a continuation; deeper chains are a client bug.
MAX_CHAIN = 10_000
ID_LENGTH: int = cast(Any, ResponseRow.__table__).c.id.type.length
# Failed discards remembered for the next sweep; beyond this they are logged.
MAX_PENDING_DISCARDS = 10_000
# Concurrent opens must not interleave saving and restoring alembic's log level.
_ALEMBIC_LOG_LOCK = threading.Lock()


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
    """Stored Responses API turns.

    ``timeout`` bounds every call (seconds, Trio side); ``busy_timeout`` is how
    long SQLite waits for another writer's lock before answering "busy" (default:
    half of ``timeout``, so that a locked database says so instead of timing
    out); ``threads`` bounds the worker threads, stuck ones included.
    """

    def __init__(
        self,
        url: str,
        *,
        timeout: float = 5.0,
        busy_timeout: float | None = None,
        threads: int = 4,
    ) -> None:
        if timeout <= 0 or threads < 1:
            raise ValueError("the store needs a positive timeout and at least one thread")
        self.url = normalize_url(url)
        self.timeout = timeout
        self.busy_timeout = timeout / 2 if busy_timeout is None else busy_timeout
        self.threads = threads
        self._limiter = trio.CapacityLimiter(threads)
        self._redact = Redactor(self.url)
        self._engine: Engine | None = None
        self._stuck = Gauge()  # abandoned calls whose worker thread still runs
        self._pending_discards: set[str] = set()  # for the next sweep

    @property
    def redacted_url(self) -> str:
        """The database URL with its password masked, for log lines."""
        return make_url(self.url).render_as_string(hide_password=True)

    @property
    def is_sqlite(self) -> bool:
        return self.url.startswith("sqlite")

    @property
    def is_open(self) -> bool:
        return self._engine is not None

    @property
    def threads_in_use(self) -> int:
        """Worker threads running store calls now, abandoned ones included."""
        return int(self._limiter.borrowed_tokens)

    # -- running calls ----------------------------------------------------------

    async def _call(
        self, work: Callable[[Call], T], *, limit: float | None = None, opening: bool = False
    ) -> T:
        """Run ``work`` on a worker thread and return its result within ``limit``
        seconds (default: the store's ``timeout``).

        Raises :class:`StoreUnavailable` when the deadline passes (waiting for a
        thread included), another :class:`StoreError` for any database failure.
        If the caller is cancelled or the deadline passes, the call is abandoned
        (see ``calls.py``) and its thread left to finish in the background.
        """
        limit = self.timeout if limit is None else limit
        if self._engine is None and not opening:
            await trio.lowlevel.checkpoint()
            raise StoreError("the response store is not open")
        if self._stuck.value >= self.threads:
            await trio.lowlevel.checkpoint()
            raise StoreUnavailable(
                "the response store did not answer in time",
                detail=f"all {self.threads} worker threads are still blocked on calls "
                "that timed out",
            )
        call = Call(self._engine, self._stuck)
        try:
            with trio.fail_after(limit):
                result = await trio.to_thread.run_sync(
                    _run_in_thread, call, work, limiter=self._limiter, abandon_on_cancel=True
                )
        except BaseException as exc:
            # The thread's own errors come back inside ``result``, so this is the
            # caller giving up: Cancelled, or our deadline (TooSlowError).
            timed_out = isinstance(exc, trio.TooSlowError)
            self._abandon(call, timed_out)
            if timed_out:
                waited = "answer" if call.started else "free worker thread"
                raise StoreUnavailable(
                    "the response store did not answer in time",
                    detail=f"no {waited} within {limit:g} s",
                ) from None
            raise
        return result.unwrap(self._redact)

    def _abandon(self, call: Call, timed_out: bool) -> None:
        undo = call.abandon(timed_out)
        if undo is not None:  # the worker delivered just as the caller gave up
            trio.lowlevel.spawn_system_task(self._take_back, *undo, name="mlxtrio.store.take_back")

    async def _take_back(self, undo: Undo, what: str) -> None:
        """Take back a result delivered to a caller that had already gone. On the
        default thread limiter so that it starts even when every store thread is
        stuck; if it does not finish within ``timeout`` the thread goes on alone."""
        with trio.move_on_after(self.timeout):
            await trio.to_thread.run_sync(run_undo, undo, what, abandon_on_cancel=True)

    # -- lifecycle --------------------------------------------------------------

    async def open(self) -> None:
        """Connect and apply migrations (Alembic, its INFO chatter silenced).

        Raises :class:`StoreUnavailable` if the database cannot be reached within
        the store's ``timeout``, :class:`StoreError` for any other
        failure. If the caller gives up, the migration may still finish on its
        thread; the connection pool it opened is then disposed of.
        """
        if self._engine is not None:
            await trio.lowlevel.checkpoint()
            return
        self._engine = await self._call(self._open_sync, opening=True)
        log.info("response store ready: %s", self.redacted_url)

    def _open_sync(self, call: Call) -> Engine:
        engine = self._create_engine()
        try:
            with engine.begin() as connection, _quiet_alembic():
                _upgrade(connection)
        except BaseException:
            engine.dispose()
            raise
        call.deliver(engine.dispose, "the connection pool of an abandoned open")
        return engine

    def _create_engine(self) -> Engine:
        url = make_url(self.url)
        connect_args: dict[str, Any] = {}
        if url.get_backend_name() == "sqlite":
            _make_parent_dir(url)
            connect_args = {"check_same_thread": False, "timeout": self.busy_timeout}
        elif url.get_driver_name() == "psycopg":
            connect_args = _psycopg_defaults(url, self.timeout)
        engine = create_engine(url, pool_pre_ping=True, connect_args=connect_args)
        if url.get_backend_name() == "sqlite":
            event.listen(engine, "connect", _sqlite_pragmas)
        return engine

    async def close(self) -> None:
        """Release the connection pool. Never raises; bounded by ``timeout``
        (disposal that overruns it finishes on its thread). A cancelled close
        still marks the store closed."""
        engine, self._engine = self._engine, None
        if engine is None:
            await trio.lowlevel.checkpoint()
            return
        with trio.move_on_after(self.timeout):
            try:
                # The default limiter: the store's may be full of stuck threads.
                await trio.to_thread.run_sync(engine.dispose, abandon_on_cancel=True)
            except Exception as exc:
                log.warning("closing the response store: %s", translate(exc, self._redact).detail)

    # -- writes -----------------------------------------------------------------

    async def put(self, record: StoredResponse, lock_wait: float | None = None) -> None:
        """Commit one record (replacing one with the same id).

        Returns within the store's ``timeout`` (or ``lock_wait`` seconds, if
        given: an older name kept for callers; a cancel scope around the call
        does the same). Raises :class:`StoreUnavailable` if the database is
        unreachable, hung or too slow, :class:`StoreBusy` if another writer holds
        the lock, :class:`StoreReadOnly` or another :class:`StoreError` otherwise.

        Cancellation and deadline - **a write whose caller gave up is not left in
        the database**: if ``put`` raises (Cancelled because the client hung up,
        or any :class:`StoreError`), the record is not stored.

        * Caller gone before the COMMIT: the worker thread checks for that
          immediately before COMMIT and rolls back instead.
        * Caller gone while the COMMIT was in flight (or just after it, before the
          result reached Trio): the row is deleted as soon as the COMMIT returns
          (a compensating delete, logged at INFO). The row exists only in
          between, for as long as the database takes to answer both statements.
        * On PostgreSQL a COMMIT that fails in flight may still have landed, so
          it is compensated the same way.

        The one gap: a database that fails again between the COMMIT and the
        compensating delete. That is logged as an error naming the record. The
        compensating delete removes the id whatever it held before: ids are
        meant to be new.
        """
        await self._call(partial(self._put_sync, record), limit=lock_wait)

    def _put_sync(self, record: StoredResponse, call: Call) -> None:
        engine = call.engine
        assert engine is not None
        undo = partial(self._remove_now, engine, record.id)
        what = f"the write of response {record.id}"
        with call.session() as session:
            call.check()  # a caller that has already gone: nothing to write
            session.merge(record.to_row())
            session.flush()  # takes the write lock (may wait for other writers)
            try:
                call.commit(session, undo, what)
            except Abandoned:
                raise  # rolled back, or already taken back
            except Exception:
                if not self.is_sqlite:
                    # The server may have committed before the connection failed.
                    _forget(undo, what)
                raise

    def _remove_now(self, engine: Engine, response_id: str) -> bool:
        """Delete one row on a fresh session, now (a take-back: never abandoned)."""
        try:
            with Session(engine) as session, session.begin():
                result = session.execute(delete(ResponseRow).where(ResponseRow.id == response_id))
                return bool(cast(CursorResult[Any], result).rowcount)
        except Exception as exc:
            raise translate(exc, self._redact) from exc

    async def delete(self, response_id: str) -> bool:
        """Delete one record; returns whether it existed.

        Raises :class:`StoreBusy` (locked), :class:`StoreReadOnly`,
        :class:`StoreUnavailable` or :class:`StoreError`. A delete whose caller
        gives up before its COMMIT is rolled back; one whose COMMIT was already
        in flight may still land.
        """
        if not _can_exist(response_id):
            await trio.lowlevel.checkpoint()
            return False
        return await self._call(partial(_delete_sync, response_id))

    async def discard(self, response_id: str) -> bool:
        """Delete a record that must not stay stored (a compensating delete: the
        client left before the turn's terminal event reached it). Returns whether
        it existed.

        Meant for cleanup code, so the caller's cancellation does not interrupt
        it: it shields itself, for at most the store's ``timeout``. Raises only
        :class:`StoreError` (:class:`StoreUnavailable` past the deadline). A
        discard that fails is not forgotten: the id is kept (in memory, up to
        ``MAX_PENDING_DISCARDS``) and deleted again by every :meth:`sweep` until
        one succeeds; a delete already running when the deadline passed also
        completes on its own whenever the database answers.
        """
        if not _can_exist(response_id):
            await trio.lowlevel.checkpoint()
            return False
        try:
            with trio.CancelScope(shield=True):
                existed = await self._call(partial(_discard_sync, response_id))
        except StoreError:
            self._retry_discard(response_id)
            raise
        return existed

    def _retry_discard(self, response_id: str) -> None:
        if len(self._pending_discards) >= MAX_PENDING_DISCARDS:
            log.error("response %s could not be discarded and will stay stored", response_id)
            return
        self._pending_discards.add(response_id)

    async def sweep(self, now: int | None = None) -> int:
        """Delete expired records, and those a failed :meth:`discard` left behind;
        returns how many. Cancellation as for :meth:`delete`."""
        pending = frozenset(self._pending_discards)
        removed = await self._call(partial(_sweep_sync, _now(now), pending))
        self._pending_discards -= pending
        return removed

    # -- reads ------------------------------------------------------------------

    async def get(self, response_id: str, now: int | None = None) -> StoredResponse | None:
        """A live record, or None if unknown or expired.

        Raises :class:`StoreUnavailable` or :class:`StoreError`. Cancellation:
        the read is abandoned (its result dropped); nothing changes.
        """
        if not _can_exist(response_id):
            await trio.lowlevel.checkpoint()
            return None
        return await self._call(partial(_get_sync, response_id, _now(now)))

    async def chain(self, response_id: str, now: int | None = None) -> list[StoredResponse] | None:
        """Records from the root to ``response_id``, in one query; None if any is
        unknown or expired (one expired ancestor makes the whole chain unusable),
        if the chain has a cycle, or if it is longer than ``MAX_CHAIN``.

        Raises and cancels as :meth:`get`.
        """
        if not _can_exist(response_id):
            await trio.lowlevel.checkpoint()
            return None
        return await self._call(partial(_chain_sync, response_id, _now(now), MAX_CHAIN))

    async def count(self) -> int:
        """How many records are stored, expired ones included. Raises and
        cancels as :meth:`get`."""
        return await self._call(_count_sync)


# -- worker-thread side -----------------------------------------------------------


@dataclass
class _Outcome(Generic[T]):
    """What a worker thread produced: its value, or the exception it raised."""

    value: T | None = None
    error: Exception | None = None

    def unwrap(self, redact: Redactor) -> T:
        if isinstance(self.error, StoreError):
            raise self.error
        if self.error is not None:
            raise translate(self.error, redact) from self.error
        return cast(T, self.value)


def _run_in_thread(call: Call, work: Callable[[Call], T]) -> _Outcome[T]:
    try:
        call.start()
        return _Outcome(value=work(call))
    except Exception as exc:
        return _Outcome(error=exc)
    finally:
        call.finish()


def _forget(undo: Undo, what: str) -> None:
    try:
        undo()
    except Exception as exc:
        detail = exc.detail if isinstance(exc, StoreError) else type(exc).__name__
        log.error("%s failed at COMMIT and may have landed; removing it failed: %s", what, detail)


def _delete_sync(response_id: str, call: Call) -> bool:
    with call.session() as session:
        result = session.execute(delete(ResponseRow).where(ResponseRow.id == response_id))
        call.commit(session)
        return bool(cast(CursorResult[Any], result).rowcount)


def _discard_sync(response_id: str, call: Call) -> bool:
    # Deliberately no abandon check: the delete should land even if nobody waits.
    with call.session() as session, session.begin():
        result = session.execute(delete(ResponseRow).where(ResponseRow.id == response_id))
        return bool(cast(CursorResult[Any], result).rowcount)


def _sweep_sync(now: int, discarded: frozenset[str], call: Call) -> int:
    condition = ResponseRow.expires_at <= now
    if discarded:
        condition = or_(condition, ResponseRow.id.in_(discarded))
    with call.session() as session:
        result = session.execute(delete(ResponseRow).where(condition))
        call.commit(session)
        return int(cast(CursorResult[Any], result).rowcount or 0)


def _get_sync(response_id: str, now: int, call: Call) -> StoredResponse | None:
    with call.session() as session:
        row = session.get(ResponseRow, response_id)
        if row is None or row.expires_at <= now:
            return None
        return StoredResponse.from_row(row)


def _chain_sync(response_id: str, now: int, limit: int, call: Call) -> list[StoredResponse] | None:
    with call.session() as session:
        rows = session.execute(chain_query(response_id, now, limit)).all()
    # Root first. The root must have no parent: otherwise an ancestor is missing,
    # expired, or beyond the limit (a cycle or an over-long chain returns no rows).
    if not rows or rows[0][0].previous_response_id is not None:
        return None
    return [StoredResponse.from_row(row) for row, _depth in rows]


def chain_query(response_id: str, now: int, limit: int) -> Select[ResponseRow, int]:
    """One recursive query for the live chain ending at ``response_id``, root first.

    The recursion walks parent links from the leaf while the rows are live, at
    most ``limit`` steps up; the outer query returns nothing when it found more
    than ``limit`` rows, which is also how a cycle ends. Portable SQL (SQLite,
    PostgreSQL): WITH RECURSIVE ... UNION ALL, no CYCLE clause.
    """
    leaf = select(
        ResponseRow.id.label("id"),
        ResponseRow.previous_response_id.label("parent_id"),
        literal_column("0", Integer).label("depth"),  # inline: one column type on PostgreSQL
    ).where(ResponseRow.id == response_id, ResponseRow.expires_at > now)
    chain = leaf.cte("response_chain", recursive=True)
    parent = aliased(ResponseRow, name="parent")
    chain = chain.union_all(
        select(parent.id, parent.previous_response_id, chain.c.depth + 1).where(
            parent.id == chain.c.parent_id, parent.expires_at > now, chain.c.depth < limit
        )
    )
    size = select(func.count()).select_from(chain).scalar_subquery()
    return (
        select(ResponseRow, chain.c.depth)
        .join(chain, chain.c.id == ResponseRow.id)
        .where(size <= limit)
        .order_by(chain.c.depth.desc())
    )


def _count_sync(call: Call) -> int:
    with call.session() as session:
        return int(session.scalar(select(func.count()).select_from(ResponseRow)) or 0)


def _can_exist(response_id: str) -> bool:
    """Whether a row could have this id. Ids come from clients: one the column or
    the driver cannot hold (too long, NUL, a lone surrogate) is simply unknown,
    not a database error."""
    if len(response_id) > ID_LENGTH or "\x00" in response_id:
        return False
    try:
        response_id.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


def _now(now: int | None) -> int:
    return int(time.time()) if now is None else now


# -- set-up -------------------------------------------------------------------------


def _upgrade(connection: Any) -> None:
    from alembic import command
    from alembic.config import Config

    config = Config()
    config.set_main_option("script_location", str(MIGRATIONS))
    config.attributes["connection"] = connection
    config.attributes["target_metadata"] = Base.metadata
    command.upgrade(config, "head")


@contextmanager
def _quiet_alembic() -> Iterator[None]:
    """Alembic logs about nine INFO lines per start-up (its context, each
    revision) that tell an operator nothing; hold them at WARNING unless someone
    configured the ``alembic`` logger explicitly."""
    logger = logging.getLogger("alembic")
    with _ALEMBIC_LOG_LOCK:
        if logger.level != logging.NOTSET:
            yield
            return
        logger.setLevel(logging.WARNING)
        try:
            yield
        finally:
            logger.setLevel(logging.NOTSET)


def _make_parent_dir(url: URL) -> None:
    database = url.database
    if not database or database == ":memory:" or database.startswith("file:"):
        return  # in memory, or a URI (``?uri=true``): the caller owns the path
    Path(database).parent.mkdir(parents=True, exist_ok=True)


def _psycopg_defaults(url: URL, timeout: float) -> dict[str, Any]:
    """libpq settings that free a thread from a dead server sooner; the URL's own
    values win. (libpq's connect_timeout is whole seconds, at least 2.)"""
    import psycopg

    defaults: dict[str, Any] = {
        "connect_timeout": max(2, math.ceil(timeout)),
        # Notice a vanished server on an idle pooled connection within ~25 s...
        "keepalives": 1,
        "keepalives_idle": 10,
        "keepalives_interval": 5,
        "keepalives_count": 3,
    }
    if psycopg.pq.version() >= 120000:  # libpq 12 added it
        # ...and give up on data it never acknowledges after 30 s.
        defaults["tcp_user_timeout"] = 30_000
    return {key: value for key, value in defaults.items() if key not in url.query}


def _sqlite_pragmas(dbapi_connection: Any, _record: Any) -> None:
    cursor = dbapi_connection.cursor()
    try:
        cursor.execute("PRAGMA journal_mode=WAL")
        cursor.execute("PRAGMA synchronous=NORMAL")
    except sqlite3.OperationalError as exc:
        # A read-only database keeps its journal mode; reads still work.
        log.debug("SQLite pragmas not applied: %s", exc)
    finally:
        cursor.close()
