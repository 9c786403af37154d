"""What the response store raises, and how database errors map onto it.

Every error the store raises is a :class:`StoreError`. Its ``str()`` is a short
sentence that is safe to show to a client: it never names the database's URL,
host, port, user, password or driver. The underlying cause, for logs, is on
``.detail`` (with the password redacted) and on ``__cause__``.
"""

from __future__ import annotations

import re
import sqlite3
from urllib.parse import quote, quote_plus

from sqlalchemy import URL, make_url
from sqlalchemy.exc import DBAPIError
from sqlalchemy.exc import TimeoutError as PoolTimeout

# Longest detail kept for a log line: driver messages can quote whole statements.
MAX_DETAIL = 500


class StoreError(RuntimeError):
    """The response store could not do what was asked.

    ``str(error)`` is safe to show to clients; ``error.detail`` says why, for logs.
    """

    message = "the response store failed"

    def __init__(self, message: str | None = None, *, detail: str | None = None) -> None:
        message = message or self.message
        super().__init__(message)
        self.detail = detail or message


class StoreUnavailable(StoreError):
    """The database cannot be reached, or did not answer within the store's
    deadline (refused, unreachable, hung, or every worker thread is stuck)."""

    message = "the response store is unavailable"


class StoreBusy(StoreUnavailable):
    """Another writer holds the database's lock (SQLite ``database is locked``,
    PostgreSQL lock timeouts and deadlocks); trying again later may work."""

    message = "the response store is busy"


class StoreReadOnly(StoreError):
    """The database refuses writes (read-only file, ``mode=ro``, hot standby)."""

    message = "the response store is read-only"


class Abandoned(Exception):
    """Raised on a worker thread whose caller has given up; nobody sees it."""


# Query parameters libpq and the drivers read a secret from.
SECRET_QUERY_KEYS = ("password", "sslpassword")


def secrets_of(url: str | URL) -> list[str]:
    """The secrets a URL carries: its password, in the userinfo or in the query."""
    parsed = make_url(url)
    found = [str(parsed.password)] if parsed.password else []
    for key in SECRET_QUERY_KEYS:
        value = parsed.query.get(key)
        found.extend([value] if isinstance(value, str) else list(value or ()))
    return [secret for secret in found if secret]


def redacted(url: str | URL) -> str:
    """``url`` fit for a log line: every secret it carries masked."""
    parsed = make_url(url)
    masked = {k: "***" for k in SECRET_QUERY_KEYS if k in parsed.query}
    return parsed.update_query_dict(masked).render_as_string(hide_password=True)


class Redactor:
    """Removes a URL's secrets from text meant for logs."""

    def __init__(self, url: str | URL) -> None:
        # Each secret raw and in the forms it takes inside a URL.
        self._secrets = sorted(
            {form for s in secrets_of(url) for form in (s, quote(s, safe=""), quote_plus(s))},
            key=len,
        )

    def __call__(self, text: str) -> str:
        for secret in reversed(self._secrets):  # longest first
            text = text.replace(secret, "***")
        # Any other URL with credentials that a driver message might quote.
        return re.sub(r"(://[^/\s:@]*):[^@\s/]*@", r"\1:***@", text)


def translate(exc: BaseException, redact: Redactor) -> StoreError:
    """The :class:`StoreError` a database (or driver, or OS) error stands for."""
    if isinstance(exc, StoreError):
        return exc
    cause = exc.orig if isinstance(exc, DBAPIError) and exc.orig is not None else exc
    kind, message = _classify(exc, cause)
    return kind(message, detail=_detail(cause, redact))


def _detail(cause: BaseException, redact: Redactor) -> str:
    # Driver messages run over several lines ("DETAIL:", "HINT:", the SQL...).
    lines = [line.strip() for line in str(cause).splitlines() if line.strip()]
    text = f"{type(cause).__name__}: {' / '.join(lines[:3])}"
    return redact(text)[:MAX_DETAIL]


# SQLite primary result codes (https://sqlite.org/rescode.html).
_SQLITE = {
    5: (StoreBusy, None),  # SQLITE_BUSY: another connection holds the lock
    6: (StoreBusy, None),  # SQLITE_LOCKED
    8: (StoreReadOnly, None),  # SQLITE_READONLY
    10: (StoreUnavailable, "the response store cannot read or write its database file"),
    11: (StoreError, "the response store's database is damaged"),  # SQLITE_CORRUPT
    13: (StoreError, "the response store's disk is full"),  # SQLITE_FULL
    14: (StoreUnavailable, "the response store cannot open its database file"),
    26: (StoreError, "the response store's database is damaged"),  # SQLITE_NOTADB
}

# PostgreSQL SQLSTATEs (https://www.postgresql.org/docs/current/errcodes-appendix.html).
_SQLSTATE = {
    "25006": (StoreReadOnly, None),  # read_only_sql_transaction (a standby)
    "40001": (StoreBusy, None),  # serialization_failure
    "40P01": (StoreBusy, None),  # deadlock_detected
    "55P03": (StoreBusy, None),  # lock_not_available
    "53100": (StoreError, "the response store's disk is full"),
}
# Whole SQLSTATE classes: connection exceptions, insufficient resources (too many
# connections), operator intervention (shutdown, statement timeout).
_SQLSTATE_CLASSES = {"08": StoreUnavailable, "53": StoreUnavailable, "57": StoreUnavailable}


def _classify(exc: BaseException, cause: BaseException) -> tuple[type[StoreError], str | None]:
    if isinstance(cause, sqlite3.Error):
        code = getattr(cause, "sqlite_errorcode", None)
        if isinstance(code, int) and code & 0xFF in _SQLITE:
            return _SQLITE[code & 0xFF]
        text = str(cause).lower()
        if "locked" in text:
            return StoreBusy, None
        if "readonly" in text or "read-only" in text:
            return StoreReadOnly, None
    sqlstate = getattr(cause, "sqlstate", None)
    if isinstance(sqlstate, str):
        if sqlstate in _SQLSTATE:
            return _SQLSTATE[sqlstate]
        if sqlstate[:2] in _SQLSTATE_CLASSES:
            return _SQLSTATE_CLASSES[sqlstate[:2]], None
    if isinstance(exc, DBAPIError) and exc.connection_invalidated:
        return StoreUnavailable, None
    if isinstance(exc, PoolTimeout | OSError | TimeoutError):
        return StoreUnavailable, None
    # DB-API OperationalError / InterfaceError without a SQLSTATE: psycopg's
    # "connection refused", "server closed the connection unexpectedly"...
    if type(cause).__name__ in ("OperationalError", "InterfaceError"):
        return StoreUnavailable, None
    return StoreError, None
