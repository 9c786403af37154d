"""The response store: stored Responses API turns, for retrieval and
``previous_response_id`` continuations (SQLAlchemy; SQLite by default)."""

from .errors import StoreBusy, StoreError, StoreReadOnly, StoreUnavailable
from .store import ResponseStore, StoredResponse

__all__ = [
    "ResponseStore",
    "StoreBusy",
    "StoreError",
    "StoreReadOnly",
    "StoreUnavailable",
    "StoredResponse",
]
