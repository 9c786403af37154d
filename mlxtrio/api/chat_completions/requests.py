"""The body of ``POST /v1/chat/completions`` (OpenAI Chat Completions), with
the official field types and ranges (``CreateChatCompletionRequest`` in the
published OpenAPI description).

What a text model cannot do (``n`` above 1, log probabilities, audio, logit
bias, the deprecated ``functions``) is refused with a 400 naming the field;
fields that only steer OpenAI's own service (``store``, ``service_tier``,
``prediction``, ``web_search_options``, ``metadata``) are accepted and ignored.
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
    Penalty,
    RequestModel,
    Seed,
    TokenCount,
    TopLogprobs,
    UnitInterval,
    ZeroToTwo,
    dispatch,
    expect,
    shape,
    variant,
)
from .tools import Tool, ToolChoice

# What the engine does when a request leaves a sampling field out: greedy, as
# on the other routes (agents want reproducible turns).
DEFAULT_TEMPERATURE = 0.0

# -- content parts -------------------------------------------------------------------


class TextPart(RequestModel):
    type: Literal["text"]
    text: str


class ImagePart(RequestModel):
    type: Literal["image_url"]
    image_url: dict[str, Any]


class AudioPart(RequestModel):
    type: Literal["input_audio"]


class FilePart(RequestModel):
    type: Literal["file"]


class RefusalPart(RequestModel):
    type: Literal["refusal"]
    refusal: str


TextParts = Annotated[
    Annotated[str, STRING]
    | Annotated[
        list[Annotated[Annotated[TextPart, variant("type", "text")], dispatch("type")]], ARRAY
    ],
    shape("a string or an array of text parts"),
]
UserPart = Annotated[
    Annotated[TextPart, variant("type", "text")]
    | Annotated[ImagePart, variant("type", "image_url")]
    | Annotated[AudioPart, variant("type", "input_audio")]
    | Annotated[FilePart, variant("type", "file")],
    dispatch("type"),
]
AssistantPart = Annotated[
    Annotated[TextPart, variant("type", "text")]
    | Annotated[RefusalPart, variant("type", "refusal")],
    dispatch("type"),
]

# -- messages ------------------------------------------------------------------------


class SystemMessage(RequestModel):
    role: Literal["system", "developer"]
    content: TextParts
    name: str | None = None


class UserMessage(RequestModel):
    role: Literal["user"]
    content: Annotated[
        Annotated[str, STRING] | Annotated[list[UserPart], ARRAY],
        shape("a string or an array of content parts"),
    ]
    name: str | None = None


class FunctionCall(RequestModel):
    name: NonEmpty
    arguments: str


class FunctionToolCall(RequestModel):
    id: NonEmpty
    type: Literal["function"]
    function: FunctionCall


class CustomCall(RequestModel):
    name: NonEmpty
    input: str


class CustomToolCall(RequestModel):
    id: NonEmpty
    type: Literal["custom"]
    custom: CustomCall


ToolCallParam = Annotated[
    Annotated[FunctionToolCall, variant("type", "function")]
    | Annotated[CustomToolCall, variant("type", "custom")],
    dispatch("type", default="function"),
]


class AssistantMessage(RequestModel):
    role: Literal["assistant"]
    content: (
        Annotated[
            Annotated[str, STRING] | Annotated[list[AssistantPart], ARRAY],
            shape("a string, an array of text and refusal parts, or null"),
        ]
        | None
    ) = None
    refusal: str | None = None
    name: str | None = None
    tool_calls: ListOrNull[ToolCallParam] = Field(default_factory=list)
    # What this server (like vLLM, Ollama and LM Studio) returns as the
    # message's reasoning; clients that keep it send it back.
    reasoning_content: str | None = None
    reasoning: str | None = None


class ToolMessage(RequestModel):
    role: Literal["tool"]
    content: TextParts
    tool_call_id: NonEmpty


class FunctionMessage(RequestModel):
    role: Literal["function"]


Message = Annotated[
    Annotated[SystemMessage, variant("role", "system")]
    | Annotated[SystemMessage, variant("role", "developer")]
    | Annotated[UserMessage, variant("role", "user")]
    | Annotated[AssistantMessage, variant("role", "assistant")]
    | Annotated[ToolMessage, variant("role", "tool")]
    | Annotated[FunctionMessage, variant("role", "function")],
    dispatch("role"),
]

# -- response_format, stream_options, stop ---------------------------------------------


class TextFormat(RequestModel):
    type: Literal["text"]


class JsonObjectFormat(RequestModel):
    type: Literal["json_object"]


class JsonSchemaSpec(RequestModel):
    name: NonEmpty
    schema_: dict[str, Any] | None = Field(default=None, alias="schema")
    description: str | None = None
    strict: bool | None = None


class JsonSchemaFormat(RequestModel):
    type: Literal["json_schema"]
    json_schema: JsonSchemaSpec


ResponseFormat = Annotated[
    Annotated[TextFormat, variant("type", "text")]
    | Annotated[JsonObjectFormat, variant("type", "json_object")]
    | Annotated[JsonSchemaFormat, variant("type", "json_schema")],
    dispatch("type"),
]


class StreamOptions(RequestModel):
    include_usage: bool | None = None
    include_obfuscation: bool | None = None


def _drop_blank(stops: list[str]) -> list[str]:
    """Blank stop strings would end every turn at once: clients that send
    them mean no stop."""
    return [s for s in stops if s]


Stop = Annotated[
    Annotated[str, STRING]
    | Annotated[
        Annotated[list[str], Field(max_length=4), AfterValidator(_drop_blank)],
        ARRAY,
    ],
    shape("a string or an array of at most 4 strings"),
]


class ChatTemplateKwargs(RequestModel):
    """vLLM's extension, which chat clients send to turn thinking on or off."""

    enable_thinking: bool | None = None


# -- the request -----------------------------------------------------------------------

# Fields that ask for what a text model served here cannot do, and why.
_REFUSED = {
    "functions": "the deprecated functions are not supported: send them as tools",
    "function_call": "the deprecated function_call is not supported: send tool_choice",
    "audio": "audio output is not supported: this server generates text",
}


class ChatCompletionRequest(RequestModel):
    model: NonEmpty
    messages: Annotated[list[Message], Field(min_length=1)]
    max_completion_tokens: TokenCount | None = None
    max_tokens: TokenCount | None = None
    stream: bool | None = None
    stream_options: StreamOptions | None = None
    temperature: ZeroToTwo | None = None
    top_p: UnitInterval | None = None
    presence_penalty: Penalty | None = None
    frequency_penalty: Penalty | None = None
    seed: Seed | None = None
    stop: Stop | None = None
    n: Annotated[int, Field(ge=1, le=128), expect("an integer between 1 and 128")] | None = None
    logprobs: bool | None = None
    top_logprobs: TopLogprobs | None = None
    logit_bias: dict[str, Any] | None = None
    modalities: ListOrNull[Literal["text"]] = Field(default_factory=list)
    tools: ListOrNull[Tool] = Field(default_factory=list)
    tool_choice: ToolChoice | None = None
    parallel_tool_calls: bool | None = None
    response_format: ResponseFormat | None = None
    reasoning_effort: str | None = None
    chat_template_kwargs: ChatTemplateKwargs | None = None
    prompt_cache_key: str | None = None
    user: str | None = None
    safety_identifier: str | None = None

    def unsupported(self) -> tuple[str, str] | None:
        """(field, why) for the first thing asked that this server cannot do."""
        extra = self.model_extra or {}
        for name, why in _REFUSED.items():
            if extra.get(name) is not None:
                return name, why
        if self.n is not None and self.n > 1:
            return "n", "one choice per request is supported (n must be 1)"
        if self.logprobs:
            return "logprobs", "log probabilities are not supported"
        if self.logit_bias:
            return "logit_bias", "logit bias is not supported"
        return None

    @property
    def output_cap(self) -> int | None:
        """``max_completion_tokens``, or the older ``max_tokens``."""
        return self.max_completion_tokens or self.max_tokens

    @property
    def thinking(self) -> bool:
        """Reasoning on: asked for by ``reasoning_effort`` (not ``none`` or
        ``minimal``) or by ``chat_template_kwargs.enable_thinking``."""
        kwargs = self.chat_template_kwargs
        if kwargs is not None and kwargs.enable_thinking is not None:
            return kwargs.enable_thinking
        return self.reasoning_effort not in (None, "none", "minimal")

    @property
    def stop_sequences(self) -> list[str]:
        if self.stop is None:
            return []
        return [self.stop] if isinstance(self.stop, str) and self.stop else list(self.stop or [])

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)

    def sampling(self) -> SamplingParams:
        """Engine sampling for this request; absent fields take the defaults
        above. The output cap and constraints are the pipeline's to set."""
        return SamplingParams(
            temperature=_given(self.temperature, DEFAULT_TEMPERATURE),
            top_p=_given(self.top_p, 1.0),
            presence_penalty=_given(self.presence_penalty, 0.0),
            frequency_penalty=_given(self.frequency_penalty, 0.0),
            seed=self.seed,
        )


def _given(value: float | None, default: float) -> float:
    return value if value is not None else default
