"""What the response store holds: :class:`StoredResponse`, one stored Responses
API turn, and how it maps onto its row in the ``responses`` table."""

from __future__ import annotations

import json
from dataclasses import dataclass, fields
from typing import Any, cast

from .schema import ResponseRow

ID_LENGTH: int = cast(Any, ResponseRow.__table__).c.id.type.length


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


def can_exist(response_id: str) -> bool:
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
