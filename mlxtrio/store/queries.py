"""The store's SQL: the functions :class:`ResponseStore` runs on a worker thread.

Each takes the :class:`Call` last (the store binds the rest with
:func:`functools.partial`) and runs synchronously, blocking on the database.
Cancellation is the :class:`Call`'s (see ``calls.py``): writes COMMIT through
:meth:`Call.commit`, so one whose caller gave up first is rolled back, and the
result of a read whose caller gave up is dropped. The exceptions: ``put_sync``
takes its row back if the caller gave up while its COMMIT was in flight, and
``discard_sync`` commits whether anyone still waits or not.
"""

from __future__ import annotations

from functools import partial
from typing import Any, cast

from sqlalchemy import (
    CursorResult,
    Engine,
    Integer,
    Select,
    delete,
    func,
    literal_column,
    or_,
    select,
)
from sqlalchemy.orm import Session, aliased

from .calls import Call, run_undo
from .errors import Abandoned, Redactor, translate
from .records import StoredResponse
from .schema import ResponseRow, SecretRow

# -- writes -------------------------------------------------------------------------


def put_sync(record: StoredResponse, redact: Redactor, is_sqlite: bool, call: Call) -> None:
    """Merge and COMMIT ``record``, taking it back (see :meth:`Call.commit`) if
    the caller gives up during the COMMIT. Off SQLite, a COMMIT that fails is
    taken back too: the server may have committed before the connection failed."""
    engine = call.engine
    assert engine is not None
    undo = partial(remove_now, engine, record.id, redact)
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
            if not is_sqlite:
                # The server may have committed before the connection failed.
                run_undo(undo, what, failed_commit=True)
            raise


def remove_now(engine: Engine, response_id: str, redact: Redactor) -> bool:
    """Delete one row on a fresh session, now (a take-back: never abandoned)."""
    try:
        with Session(engine) as session, session.begin():
            result = session.execute(delete(ResponseRow).where(ResponseRow.id == response_id))
            return bool(cast(CursorResult[Any], result).rowcount)
    except Exception as exc:
        raise translate(exc, redact) from exc


def delete_sync(response_id: str, call: Call) -> bool:
    with call.session() as session:
        result = session.execute(delete(ResponseRow).where(ResponseRow.id == response_id))
        call.commit(session)
        return bool(cast(CursorResult[Any], result).rowcount)


def discard_sync(response_id: str, call: Call) -> bool:
    # Deliberately no abandon check: the delete should land even if nobody waits.
    with call.session() as session, session.begin():
        result = session.execute(delete(ResponseRow).where(ResponseRow.id == response_id))
        return bool(cast(CursorResult[Any], result).rowcount)


def sweep_sync(now: int, discarded: frozenset[str], call: Call) -> int:
    condition = ResponseRow.expires_at <= now
    if discarded:
        condition = or_(condition, ResponseRow.id.in_(discarded))
    with call.session() as session:
        result = session.execute(delete(ResponseRow).where(condition))
        call.commit(session)
        return int(cast(CursorResult[Any], result).rowcount or 0)


# -- reads --------------------------------------------------------------------------


def get_sync(response_id: str, now: int, call: Call) -> StoredResponse | None:
    with call.session() as session:
        row = session.get(ResponseRow, response_id)
        if row is None or row.expires_at <= now:
            return None
        return StoredResponse.from_row(row)


def chain_sync(response_id: str, now: int, limit: int, call: Call) -> list[StoredResponse] | None:
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


def count_sync(call: Call) -> int:
    with call.session() as session:
        return int(session.scalar(select(func.count()).select_from(ResponseRow)) or 0)


def shared_secret_sync(name: str, proposed: bytes, call: Call) -> bytes:
    """The secret ``name``, stored as ``proposed`` if no server has stored it
    yet (when two race, the first COMMIT wins and both read it)."""
    from sqlalchemy.exc import IntegrityError

    with call.session() as session:
        found = session.get(SecretRow, name)
        if found is not None:
            return found.value
        session.add(SecretRow(name=name, value=proposed))
        try:
            call.commit(session)
        except IntegrityError:  # another server stored it meanwhile
            session.rollback()
            found = session.get(SecretRow, name)
            assert found is not None
            return found.value
        return proposed
