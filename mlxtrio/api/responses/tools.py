"""Tool definitions of the Responses API, as requests carry them (in
``tools``, and in ``additional_tools`` input items).

Tools of types this server cannot offer (``web_search``, ``tool_search``, ...)
are accepted and ignored: agent clients always send them.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from ..fields import RequestModel, dispatch, variant


class FunctionTool(RequestModel):
    type: Literal["function"]
    name: str
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class TextFormat(RequestModel):
    type: Literal["text"]


class GrammarFormat(RequestModel):
    type: Literal["grammar"]
    syntax: str
    definition: str


class CustomTool(RequestModel):
    """A freeform tool (Codex's ``apply_patch``): the model writes raw text."""

    type: Literal["custom"]
    name: str
    description: str | None = None
    format: (
        Annotated[
            Annotated[TextFormat, variant("type", "text")]
            | Annotated[GrammarFormat, variant("type", "grammar")],
            dispatch("type"),
        ]
        | None
    ) = None


class NamespaceTool(RequestModel):
    """A named group of tools (Codex's ``multi_agent_v1``)."""

    type: Literal["namespace"]
    name: str
    description: str | None = None
    tools: list[
        Annotated[
            Annotated[FunctionTool, variant("type", "function")]
            | Annotated[CustomTool, variant("type", "custom")],
            dispatch("type"),
        ]
    ]


class HostedTool(RequestModel):
    """Any other tool type: run by a hosted provider, ignored here."""

    type: str


_OFFERABLE = ("function", "custom", "namespace")
Tool = Annotated[
    Annotated[FunctionTool, variant("type", "function")]
    | Annotated[CustomTool, variant("type", "custom")]
    | Annotated[NamespaceTool, variant("type", "namespace")]
    | Annotated[HostedTool, variant("type", "hosted")],
    dispatch("type", known=_OFFERABLE, fallback="hosted"),
]
