"""Input items of an OpenAI Responses request (``input`` as an array).

The accepted item types are the ones agent clients send back with each turn:
messages, reasoning, function and custom tool calls and their outputs, the
compaction items of ``/v1/responses/compact``, plus references and server-side
tool records, which carry nothing to render. An item without ``type`` is a
message (the SDKs' "easy input message").
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import Field, model_validator

from ..fields import (
    ARRAY,
    OBJECT,
    STRING,
    ListOrNull,
    NonEmpty,
    RequestModel,
    dispatch,
    shape,
    variant,
)
from .tools import Tool

# -- content parts -----------------------------------------------------------------


class TextPart(RequestModel):
    type: Literal["input_text", "output_text", "summary_text", "text"]
    text: str


class RefusalPart(RequestModel):
    type: Literal["refusal"]
    refusal: str


class ImagePart(RequestModel):
    type: Literal["input_image"]
    image_url: str | None = None
    file_id: str | None = None
    detail: str | None = None


ContentPart = Annotated[
    Annotated[TextPart, variant("type", "input_text")]
    | Annotated[TextPart, variant("type", "output_text")]
    | Annotated[TextPart, variant("type", "summary_text")]
    | Annotated[TextPart, variant("type", "text")]
    | Annotated[RefusalPart, variant("type", "refusal")]
    | Annotated[ImagePart, variant("type", "input_image")],
    dispatch("type"),
]
Content = Annotated[
    Annotated[str, STRING] | Annotated[list[ContentPart], ARRAY],
    shape("a string or an array of content parts"),
]

# -- items ---------------------------------------------------------------------------


class MessageItem(RequestModel):
    type: Literal["message"] = "message"
    role: Literal["user", "assistant", "system", "developer"]
    content: Content = ""


class SummaryText(RequestModel):
    type: Literal["summary_text"] = "summary_text"
    text: str


class ReasoningItem(RequestModel):
    type: Literal["reasoning"]
    summary: ListOrNull[SummaryText] = Field(default_factory=list)
    # What this server issued comes back here (see chat.sealing); anything else is ignored.
    encrypted_content: str | None = None


class FunctionCallItem(RequestModel):
    type: Literal["function_call"]
    name: str
    call_id: str | None = None
    id: str | None = None
    # A JSON string; an already parsed object is taken as well.
    arguments: Annotated[
        Annotated[str, STRING] | Annotated[dict[str, Any], OBJECT],
        shape("a string of JSON arguments"),
    ] = ""


class CustomToolCallItem(RequestModel):
    type: Literal["custom_tool_call"]
    name: str
    call_id: str | None = None
    id: str | None = None
    input: str = ""


class ToolOutputItem(RequestModel):
    """A function or custom tool's result, answering the call ``call_id``.

    Codex also sends outputs that answer no call, named instead (``name``,
    ``namespace``): after ``create_goal`` it reports the goal's objective as
    ``{"type": "function_call_output", "name": "goal_objective", "namespace":
    "agent", "output": ...}``. One of ``call_id`` and ``name`` is required."""

    type: Literal["function_call_output", "custom_tool_call_output"]
    # Required, but None for a named output (see _named_outputs_answer_no_call).
    call_id: NonEmpty | None
    name: NonEmpty | None = None
    namespace: str | None = None
    output: Annotated[
        Annotated[str, STRING]
        | Annotated[list[ContentPart], ARRAY]
        | Annotated[dict[str, Any], OBJECT],
        shape("a string, an array of content parts or an object"),
    ] = ""

    @model_validator(mode="before")
    @classmethod
    def _named_outputs_answer_no_call(cls, data: Any) -> Any:
        if not isinstance(data, dict) or data.get("call_id") is not None:
            return data
        if data.get("name"):
            return {**data, "call_id": None}
        return {k: v for k, v in data.items() if k != "call_id"}  # missing: a 400

    @property
    def source(self) -> str:
        """What produced a named output: ``namespace.name``, or ``name``."""
        return ".".join(filter(None, (self.namespace, self.name)))


class CompactionItem(RequestModel):
    """The summary ``/v1/responses/compact`` returned, sent back in a later
    request's input: sealed by this server (see chat.sealing), so it is opaque
    to the client and cannot be altered or forged."""

    type: Literal["compaction"]
    encrypted_content: str
    id: str | None = None


class AdditionalToolsItem(RequestModel):
    """Tools made available from this point of the conversation on (Codex
    sends its tools this way to its own models)."""

    type: Literal["additional_tools"]
    role: Literal["developer"] = "developer"
    tools: list[Tool]
    id: str | None = None


class PassiveItem(RequestModel):
    """References and server-side tool records: nothing for the model to read."""

    type: Literal["item_reference", "web_search_call", "tool_search_call", "tool_search_output"]


InputItem = Annotated[
    Annotated[MessageItem, variant("type", "message")]
    | Annotated[ReasoningItem, variant("type", "reasoning")]
    | Annotated[FunctionCallItem, variant("type", "function_call")]
    | Annotated[CustomToolCallItem, variant("type", "custom_tool_call")]
    | Annotated[ToolOutputItem, variant("type", "function_call_output")]
    | Annotated[ToolOutputItem, variant("type", "custom_tool_call_output")]
    | Annotated[CompactionItem, variant("type", "compaction")]
    | Annotated[AdditionalToolsItem, variant("type", "additional_tools")]
    | Annotated[PassiveItem, variant("type", "item_reference")]
    | Annotated[PassiveItem, variant("type", "web_search_call")]
    | Annotated[PassiveItem, variant("type", "tool_search_call")]
    | Annotated[PassiveItem, variant("type", "tool_search_output")],
    dispatch("type", default="message"),
]
ToolCallItem = FunctionCallItem | CustomToolCallItem
