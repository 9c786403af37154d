"""Wire schemas of the OpenAI Responses API (what goes out on ``/v1/responses``).

The response object carries every field of the official ``Response`` schema,
nullable ones present as ``null``: strict clients validate the full shape.
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
    status: Literal["in_progress", "completed", "incomplete"] | None = None


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


class OutputTokensDetails(BaseModel):
    reasoning_tokens: int = 0


class Usage(BaseModel, extra="allow"):
    """Complete usage; timing extensions (spec §4.3) ride along as extra keys."""

    input_tokens: int = 0
    input_tokens_details: InputTokensDetails = Field(default_factory=InputTokensDetails)
    output_tokens: int = 0
    output_tokens_details: OutputTokensDetails = Field(default_factory=OutputTokensDetails)
    total_tokens: int = 0


class ResponseError(BaseModel):
    code: str
    message: str


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
    usage: Usage | None = None
    user: str | None = None
    safety_identifier: str | None = None
    service_tier: str | None = "default"
    store: bool = True
    background: bool = False
    metadata: dict[str, Any] = Field(default_factory=dict)

    def wire(self) -> dict[str, Any]:
        """The JSON-ready dict, every field present."""
        return self.model_dump(mode="json")
