"""What it takes to open the store's database: its URL, an engine with the
driver settings the store relies on, and the schema migrated by Alembic.

Everything here is synchronous and blocks on the database: :class:`ResponseStore`
runs :func:`open_database` on a worker thread under its deadline. That deadline
cannot stop the thread, so the driver timeouts set here (SQLite's busy timeout,
psycopg's ``connect_timeout`` and TCP keepalives) are what free it sooner.
"""

from __future__ import annotations

import logging
import math
import sqlite3
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from sqlalchemy import URL, Engine, create_engine, event, make_url

from .schema import Base

log = logging.getLogger("mlxtrio.store")

MIGRATIONS = Path(__file__).parent / "migrations"
# Concurrent opens must not interleave saving and restoring alembic's log level.
_ALEMBIC_LOG_LOCK = threading.Lock()


def normalize_url(url: str) -> str:
    if url.startswith("postgresql://") or url.startswith("postgres://"):
        return "postgresql+psycopg://" + url.split("://", 1)[1]
    return url


def sqlite_url(path: Path) -> str:
    return f"sqlite:///{path}"


def open_database(url: str, *, timeout: float, busy_timeout: float) -> Engine:
    """An engine for ``url`` (already normalized) with the schema at Alembic's
    head, its INFO chatter silenced. Blocks; on failure the engine's connection
    pool is disposed of before the error propagates."""
    engine = _make_engine(url, timeout=timeout, busy_timeout=busy_timeout)
    try:
        with engine.begin() as connection, _quiet_alembic():
            _upgrade(connection)
    except BaseException:
        engine.dispose()
        raise
    return engine


def _make_engine(url: str, *, timeout: float, busy_timeout: float) -> Engine:
    """An engine for ``url``, not yet connected. SQLite: WAL mode, the parent
    directory created, ``busy_timeout`` seconds of waiting for a lock. psycopg:
    libpq timeouts derived from ``timeout`` (see :func:`_psycopg_defaults`)."""
    parsed = make_url(url)
    connect_args: dict[str, Any] = {}
    if parsed.get_backend_name() == "sqlite":
        _make_parent_dir(parsed)
        connect_args = {"check_same_thread": False, "timeout": busy_timeout}
    elif parsed.get_driver_name() == "psycopg":
        connect_args = _psycopg_defaults(parsed, timeout)
    engine = create_engine(parsed, pool_pre_ping=True, connect_args=connect_args)
    if parsed.get_backend_name() == "sqlite":
        event.listen(engine, "connect", _sqlite_pragmas)
    return engine


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
