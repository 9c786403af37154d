"""Request bodies of the Anthropic Messages API (``/v1/messages`` and
``/v1/messages/count_tokens``), with the official field types and ranges.

Message content is modelled per role, as far as this server can map it: a user
turn carries text, images, tool results (and documents, refused later with a
hint), an assistant turn text, thinking and tool calls. ``role: "system"``
messages are not in the public API, but Claude Code's hooks send them.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import AfterValidator, Field

from ...engine.types import SamplingParams
from ..fields import (
    ARRAY,
    STRING,
    ListOrNull,
    NonEmpty,
    PositiveInt,
    RequestModel,
    TokenCount,
    UnitInterval,
    dispatch,
    shape,
    variant,
)

# -- content blocks --------------------------------------------------------------


class TextBlock(RequestModel):
    type: Literal["text"]
    text: str


class ImageBlock(RequestModel):
    type: Literal["image"]
    source: dict[str, Any]


class DocumentBlock(RequestModel):
    type: Literal["document"]


class ThinkingBlock(RequestModel):
    type: Literal["thinking"]
    thinking: str
    signature: str | None = None


class RedactedThinkingBlock(RequestModel):
    type: Literal["redacted_thinking"]
    data: str | None = None


class ToolUseBlock(RequestModel):
    type: Literal["tool_use"]
    id: str
    name: str
    input: dict[str, Any] = Field(default_factory=dict)


# What tool results and system-role messages may hold: text (images become a
# placeholder, since the model reads text only).
PlainBlock = Annotated[
    Annotated[TextBlock, variant("type", "text")] | Annotated[ImageBlock, variant("type", "image")],
    dispatch("type"),
]
PlainContent = Annotated[
    Annotated[str, STRING] | Annotated[list[PlainBlock], ARRAY],
    shape("a string or an array of text and image blocks"),
]


class ToolResultBlock(RequestModel):
    type: Literal["tool_result"]
    tool_use_id: NonEmpty
    content: PlainContent | None = None
    is_error: bool | None = None


UserBlock = Annotated[
    Annotated[TextBlock, variant("type", "text")]
    | Annotated[ImageBlock, variant("type", "image")]
    | Annotated[ToolResultBlock, variant("type", "tool_result")]
    | Annotated[DocumentBlock, variant("type", "document")],
    dispatch("type"),
]
AssistantBlock = Annotated[
    Annotated[TextBlock, variant("type", "text")]
    | Annotated[ThinkingBlock, variant("type", "thinking")]
    | Annotated[RedactedThinkingBlock, variant("type", "redacted_thinking")]
    | Annotated[ToolUseBlock, variant("type", "tool_use")],
    dispatch("type"),
]

# -- messages --------------------------------------------------------------------


class UserMessage(RequestModel):
    role: Literal["user"]
    content: Annotated[
        Annotated[str, STRING] | Annotated[list[UserBlock], ARRAY],
        shape("a string or an array of content blocks"),
    ]


class AssistantMessage(RequestModel):
    role: Literal["assistant"]
    content: Annotated[
        Annotated[str, STRING] | Annotated[list[AssistantBlock], ARRAY],
        shape("a string or an array of content blocks"),
    ]


class SystemMessage(RequestModel):
    role: Literal["system"]
    content: PlainContent


Message = Annotated[
    Annotated[UserMessage, variant("role", "user")]
    | Annotated[AssistantMessage, variant("role", "assistant")]
    | Annotated[SystemMessage, variant("role", "system")],
    dispatch("role"),
]

SystemBlock = Annotated[Annotated[TextBlock, variant("type", "text")], dispatch("type")]

# -- tools, tool_choice, thinking ------------------------------------------------


class Tool(RequestModel):
    """A client tool (``input_schema``), or a server tool (``type`` like
    ``web_search_20250305``) that cannot run here."""

    name: NonEmpty
    type: str | None = None
    description: str | None = None
    input_schema: dict[str, Any] | None = None
    strict: bool | None = None

    @property
    def runs_on_client(self) -> bool:
        return self.type in (None, "custom") or self.input_schema is not None


class AutoChoice(RequestModel):
    type: Literal["auto"]
    disable_parallel_tool_use: bool | None = None


class AnyChoice(RequestModel):
    type: Literal["any"]
    disable_parallel_tool_use: bool | None = None


class NamedChoice(RequestModel):
    type: Literal["tool"]
    name: NonEmpty
    disable_parallel_tool_use: bool | None = None


class NoneChoice(RequestModel):
    type: Literal["none"]


ToolChoice = Annotated[
    Annotated[AutoChoice, variant("type", "auto")]
    | Annotated[AnyChoice, variant("type", "any")]
    | Annotated[NamedChoice, variant("type", "tool")]
    | Annotated[NoneChoice, variant("type", "none")],
    dispatch("type"),
]


class ThinkingEnabled(RequestModel):
    type: Literal["enabled"]
    budget_tokens: PositiveInt | None = None


class ThinkingAdaptive(RequestModel):
    type: Literal["adaptive"]


class ThinkingDisabled(RequestModel):
    type: Literal["disabled"]


Thinking = Annotated[
    Annotated[ThinkingEnabled, variant("type", "enabled")]
    | Annotated[ThinkingAdaptive, variant("type", "adaptive")]
    | Annotated[ThinkingDisabled, variant("type", "disabled")],
    dispatch("type"),
]


def _drop_blank(stops: list[str]) -> list[str]:
    """Blank stop sequences would end every turn at once: ignored (the real API
    rejects them; clients that send them mean no stop)."""
    return [s for s in stops if s.strip()]


# -- structured output -------------------------------------------------------------


class JsonOutputFormat(RequestModel):
    """Structured output: the answer is JSON matching ``schema``."""

    type: Literal["json_schema"]
    schema_: dict[str, Any] = Field(alias="schema")


class OutputConfig(RequestModel):
    effort: str | None = None
    format: JsonOutputFormat | None = None


# -- requests --------------------------------------------------------------------


class CountTokensRequest(RequestModel):
    """``/v1/messages/count_tokens``: a Messages request without its output cap."""

    model: NonEmpty
    messages: Annotated[list[Message], Field(min_length=1)]
    max_tokens: TokenCount | None = None
    system: (
        Annotated[
            Annotated[str, STRING] | Annotated[list[SystemBlock], ARRAY],
            shape("a string or an array of text blocks"),
        ]
        | None
    ) = None
    stream: bool | None = None
    temperature: UnitInterval | None = None
    top_p: UnitInterval | None = None
    # No upper bound: the engine clamps it to the vocabulary, as the real API accepts it.
    top_k: PositiveInt | None = None
    stop_sequences: Annotated[ListOrNull[str], AfterValidator(_drop_blank)] = Field(
        default_factory=list
    )
    thinking: Thinking | None = None
    tools: ListOrNull[Tool] = Field(default_factory=list)
    tool_choice: ToolChoice | None = None
    output_config: OutputConfig | None = None
    # The structured-outputs beta's spelling of output_config.format.
    output_format: JsonOutputFormat | None = None

    @property
    def json_output(self) -> tuple[JsonOutputFormat, str] | None:
        """The structured output asked for, and the field that asked."""
        if self.output_config is not None and self.output_config.format is not None:
            return self.output_config.format, "output_config.format"
        if self.output_format is not None:
            return self.output_format, "output_format"
        return None

    @property
    def thinking_enabled(self) -> bool:
        return isinstance(self.thinking, ThinkingEnabled | ThinkingAdaptive)

    def sampling(self) -> SamplingParams:
        """Engine sampling for this request: greedy unless a temperature is
        given; ``thinking.budget_tokens`` bounds the reasoning (the pipeline
        keeps it only for prompts that start inside it). The output cap and
        constraints are the pipeline's to set."""
        budget = self.thinking.budget_tokens if isinstance(self.thinking, ThinkingEnabled) else None
        return SamplingParams(
            temperature=self.temperature if self.temperature is not None else 0.0,
            top_p=self.top_p if self.top_p is not None else 1.0,
            top_k=self.top_k or 0,
            reasoning_budget=budget,
        )


class MessagesRequest(CountTokensRequest):
    """``/v1/messages``: ``max_tokens`` is required."""

    max_tokens: TokenCount
