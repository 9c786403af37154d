"""One store call, shared between the Trio task that makes it and the worker
thread that runs it.

Trio can stop waiting for a worker thread (``abandon_on_cancel=True``) but cannot
stop the thread. So when a caller gives up - its deadline passed, or its task was
cancelled because the client hung up - the Trio side *abandons* the call, and the
worker checks that mark at the points where it changes what must happen:

* before COMMIT: an abandoned write is rolled back instead (:meth:`Call.commit`);
* once the result exists: a result the caller will never see is taken back
  (:meth:`Call.deliver`: the compensating delete of a row whose COMMIT was in
  flight when the caller gave up).

One lock orders the two sides, so exactly one of them runs the take-back: the
worker if the call was abandoned before it delivered, the Trio side (see
:meth:`Call.abandon`) if it was abandoned after the worker delivered but before
the result reached the caller.

:func:`run_in_thread` is the worker's side of a call: it hands back what the
work returned or raised as an :class:`Outcome`, unwrapped on the Trio side.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import Generic, TypeVar, cast

from sqlalchemy import Engine
from sqlalchemy.orm import Session

from .errors import Abandoned, Redactor, StoreError, translate

log = logging.getLogger("mlxtrio.store")

T = TypeVar("T")
Undo = Callable[[], object]


class Gauge:
    """A thread-safe count (of abandoned calls whose worker thread still runs)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._value = 0

    @property
    def value(self) -> int:
        return self._value

    def add(self, n: int) -> None:
        with self._lock:
            self._value += n


class Call:
    """The state of one store call. Methods say which side may call them; each
    holds the lock only for a few assignments, so the Trio side never waits on
    the database through it."""

    def __init__(self, engine: Engine | None, stuck: Gauge) -> None:
        self.engine = engine
        self._stuck = stuck
        self._lock = threading.Lock()
        self._started = False
        self._finished = False
        self._abandoned = False
        self._counted = False  # counted in ``stuck``
        self._undo: tuple[Undo, str] | None = None  # delivered, not yet received

    @property
    def started(self) -> bool:
        return self._started

    # -- Trio side --------------------------------------------------------------

    def abandon(self, timed_out: bool) -> tuple[Undo, str] | None:
        """The caller has given up: from now on the worker rolls back instead of
        committing, and takes back what it delivers. Returns the take-back (and a
        description for logs) of a result the worker delivered that the caller
        never received; the caller must run it (on a thread). Never blocks on
        the database.

        A running worker whose call ``timed_out`` counts as stuck until it
        finishes (a cancelled caller says nothing about the database)."""
        with self._lock:
            self._abandoned = True
            if timed_out and self._started and not self._finished and not self._counted:
                self._counted = True
                self._stuck.add(1)
            undo, self._undo = self._undo, None
        return undo

    # -- worker side ------------------------------------------------------------

    def start(self) -> None:
        """Mark the worker as running; raise :class:`Abandoned` if the caller
        gave up before the thread even started (there is nothing to do)."""
        with self._lock:
            self._started = True
            if self._abandoned:
                raise Abandoned

    def finish(self) -> None:
        with self._lock:
            self._finished = True
            if self._counted:
                self._stuck.add(-1)

    def check(self) -> None:
        """Raise :class:`Abandoned` if the caller has given up."""
        with self._lock:
            if self._abandoned:
                raise Abandoned

    def session(self) -> Session:
        assert self.engine is not None, "the store hands an engine to every call but open"
        return Session(self.engine, expire_on_commit=False)

    def commit(self, session: Session, undo: Undo | None = None, what: str = "") -> None:
        """COMMIT ``session``'s transaction unless the caller has given up.

        If it has, raise :class:`Abandoned` without committing (closing the
        session rolls back). If it gives up while the COMMIT is in flight, run
        ``undo`` once the COMMIT returns (see :meth:`deliver`): with an ``undo``,
        the transaction never outlives a caller that gave up.
        """
        self.check()
        session.commit()
        if undo is not None:
            self.deliver(undo, what)

    def deliver(self, undo: Undo, what: str) -> None:
        """The result exists and ``undo`` takes it back. If the caller has given
        up, run ``undo`` now and raise :class:`Abandoned`; otherwise leave it for
        :meth:`abandon`, in case the caller gives up before it receives the
        result."""
        with self._lock:
            if not self._abandoned:
                self._undo = (undo, what)
                return
        run_undo(undo, what)
        raise Abandoned


def run_undo(undo: Undo, what: str, *, failed_commit: bool = False) -> None:
    """Run a take-back on a worker thread; it is too late to tell anyone but the
    log if it fails.

    With ``failed_commit``, the take-back of a write whose COMMIT failed but may
    have landed (PostgreSQL): logged only if it fails, as the caller's error is
    already on its way.
    """
    try:
        undo()
    except Exception as exc:  # undos raise StoreError, whose detail is redacted
        detail = exc.detail if isinstance(exc, StoreError) else type(exc).__name__
        if failed_commit:
            log.error(
                "%s failed at COMMIT and may have landed; removing it failed: %s", what, detail
            )
        else:
            log.error("could not take back %s after its caller gave up: %s", what, detail)
    else:
        if not failed_commit:
            log.info("took back %s: its caller gave up before it completed", what)


# -- running a call on its worker thread ---------------------------------------------


@dataclass
class Outcome(Generic[T]):
    """What a worker thread produced: its value, or the exception it raised."""

    value: T | None = None
    error: Exception | None = None

    def unwrap(self, redact: Redactor) -> T:
        """The value; the error is raised as a :class:`StoreError` (see ``errors.py``)."""
        if isinstance(self.error, StoreError):
            raise self.error
        if self.error is not None:
            raise translate(self.error, redact) from self.error
        return cast(T, self.value)


def run_in_thread(call: Call, work: Callable[[Call], T]) -> Outcome[T]:
    """The worker thread's side of ``call``: run ``work`` unless the caller has
    already gone, and hand back what it returned or raised. The errors come back
    inside the :class:`Outcome` so that they are translated on the Trio side."""
    try:
        call.start()
        return Outcome(value=work(call))
    except Exception as exc:
        return Outcome(error=exc)
    finally:
        call.finish()
