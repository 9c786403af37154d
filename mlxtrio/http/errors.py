"""API errors and the two envelopes they are rendered in.

Every error the server returns is an :class:`ApiError`. Which envelope it gets
depends on the API the request came in on, decided by its path:
``/v1/messages*`` speaks Anthropic, everything else OpenAI.
"""

from __future__ import annotations

import enum
import json
from dataclasses import dataclass
from typing import Any


class Envelope(enum.Enum):
    OPENAI = "openai"
    ANTHROPIC = "anthropic"

    @classmethod
    def for_path(cls, path: str) -> Envelope:
        return cls.ANTHROPIC if path.startswith("/v1/messages") else cls.OPENAI


# Anthropic names its error types differently from OpenAI for a few statuses.
_ANTHROPIC_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    405: "invalid_request_error",
    413: "request_too_large",
    429: "rate_limit_error",
    500: "api_error",
    503: "overloaded_error",
    529: "overloaded_error",
}


@dataclass
class ApiError(Exception):
    """An error with an HTTP status, rendered in the envelope of its API."""

    status: int
    message: str
    type: str = "invalid_request_error"
    param: str | None = None
    code: str | None = None
    headers: dict[str, str] | None = None

    def __str__(self) -> str:
        return self.message

    def envelope(self, shape: Envelope) -> dict[str, Any]:
        if shape is Envelope.ANTHROPIC:
            kind = _ANTHROPIC_TYPES.get(self.status, self.type)
            if self.status == 400:
                kind = "invalid_request_error"
            return {"type": "error", "error": {"type": kind, "message": self.message}}
        return {
            "error": {
                "type": self.type,
                "message": self.message,
                "param": self.param,
                "code": self.code,
            }
        }

    def body(self, shape: Envelope) -> bytes:
        return json.dumps(self.envelope(shape)).encode()


def invalid_request(message: str, param: str | None = None) -> ApiError:
    return ApiError(400, message, "invalid_request_error", param)


def not_found(message: str) -> ApiError:
    return ApiError(404, message, "not_found_error")


def server_error(message: str) -> ApiError:
    return ApiError(500, message, "server_error")


def rate_limited(message: str, retry_after: int = 1) -> ApiError:
    return ApiError(
        429,
        message,
        "rate_limit_error",
        code="queue_full",
        headers={"Retry-After": str(retry_after)},
    )


def unavailable(message: str) -> ApiError:
    return ApiError(503, message, "server_error", headers={"Retry-After": "5"})
