"""The response store: stored Responses API turns, for retrieval and
``previous_response_id`` continuations (SQLAlchemy; SQLite by default)."""

from .errors import StoreBusy, StoreError, StoreReadOnly, StoreUnavailable
from .records import StoredResponse
from .store import ResponseStore

__all__ = [
    "ResponseStore",
    "StoreBusy",
    "StoreError",
    "StoreReadOnly",
    "StoreUnavailable",
    "StoredResponse",
]
