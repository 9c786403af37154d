"""``previous_response_id`` continuations: rebuild a stored chain into messages
and check what a continuation may add to it (the reference server's create
steps for continuations).

Outstanding tool calls are always computed on the *stored* history, never on what
the client sends, so a forged echo cannot rewrite the trailing turn.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import Any, Protocol

from ...chat.conversation import Message, ToolCall
from ...chat.errors import ConversationError
from .items import InputItem, ToolCallItem


class StoredTurn(Protocol):
    """One stored turn of a chain, as the store keeps it."""

    @property
    def input_messages(self) -> list[dict[str, Any]]:
        """What the turn added to the conversation (``Message.to_json`` dicts)."""
        ...

    @property
    def response(self) -> dict[str, Any]:
        """The turn's Response object, as sent to the client."""
        ...


def reconstruct(chain: Sequence[StoredTurn]) -> list[Message]:
    """Each record's input delta, then one assistant message from its output."""
    messages: list[Message] = []
    for record in chain:
        messages.extend(Message.from_json(m) for m in record.input_messages)
        assistant = assistant_from_output(record.response.get("output") or [])
        if assistant is not None:
            messages.append(assistant)
    return messages


def assistant_from_output(output: list[dict[str, Any]]) -> Message | None:
    if not output:
        return None
    message = Message("assistant")
    for item in output:
        kind = item.get("type")
        if kind == "message":
            message.content += "".join(
                p.get("text", "") for p in item.get("content", []) if p.get("type") == "output_text"
            )
        elif kind == "reasoning":
            message.reasoning += "".join(p.get("text", "") for p in item.get("summary", []))
        elif kind == "function_call":
            try:
                arguments = json.loads(item.get("arguments") or "{}")
            except json.JSONDecodeError:
                arguments = {}
            message.tool_calls.append(ToolCall(item["call_id"], item["name"], arguments))
        elif kind == "custom_tool_call":
            message.tool_calls.append(
                ToolCall(item["call_id"], item["name"], {"input": item.get("input", "")})
            )
    return message


def last_assistant_calls(prior: list[Message]) -> list[str] | None:
    for message in reversed(prior):
        if message.role == "assistant":
            ids = [c.id for c in message.tool_calls if c.id]
            return ids or None
    return None


def outstanding_calls(prior: list[Message]) -> list[str] | None:
    """Ids of the last assistant turn's calls that no later tool result answers."""
    for index in range(len(prior) - 1, -1, -1):
        if prior[index].role == "assistant":
            ids = [c.id for c in prior[index].tool_calls if c.id]
            answered = {m.tool_call_id for m in prior[index + 1 :] if m.role == "tool"}
            remaining = [i for i in ids if i not in answered]
            return remaining or None
    return None


def drop_echoed_calls(items: list[InputItem], prior: list[Message]) -> list[InputItem]:
    """Remove ``function_call`` items that repeat the stored trailing turn's calls;
    reject those that reference a call the stored turn never made."""
    known = set(last_assistant_calls(prior) or [])
    kept: list[InputItem] = []
    for item in items:
        if isinstance(item, ToolCallItem):
            call_id = item.call_id
            if call_id is None or call_id not in known:
                raise ConversationError(
                    f'echoed {item.type} item references an unknown call_id "{call_id or ""}" — the stored '
                    "trailing assistant turn is the authoritative copy, and any echoed call must reference one "
                    "of its outstanding tool calls. Drop the echoed item or resolve the continuation against the "
                    "correct previous_response_id.",
                    "input",
                )
            continue
        kept.append(item)
    return kept


def check_delta(delta: list[Message], outstanding: list[str] | None) -> list[Message]:
    """Validate the tool results a continuation submits; return the delta with its
    leading results in the stored call order."""
    results = [m for m in delta if m.role == "tool"]
    if outstanding is None:
        if results:
            raise ConversationError(
                "function_call_output submitted against a thread with no outstanding tool call. The prior "
                "assistant turn either never emitted a tool call or every sibling call has already been "
                "resolved, so there is nothing for this function_call_output to answer. Drop the "
                "function_call_output, or start a new chain without previous_response_id.",
                "input",
            )
        return delta
    lead = 0
    while lead < len(delta) and delta[lead].role == "tool":
        lead += 1
    if any(m.role == "tool" for m in delta[lead:]):
        raise ConversationError(
            "function_call_output items must appear as a contiguous prefix of the continuation before any "
            "user, assistant, or system message. Interleaving a non-tool message between sibling "
            "function_call_output items orphans the fan-out by weaving a new assistant turn between the tool "
            "results. Reorder the submission so every function_call_output precedes any subsequent message, "
            "or start a new chain without previous_response_id.",
            "input",
        )
    if lead == 0:
        n = len(outstanding)
        plural = "s" if n != 1 else ""
        raise ConversationError(
            f"Previous assistant turn has {n} unresolved tool call{plural} ({', '.join(outstanding)}); every "
            "outstanding function_call_output must be submitted before the thread can advance. A plain user "
            f"turn would orphan the unresolved call{plural}. Submit function_call_output items for every "
            "outstanding id, or start a new chain without previous_response_id.",
            "input",
        )
    seen: dict[str, Message] = {}
    for message in delta[:lead]:
        call_id = message.tool_call_id or ""
        if call_id in seen:
            raise ConversationError(
                f'Duplicate function_call_output call_id "{call_id}" — each outstanding tool call must be '
                "answered exactly once.",
                "input",
            )
        if call_id not in outstanding:
            raise ConversationError(
                f'Unexpected function_call_output call_id "{call_id}"; the outstanding multi-tool-call set is '
                f"{', '.join(outstanding)}. Submitting an unrelated or stale call_id would advance the chain "
                "past an unresolved turn.",
                "input",
            )
        seen[call_id] = message
    missing = [i for i in outstanding if i not in seen]
    if missing:
        raise ConversationError(
            f"Missing function_call_output items for outstanding tool calls: {', '.join(missing)}. Partial "
            "submissions would orphan the sibling tool calls and advance the chain past an unresolved turn. "
            "Resubmit with every sibling output, or start a new chain without previous_response_id.",
            "input",
        )
    return [seen[i] for i in outstanding] + delta[lead:]
