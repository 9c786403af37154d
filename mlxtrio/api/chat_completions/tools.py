"""Tools and ``tool_choice`` of a Chat Completions request (``ChatCompletionTool``,
``CustomToolChatCompletions`` and ``ChatCompletionToolChoiceOption`` in the
published OpenAPI description)."""

from __future__ import annotations

from typing import Annotated, Any, Literal

from ..fields import OBJECT, STRING, NonEmpty, RequestModel, dispatch, shape, variant


class FunctionDefinition(RequestModel):
    name: NonEmpty
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class FunctionTool(RequestModel):
    type: Literal["function"]
    function: FunctionDefinition


class GrammarSpec(RequestModel):
    definition: str
    syntax: Literal["lark", "regex"]


class TextCustomFormat(RequestModel):
    type: Literal["text"]


class GrammarCustomFormat(RequestModel):
    type: Literal["grammar"]
    grammar: GrammarSpec


class CustomDefinition(RequestModel):
    name: NonEmpty
    description: str | None = None
    format: (
        Annotated[
            Annotated[TextCustomFormat, variant("type", "text")]
            | Annotated[GrammarCustomFormat, variant("type", "grammar")],
            dispatch("type"),
        ]
        | None
    ) = None


class CustomTool(RequestModel):
    """A freeform tool: the model writes raw text (a grammar may hold it)."""

    type: Literal["custom"]
    custom: CustomDefinition


Tool = Annotated[
    Annotated[FunctionTool, variant("type", "function")]
    | Annotated[CustomTool, variant("type", "custom")],
    dispatch("type"),
]


class ChosenName(RequestModel):
    name: NonEmpty


class NamedFunctionChoice(RequestModel):
    type: Literal["function"]
    function: ChosenName


class NamedCustomChoice(RequestModel):
    type: Literal["custom"]
    custom: ChosenName


class AllowedTools(RequestModel):
    mode: Literal["auto", "required"]
    tools: list[dict[str, Any]]

    @property
    def names(self) -> set[str]:
        """The names the allowed tool references name (``{"type": "function",
        "function": {"name": ...}}``, or ``custom`` alike)."""
        found = set()
        for ref in self.tools:
            inner = ref.get(str(ref.get("type", "function")), {})
            if isinstance(inner, dict) and isinstance(inner.get("name"), str):
                found.add(inner["name"])
        return found


class AllowedToolsChoice(RequestModel):
    type: Literal["allowed_tools"]
    allowed_tools: AllowedTools


ToolChoice = Annotated[
    Annotated[Literal["none", "auto", "required"], STRING]
    | Annotated[
        Annotated[
            Annotated[NamedFunctionChoice, variant("type", "function")]
            | Annotated[NamedCustomChoice, variant("type", "custom")]
            | Annotated[AllowedToolsChoice, variant("type", "allowed_tools")],
            dispatch("type"),
        ],
        OBJECT,
    ],
    shape('"none", "auto", "required" or a tool choice object'),
]
