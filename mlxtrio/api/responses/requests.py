"""The body of ``POST /v1/responses`` (OpenAI Responses / Open Responses), with
the official field types and ranges; input items are in :mod:`.items`.

Tools of types this server cannot offer (``web_search``, ``tool_search``, ...)
are accepted and ignored: agent clients always send them.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import AfterValidator, Field

from ...engine.types import SamplingParams
from ..fields import (
    ARRAY,
    OBJECT,
    STRING,
    CacheSalt,
    ListOrNull,
    NonEmpty,
    Penalty,
    RequestModel,
    RetentionSeconds,
    Seed,
    TokenCount,
    TopLogprobs,
    UnitInterval,
    ZeroToTwo,
    dispatch,
    shape,
    variant,
)
from .items import AdditionalToolsItem, InputItem, MessageItem
from .tools import (
    CustomTool,
    NamespaceTool,
    TextFormat,
    Tool,
)

# What the engine does when a request leaves a sampling field out (echoed on the
# Response object, which must carry the values actually used).
DEFAULT_TEMPERATURE = 0.0  # greedy
DEFAULT_TOP_P = 1.0
DEFAULT_PENALTY = 0.0


class NamedToolChoice(RequestModel):
    type: Literal["function", "custom"]
    name: str


class HostedToolChoice(RequestModel):
    """``allowed_tools``, ``mcp`` and hosted tool choices: not enforced here."""

    type: str


ToolChoice = Annotated[
    Annotated[Literal["none", "auto", "required"], STRING]
    | Annotated[
        Annotated[
            Annotated[NamedToolChoice, variant("type", "function")]
            | Annotated[NamedToolChoice, variant("type", "custom")]
            | Annotated[HostedToolChoice, variant("type", "hosted")],
            dispatch("type", known=("function", "custom"), fallback="hosted"),
        ],
        OBJECT,
    ],
    shape('"none", "auto", "required" or a tool choice object'),
]

# -- text, reasoning, metadata -------------------------------------------------------


class JsonSchemaFormat(RequestModel):
    type: Literal["json_schema"]
    name: str
    schema_: dict[str, Any] = Field(alias="schema")
    description: str | None = None
    strict: bool | None = None


class JsonObjectFormat(RequestModel):
    type: Literal["json_object"]


class TextParam(RequestModel):
    format: (
        Annotated[
            Annotated[TextFormat, variant("type", "text")]
            | Annotated[JsonSchemaFormat, variant("type", "json_schema")]
            | Annotated[JsonObjectFormat, variant("type", "json_object")],
            dispatch("type"),
        ]
        | None
    ) = None
    verbosity: str | None = None


class Reasoning(RequestModel):
    effort: str | None = None
    summary: str | None = None


class Metadata(RequestModel):
    """Free-form; only ``retention_seconds`` (how long a stored turn is kept) is read."""

    retention_seconds: RetentionSeconds | None = None


def _absent_if_empty(value: str | None) -> str | None:
    return value or None


# -- the request ---------------------------------------------------------------------


class ResponsesRequest(RequestModel):
    model: NonEmpty
    input: Annotated[
        Annotated[str, STRING] | Annotated[list[InputItem], ARRAY],
        shape("a string or an array of input items"),
    ]
    max_output_tokens: TokenCount | None = None
    metadata: Metadata | None = None
    instructions: str | None = None
    # "" is the same as no previous response.
    previous_response_id: Annotated[str | None, AfterValidator(_absent_if_empty)] = None
    stream: bool | None = None
    store: bool | None = None
    background: bool | None = None
    temperature: ZeroToTwo | None = None
    top_p: UnitInterval | None = None
    presence_penalty: Penalty | None = None
    frequency_penalty: Penalty | None = None
    seed: Seed | None = None
    top_logprobs: TopLogprobs | None = None
    tools: ListOrNull[Tool] = Field(default_factory=list)
    tool_choice: ToolChoice | None = None
    parallel_tool_calls: bool | None = None
    reasoning: Reasoning | None = None
    text: TextParam | None = None
    include: ListOrNull[str] = Field(default_factory=list)
    cache_salt: CacheSalt | None = None
    prompt_cache_key: str | None = None
    user: str | None = None
    safety_identifier: str | None = None

    @property
    def items(self) -> list[InputItem]:
        """``input`` as a list of items (a string is one user message)."""
        if isinstance(self.input, str):
            return [MessageItem(role="user", content=self.input)]
        return list(self.input)

    @property
    def thinking(self) -> bool:
        # Any reasoning object turns thinking on (Codex sends {"summary": "auto"}
        # alone, meaning the default effort); "none"/"minimal" turn it off.
        return self.reasoning is not None and self.reasoning.effort not in ("none", "minimal")

    @property
    def wants_sealed_reasoning(self) -> bool:
        return "reasoning.encrypted_content" in self.include

    @property
    def custom_tool_names(self) -> set[str]:
        """Freeform tools, whose calls come back as ``custom_tool_call`` items."""
        tools = [*self.tools, *self.added_tools]
        inner = [t for n in tools if isinstance(n, NamespaceTool) for t in n.tools]
        return {t.name for t in [*tools, *inner] if isinstance(t, CustomTool)}

    @property
    def added_tools(self) -> list[Tool]:
        """Tools that ``additional_tools`` input items make available."""
        return [t for i in self.items if isinstance(i, AdditionalToolsItem) for t in i.tools]

    @property
    def retention_seconds(self) -> int | None:
        return self.metadata.retention_seconds if self.metadata is not None else None

    def sampling(self) -> SamplingParams:
        """Engine sampling for this request; absent fields take the defaults
        above. The output cap and constraints are the pipeline's to set."""
        return SamplingParams(
            temperature=_given(self.temperature, DEFAULT_TEMPERATURE),
            top_p=_given(self.top_p, DEFAULT_TOP_P),
            presence_penalty=_given(self.presence_penalty, DEFAULT_PENALTY),
            frequency_penalty=_given(self.frequency_penalty, DEFAULT_PENALTY),
            seed=self.seed,
        )


def _given(value: float | None, default: float) -> float:
    return value if value is not None else default
