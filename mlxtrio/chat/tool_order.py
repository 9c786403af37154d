"""Tool-order validation, shared by every API.

A history is valid when every assistant turn with tool calls (a *fan-out*) is
followed immediately by one tool result per declared call, and no tool result
stands anywhere else. Results that arrive in another order are rewritten into the
declared order: chat templates pair results with calls by position, not by id.

Messages use the vocabulary of the API that received the request.
"""

from __future__ import annotations

from dataclasses import dataclass

from .conversation import Message
from .errors import ConversationError


@dataclass(frozen=True)
class Vocabulary:
    result: str  # "tool_result" / "function_call_output"
    id: str  # "tool_use_id" / "call_id"
    fanout: str  # "assistant turn with tool_use blocks" / "assistant fan-out"
    param: str | None = None  # the request field the history is in, for errors


ANTHROPIC = Vocabulary("tool_result", "tool_use_id", "assistant turn with tool_use blocks")
OPENAI = Vocabulary("function_call_output", "call_id", "assistant fan-out", "input")
CHAT = Vocabulary("tool message", "tool_call_id", "assistant message with tool_calls", "messages")


class ToolOrderError(ConversationError):
    """The history's tool calls and results do not pair up."""


def validate_tool_order(messages: list[Message], vocab: Vocabulary) -> None:
    """Check and canonicalise ``messages`` in place; raise :class:`ToolOrderError`
    (its ``param`` the vocabulary's)."""
    try:
        _canonicalise(messages, vocab)
    except ToolOrderError as exc:
        exc.param = vocab.param
        raise


def _canonicalise(messages: list[Message], vocab: Vocabulary) -> None:
    i = 0
    while i < len(messages):
        message = messages[i]
        if message.role == "tool":
            raise ToolOrderError(
                f'tool message at index {i} ({vocab.id} "{message.tool_call_id}") is not preceded by '
                f"an {vocab.fanout}. Every {vocab.result} must immediately follow the assistant turn "
                f"whose tool calls include its {vocab.id}."
            )
        if message.role != "assistant" or not message.tool_calls:
            i += 1
            continue
        declared = _declared_ids(message, i, vocab)
        j = i + 1
        seen: dict[str, Message] = {}
        while j < len(messages) and messages[j].role == "tool":
            result = messages[j]
            call_id = result.tool_call_id or ""
            if not call_id:
                raise ToolOrderError(
                    f"tool message at index {j} is missing {vocab.id}. Every {vocab.result} in an "
                    f"{vocab.fanout}'s resolution block must carry the {vocab.id} it resolves."
                )
            if call_id not in declared:
                raise ToolOrderError(
                    f'tool message at index {j} references {vocab.id} "{call_id}", which is not declared '
                    f"by the preceding {vocab.fanout} at index {i}. Submitting a {vocab.result} for an "
                    "undeclared id would silently bind output to the wrong sibling."
                )
            if call_id in seen:
                raise ToolOrderError(
                    f'duplicate tool message for {vocab.id} "{call_id}" inside the {vocab.fanout}\'s '
                    f"resolution block (index {j}). Each outstanding sibling must be resolved exactly once."
                )
            seen[call_id] = result
            j += 1
        if not seen:
            n = len(declared)
            if j >= len(messages):
                raise ToolOrderError(
                    f"{vocab.fanout} at index {i} is the trailing turn of the history but has no "
                    f"{vocab.result} resolutions. Send a {vocab.result} for each of its {n} tool "
                    f"call{'s' if n != 1 else ''} ({', '.join(declared)})."
                )
            raise ToolOrderError(
                f"{vocab.fanout} at index {i} declares {n} tool call{'s' if n != 1 else ''} but the next "
                f"message at index {j} is a {messages[j].role} turn. Every fan-out must be fully "
                f"resolved by {vocab.result} messages before the next assistant/user/system turn."
            )
        missing = [d for d in declared if d not in seen]
        if missing:
            raise ToolOrderError(
                f"{vocab.fanout} at index {i} has unresolved sibling tool calls: {', '.join(missing)}. "
                f"Every declared tool call must be answered by a {vocab.result} before the next turn."
            )
        messages[i + 1 : j] = [seen[d] for d in declared]
        i = j


def _declared_ids(message: Message, index: int, vocab: Vocabulary) -> list[str]:
    declared: list[str] = []
    for call in message.tool_calls:
        if not call.id:
            raise ToolOrderError(
                f"{vocab.fanout} at index {index} declares a tool call with no id, which cannot be "
                f"paired with its {vocab.result} positionally."
            )
        if call.id in declared:
            raise ToolOrderError(
                f'{vocab.fanout} at index {index} declares duplicate {vocab.id} "{call.id}". Each '
                f"sibling call must have a unique {vocab.id}."
            )
        declared.append(call.id)
    return declared
