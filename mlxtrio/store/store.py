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

This module is the Trio side. The worker-thread side lives in ``calls.py`` (one
call's state, abandoning and taking back), ``queries.py`` (the SQL),
``connect.py`` (opening the database) and ``records.py`` (:class:`StoredResponse`).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from functools import partial
from typing import TypeVar

import trio
from sqlalchemy import Engine

from . import queries
from .calls import Call, Gauge, Undo, run_in_thread, run_undo
from .connect import normalize_url, open_database
from .errors import Redactor, StoreError, StoreUnavailable, redacted, translate
from .records import StoredResponse, can_exist

log = logging.getLogger("mlxtrio.store")

T = TypeVar("T")
# Longest chain followed for a continuation; deeper chains are a client bug.
MAX_CHAIN = 10_000
# Failed discards remembered for the next sweep; beyond this they are logged.
MAX_PENDING_DISCARDS = 10_000


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
        return redacted(self.url)

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
                    run_in_thread, call, work, limiter=self._limiter, abandon_on_cancel=True
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
        engine = open_database(self.url, timeout=self.timeout, busy_timeout=self.busy_timeout)
        call.deliver(engine.dispose, "the connection pool of an abandoned open")
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
        await self._call(
            partial(queries.put_sync, record, self._redact, self.is_sqlite), limit=lock_wait
        )

    async def delete(self, response_id: str) -> bool:
        """Delete one record; returns whether it existed.

        Raises :class:`StoreBusy` (locked), :class:`StoreReadOnly`,
        :class:`StoreUnavailable` or :class:`StoreError`. A delete whose caller
        gives up before its COMMIT is rolled back; one whose COMMIT was already
        in flight may still land.
        """
        if not can_exist(response_id):
            await trio.lowlevel.checkpoint()
            return False
        return await self._call(partial(queries.delete_sync, response_id))

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
        if not can_exist(response_id):
            await trio.lowlevel.checkpoint()
            return False
        try:
            with trio.CancelScope(shield=True):
                existed = await self._call(partial(queries.discard_sync, response_id))
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
        removed = await self._call(partial(queries.sweep_sync, _now(now), pending))
        self._pending_discards -= pending
        return removed

    # -- reads ------------------------------------------------------------------

    async def get(self, response_id: str, now: int | None = None) -> StoredResponse | None:
        """A live record, or None if unknown or expired.

        Raises :class:`StoreUnavailable` or :class:`StoreError`. Cancellation:
        the read is abandoned (its result dropped); nothing changes.
        """
        if not can_exist(response_id):
            await trio.lowlevel.checkpoint()
            return None
        return await self._call(partial(queries.get_sync, response_id, _now(now)))

    async def chain(self, response_id: str, now: int | None = None) -> list[StoredResponse] | None:
        """Records from the root to ``response_id``, in one query; None if any is
        unknown or expired (one expired ancestor makes the whole chain unusable),
        if the chain has a cycle, or if it is longer than ``MAX_CHAIN``.

        Raises and cancels as :meth:`get`.
        """
        if not can_exist(response_id):
            await trio.lowlevel.checkpoint()
            return None
        return await self._call(partial(queries.chain_sync, response_id, _now(now), MAX_CHAIN))

    async def shared_secret(self, name: str, proposed: bytes) -> bytes:
        """The secret ``name`` every server sharing this store uses: stored as
        ``proposed`` by the first to ask. Raises and cancels as :meth:`get`."""
        return await self._call(partial(queries.shared_secret_sync, name, proposed))

    async def count(self) -> int:
        """How many records are stored, expired ones included. Raises and
        cancels as :meth:`get`."""
        return await self._call(queries.count_sync)


def _now(now: int | None) -> int:
    return int(time.time()) if now is None else now
