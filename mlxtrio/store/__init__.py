"""The response store: stored Responses API turns, for retrieval and
``previous_response_id`` continuations (SQLAlchemy; SQLite by default)."""

from .store import ResponseStore, StoredResponse, StoreError

__all__ = ["ResponseStore", "StoreError", "StoredResponse"]
