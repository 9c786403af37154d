"""Wire schemas of the OpenAI Responses API (what goes out on ``/v1/responses``).

The response object carries every field of the official ``Response`` schema,
nullable ones present as ``null``: strict clients validate the full shape. Every
object and event here validates against both published schemas, Open Responses
and OpenAI's OpenAPI (``tests/test_schema_conformance.py``); where the two
differ, the official API wins.
"""

from __future__ import annotations

import time
import uuid
from typing import Any, Literal

from pydantic import BaseModel, Field


def new_id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


class OutputText(BaseModel):
    type: Literal["output_text"] = "output_text"
    text: str = ""
    annotations: list[Any] = Field(default_factory=list)
    logprobs: list[Any] = Field(default_factory=list)


class MessageItem(BaseModel):
    id: str = Field(default_factory=lambda: new_id("msg"))
    type: Literal["message"] = "message"
    role: Literal["assistant"] = "assistant"
    status: Literal["in_progress", "completed", "incomplete"] = "in_progress"
    content: list[OutputText] = Field(default_factory=list)


class SummaryText(BaseModel):
    type: Literal["summary_text"] = "summary_text"
    text: str = ""


class ReasoningItem(BaseModel):
    id: str = Field(default_factory=lambda: new_id("rs"))
    type: Literal["reasoning"] = "reasoning"
    summary: list[SummaryText] = Field(default_factory=list)
    # Left out when empty: both schemas type them as an array / a string.
    content: list[Any] | None = Field(default=None, exclude_if=lambda value: value is None)
    encrypted_content: str | None = Field(default=None, exclude_if=lambda value: value is None)
    # OpenAI's schema has no null here: the item's lifecycle, as for messages.
    status: Literal["in_progress", "completed", "incomplete"] = "in_progress"


class FunctionCallItem(BaseModel):
    id: str = Field(default_factory=lambda: new_id("fc"))
    type: Literal["function_call"] = "function_call"
    call_id: str = Field(default_factory=lambda: new_id("call"))
    name: str
    arguments: str = ""
    status: Literal["in_progress", "completed", "incomplete"] = "in_progress"


class CustomToolCallItem(BaseModel):
    id: str = Field(default_factory=lambda: new_id("ctc"))
    type: Literal["custom_tool_call"] = "custom_tool_call"
    call_id: str = Field(default_factory=lambda: new_id("call"))
    name: str
    input: str = ""
    status: Literal["in_progress", "completed", "incomplete"] = "in_progress"


OutputItem = MessageItem | ReasoningItem | FunctionCallItem | CustomToolCallItem


class InputTokensDetails(BaseModel):
    cached_tokens: int = 0
    # OpenAI's schema requires it; prefix caching here is implicit and free.
    cache_write_tokens: int = 0


class OutputTokensDetails(BaseModel):
    reasoning_tokens: int = 0


class Usage(BaseModel, extra="allow"):
    """Complete usage; the reference server's timing extensions ride along as
    extra keys (``time_to_first_token_ms``, ``prefill_tokens_per_second``, ...)."""

    input_tokens: int = 0
    input_tokens_details: InputTokensDetails = Field(default_factory=InputTokensDetails)
    output_tokens: int = 0
    output_tokens_details: OutputTokensDetails = Field(default_factory=OutputTokensDetails)
    total_tokens: int = 0


class ResponseError(BaseModel):
    code: str
    message: str

    @classmethod
    def of(cls, code: str, message: str) -> ResponseError:
        """The error of a failed response. Its ``code`` is one of the official
        codes (:data:`RESPONSE_ERROR_CODES`, what strict clients accept): any
        other, more specific code of ours is sent as ``server_error`` and kept,
        in parentheses, at the end of the message."""
        if code in RESPONSE_ERROR_CODES:
            return cls(code=code, message=message)
        return cls(code="server_error", message=f"{message} ({code})")


# OpenAI's ResponseErrorCode: the codes a Response's ``error`` may carry.
RESPONSE_ERROR_CODES = frozenset(
    {
        "server_error",
        "rate_limit_exceeded",
        "invalid_prompt",
        "data_residency_mismatch",
        "bio_policy",
        "vector_store_timeout",
        "invalid_image",
        "invalid_image_format",
        "invalid_base64_image",
        "invalid_image_url",
        "image_too_large",
        "image_too_small",
        "image_parse_error",
        "image_content_policy_violation",
        "invalid_image_mode",
        "image_file_too_large",
        "unsupported_image_media_type",
        "empty_image_file",
        "failed_to_download_image",
        "image_file_not_found",
    }
)


class IncompleteDetails(BaseModel):
    reason: str


class TextConfig(BaseModel, extra="allow"):
    format: dict[str, Any] = Field(default_factory=lambda: {"type": "text"})
    verbosity: str | None = None


class ResponseObject(BaseModel):
    id: str = Field(default_factory=lambda: new_id("resp"))
    object: Literal["response"] = "response"
    created_at: int = Field(default_factory=lambda: int(time.time()))
    completed_at: int | None = None
    status: Literal["in_progress", "completed", "incomplete", "failed", "cancelled", "queued"] = (
        "in_progress"
    )
    error: ResponseError | None = None
    incomplete_details: IncompleteDetails | None = None
    instructions: str | None = None
    model: str
    output: list[OutputItem] = Field(default_factory=list)
    output_text: str = ""
    parallel_tool_calls: bool = True
    previous_response_id: str | None = None
    prompt_cache_key: str | None = None
    reasoning: dict[str, Any] | None = None
    max_output_tokens: int | None = None
    max_tool_calls: int | None = None
    # The sampling values actually used (Open Responses requires numbers here).
    temperature: float = 0.0
    top_p: float = 1.0
    top_logprobs: int = 0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    text: TextConfig | None = None
    tool_choice: Any = "auto"
    tools: list[dict[str, Any]] = Field(default_factory=list)
    truncation: str | None = "disabled"
    # Never null: OpenAI's schema types it as an object (zeros until the end),
    # Open Responses requires it present.
    usage: Usage = Field(default_factory=Usage)
    # Deprecated by OpenAI and typed a string (not null) there: left out unless given.
    user: str | None = Field(default=None, exclude_if=lambda value: value is None)
    safety_identifier: str | None = None
    service_tier: str | None = "default"
    store: bool = True
    background: bool = False
    metadata: dict[str, Any] = Field(default_factory=dict)

    def wire(self) -> dict[str, Any]:
        """The JSON-ready dict, every field present."""
        return self.model_dump(mode="json")


# -- input items, as GET /v1/responses/{id}/input_items lists them ------------------

_ID_PREFIX = {
    "message": "msg",
    "function_call": "fc",
    "function_call_output": "fco",
    "custom_tool_call": "ctc",
    "custom_tool_call_output": "ctco",
    "reasoning": "rs",
}
# Items whose listed form (OpenAI's ``*Resource`` schemas) requires a status.
_WITH_STATUS = {
    "message",
    "function_call",
    "function_call_output",
    "custom_tool_call",
    "custom_tool_call_output",
}


def input_item_resource(item: dict[str, Any]) -> dict[str, Any]:
    """One input item (as the client sent it) in the shape OpenAI's
    ``ItemResource`` lists it: an ``id`` and a ``status`` on every item that has
    one, message content as a list of parts (output parts of assistant messages
    with ``annotations`` and ``logprobs``), no ``null`` where the schema has an
    array. Idempotent: a listed item is listed unchanged."""
    item = dict(item)
    kind = item.setdefault("type", "message")
    if kind == "message":
        item["content"] = _message_parts(item.get("role"), item.get("content"))
    elif kind == "reasoning":
        for key in ("content", "encrypted_content", "status"):
            if key in item and item[key] is None:
                del item[key]
        if item.get("summary") is None:
            item["summary"] = []
    if kind in _WITH_STATUS and item.get("status") is None:
        item["status"] = "completed"
    if not item.get("id"):
        item["id"] = new_id(_ID_PREFIX.get(kind, "item"))
    return item


def input_item_resources(items: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return [input_item_resource(item) for item in items]


def _message_parts(role: Any, content: Any) -> list[Any]:
    assistant = role == "assistant"
    if isinstance(content, str):
        content = [{"type": "output_text" if assistant else "input_text", "text": content}]
    if not isinstance(content, list):
        return []
    parts = []
    for part in content:
        if (
            assistant
            and isinstance(part, dict)
            and part.get("type") in ("output_text", "input_text", "text")
        ):
            part = {**part, "type": "output_text"}
            for key in ("annotations", "logprobs"):
                if part.get(key) is None:
                    part[key] = []
        parts.append(part)
    return parts
