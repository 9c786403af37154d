"""The internal conversation model every API maps into.

A :class:`Conversation` is what the chat template renders: a list of messages
(system, user, assistant with optional reasoning and tool calls, tool results)
plus the tools offered and the thinking switch.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Literal

from .images import ImageInput

Role = Literal["system", "user", "assistant", "tool"]

# What a model that reads text only sees of an image.
IMAGE_PLACEHOLDER = "[image omitted: this model reads text only]"


@dataclass
class ToolCall:
    id: str
    name: str
    arguments: dict[str, Any]  # parsed JSON object


@dataclass
class Message:
    role: Role
    content: str = ""
    reasoning: str = ""
    tool_calls: list[ToolCall] = field(default_factory=list)
    tool_call_id: str | None = None  # role == "tool"
    is_error: bool = False

    def to_json(self) -> dict[str, Any]:
        """A JSON-ready dict (for the response store); :meth:`from_json` inverts it."""
        return {
            "role": self.role,
            "content": self.content,
            "reasoning": self.reasoning,
            "tool_calls": [
                {"id": c.id, "name": c.name, "arguments": c.arguments} for c in self.tool_calls
            ],
            "tool_call_id": self.tool_call_id,
            "is_error": self.is_error,
        }

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> Message:
        return cls(
            role=data["role"],
            content=data.get("content", ""),
            reasoning=data.get("reasoning", ""),
            tool_calls=[
                ToolCall(c["id"], c["name"], c["arguments"]) for c in data.get("tool_calls", [])
            ],
            tool_call_id=data.get("tool_call_id"),
            is_error=bool(data.get("is_error")),
        )

    def template_dict(self) -> dict[str, Any]:
        """The shape the chat template reads."""
        out: dict[str, Any] = {"role": self.role, "content": self.content}
        if self.reasoning:
            # Qwen-style templates read reasoning_content; gpt-oss's, thinking.
            out["reasoning_content"] = out["thinking"] = self.reasoning
        if self.tool_calls:
            out["tool_calls"] = [
                {
                    "id": c.id,
                    "name": c.name,
                    "arguments": c.arguments,
                    "type": "function",
                    "function": {"name": c.name, "arguments": c.arguments},
                }
                for c in self.tool_calls
            ]
        if self.tool_call_id is not None:
            out["tool_call_id"] = self.tool_call_id
        return out


@dataclass
class ToolSpec:
    """A function tool as offered to the model (JSON Schema parameters)."""

    name: str
    description: str = ""
    parameters: dict[str, Any] = field(default_factory=lambda: {"type": "object", "properties": {}})
    # The arguments must match ``parameters`` exactly (every keyword enforced);
    # otherwise keywords the grammar engine does not implement are ignored.
    strict: bool = False
    # What the arguments are held to, when it differs from what the model is
    # shown (a custom tool's grammar, as a pattern on its ``input`` string).
    constraint_schema: dict[str, Any] | None = None

    @property
    def arguments_schema(self) -> dict[str, Any]:
        """The JSON Schema a call's arguments are constrained by."""
        return self.constraint_schema if self.constraint_schema is not None else self.parameters

    def template_dict(self) -> dict[str, Any]:
        return {
            "type": "function",
            "function": {
                "name": self.name,
                "description": self.description,
                "parameters": self.parameters,
            },
        }


@dataclass(frozen=True)
class ToolRequirement:
    """``tool_choice`` that obliges the model to call a tool: any offered one
    (``name is None``) or the named one."""

    name: str | None = None


@dataclass(frozen=True)
class OutputFormat:
    """Structured output: the answer is one JSON value matching ``schema`` (any
    JSON object when None); ``strict``: every keyword of the schema enforced,
    and one the grammar engine does not implement is refused."""

    schema: dict[str, Any] | None = None
    strict: bool = False
    param: str = "text.format"  # the request field it came from, for errors


@dataclass
class Conversation:
    messages: list[Message]
    tools: list[ToolSpec] = field(default_factory=list)
    thinking: bool = False
    required_tool: ToolRequirement | None = None
    output_format: OutputFormat | None = None
    # False: the tools are shown (the prompt stays the one earlier turns were
    # rendered with, for the prefix cache) but the model may not call them.
    calls_allowed: bool = True
    # How hard a model that takes an effort should reason (gpt-oss's Harmony
    # system message): "low", "medium" or "high"; None: the template's default.
    reasoning_effort: str | None = None
    # The images this request carries (each stands in its message's text as
    # its image_marker); checked before anything else is done.
    images: list[ImageInput] = field(default_factory=list)


EFFORTS = ("low", "medium", "high")


def effort_level(effort: str | None) -> str | None:
    """An API's effort name as the levels templates know: ``minimal`` and
    ``none`` are ``low``, ``xhigh`` is ``high``; anything else unknown is None."""
    if effort is None:
        return None
    return {"minimal": "low", "none": "low", "xhigh": "high"}.get(
        effort, effort if effort in EFFORTS else None
    )


def effort_for_budget(budget_tokens: int) -> str:
    """Anthropic's ``thinking.budget_tokens`` as an effort level."""
    return "low" if budget_tokens < 4096 else "medium" if budget_tokens < 16384 else "high"
