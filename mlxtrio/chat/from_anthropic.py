"""Anthropic Messages request body -> :class:`Conversation`.

Validation follows the reference order (spec §2.2): body, model, messages,
max_tokens, message shapes, then the mapping itself; every error is a 400 with a
message a person can act on.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

from ..http.errors import invalid_request
from .conversation import Conversation, Message, ToolCall, ToolRequirement, ToolSpec
from .fields import MAX_INT32, is_int, number_in

BILLING_HEADER_PREFIX = "x-anthropic-billing-header"
IMAGE_PLACEHOLDER = "[image omitted: this model reads text only]"


@dataclass
class MessagesRequest:
    body: dict[str, Any]
    model: str
    stream: bool
    max_tokens: int | None
    temperature: float | None
    top_p: float | None
    top_k: int | None
    stop_sequences: list[str]
    thinking: bool
    thinking_budget: int | None
    conversation: Conversation = field(default_factory=lambda: Conversation([]))


def parse_request(body: Any, *, require_max_tokens: bool = True) -> MessagesRequest:
    if not isinstance(body, dict):
        raise invalid_request("Request body must be a JSON object")
    model = body.get("model")
    if not model or not isinstance(model, str):
        raise invalid_request("Missing required field: model")
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise invalid_request("Missing required field: messages (a non-empty array of messages)")
    max_tokens = body.get("max_tokens")
    if max_tokens is None:
        if require_max_tokens:
            raise invalid_request("Missing required field: max_tokens")
    elif not (is_int(max_tokens) and 1 <= max_tokens <= MAX_INT32):
        raise invalid_request(f'Field "max_tokens" must be an integer between 1 and {MAX_INT32}')
    if any(not isinstance(m, dict) for m in messages):
        raise invalid_request("Each message must be a non-null object")
    top_k = body.get("top_k")
    if top_k is not None and not (is_int(top_k) and top_k >= 0):
        raise invalid_request("top_k: must be a non-negative integer")
    thinking, budget = _thinking(body.get("thinking"))
    request = MessagesRequest(
        body=body,
        model=model,
        stream=body.get("stream") is True,
        max_tokens=int(max_tokens) if max_tokens is not None else None,
        temperature=number_in(body, "temperature", 0, 1),
        top_p=number_in(body, "top_p", 0, 1),
        top_k=int(top_k) if top_k is not None else None,
        stop_sequences=_stop_sequences(body.get("stop_sequences")),
        thinking=thinking,
        thinking_budget=budget,
    )
    request.conversation = to_conversation(body, thinking)
    return request


def _thinking(value: Any) -> tuple[bool, int | None]:
    if value is None:
        return False, None
    if not isinstance(value, dict):
        raise invalid_request(
            'thinking: must be an object like {"type": "enabled", "budget_tokens": 2048}'
        )
    kind = value.get("type")
    if kind == "disabled":
        return False, None
    if kind == "adaptive":
        return True, None
    if kind == "enabled":
        budget = value.get("budget_tokens")
        if budget is None:
            return True, None
        if not (is_int(budget) and budget >= 1):
            raise invalid_request("thinking.budget_tokens: must be a positive integer")
        return True, int(budget)
    raise invalid_request(
        f'thinking.type: expected "enabled", "adaptive" or "disabled", got {kind!r}'
    )


def _stop_sequences(value: Any) -> list[str]:
    if value is None:
        return []
    if not isinstance(value, list) or not all(isinstance(s, str) for s in value):
        raise invalid_request("stop_sequences: must be an array of strings")
    return [s for s in value if s.strip()]


def _system_text(system: Any) -> list[str]:
    if system is None:
        return []
    if isinstance(system, str):
        return [system]
    if not isinstance(system, list):
        raise invalid_request("system: must be a string or an array of text blocks")
    parts = []
    for block in system:
        if not isinstance(block, dict) or block.get("type") != "text":
            kind = block.get("type") if isinstance(block, dict) else type(block).__name__
            raise invalid_request(
                f'Unsupported system block type: "{kind}" (only text blocks are allowed)'
            )
        text = str(block.get("text", ""))
        # Claude Code's rotating attribution line changes every session; keeping it
        # would change the prompt prefix and defeat prefix caching.
        if not text.startswith(BILLING_HEADER_PREFIX):
            parts.append(text)
    return ["".join(parts)] if parts else []


def _block_text(content: Any, where: str) -> str:
    """Text of a string or of text/image blocks (tool results, system messages)."""
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise invalid_request(f"{where}: content must be a string or an array of blocks")
    parts = []
    for block in content:
        kind = block.get("type") if isinstance(block, dict) else None
        if kind == "text":
            parts.append(str(block.get("text", "")))
        elif kind == "image":
            parts.append(IMAGE_PLACEHOLDER)
        else:
            raise invalid_request(f'Unsupported content block type "{kind}" in {where}')
    return "".join(parts)


def _user_turn(content: Any, out: list[Message]) -> None:
    if isinstance(content, str):
        out.append(Message("user", content))
        return
    if not isinstance(content, list):
        raise invalid_request(
            "messages: user content must be a string or an array of content blocks"
        )
    texts: list[str] = []
    had_tool_result = False
    for block in content:
        kind = block.get("type") if isinstance(block, dict) else None
        if kind == "text":
            texts.append(str(block.get("text", "")))
        elif kind == "image":
            texts.append(IMAGE_PLACEHOLDER)
        elif kind == "tool_result":
            tool_use_id = block.get("tool_use_id")
            if not isinstance(tool_use_id, str) or not tool_use_id:
                raise invalid_request(
                    "tool_result.tool_use_id: required (the id of the tool_use it answers)"
                )
            text = _block_text(block.get("content"), "tool_result")
            is_error = block.get("is_error") is True
            if is_error:
                text = f"Error: {text}"
            out.append(Message("tool", text, tool_call_id=tool_use_id, is_error=is_error))
            had_tool_result = True
        elif kind == "document":
            raise invalid_request(
                'Unsupported content block type: "document" (send its text as a text block)'
            )
        else:
            raise invalid_request(f'Unsupported content block type: "{kind}"')
    # Tool results become tool messages; the turn's text (if any) follows them.
    if texts or not had_tool_result:
        out.append(Message("user", "".join(texts)))


def _assistant_turn(content: Any) -> Message:
    if isinstance(content, str):
        return Message("assistant", content)
    if not isinstance(content, list):
        raise invalid_request(
            "messages: assistant content must be a string or an array of content blocks"
        )
    message = Message("assistant")
    for block in content:
        kind = block.get("type") if isinstance(block, dict) else None
        if kind == "text":
            message.content += str(block.get("text", ""))
        elif kind == "thinking":
            message.reasoning += str(block.get("thinking", ""))
        elif kind == "redacted_thinking":
            continue  # encrypted by another provider: nothing this model can read
        elif kind == "tool_use":
            arguments = block.get("input", {})
            if not isinstance(arguments, dict):
                raise invalid_request("tool_use.input: must be an object")
            message.tool_calls.append(
                ToolCall(str(block.get("id") or ""), str(block.get("name", "")), arguments)
            )
        else:
            raise invalid_request(f'Unsupported assistant content block type: "{kind}"')
    return message


def _tools(body: dict[str, Any]) -> list[ToolSpec]:
    tools = body.get("tools") or []
    if not isinstance(tools, list):
        raise invalid_request("tools: must be an array")
    specs = []
    for tool in tools:
        if not isinstance(tool, dict) or not isinstance(tool.get("name"), str) or not tool["name"]:
            raise invalid_request("tools: every tool needs a name")
        if tool.get("type") not in (None, "custom") and "input_schema" not in tool:
            continue  # server tools (web_search, bash, ...) cannot run here
        schema = tool.get("input_schema") or {"type": "object", "properties": {}}
        if not isinstance(schema, dict):
            raise invalid_request(
                f"tools: input_schema of {tool['name']!r} must be a JSON Schema object"
            )
        specs.append(ToolSpec(tool["name"], str(tool.get("description") or ""), schema))
    choice = body.get("tool_choice")
    if isinstance(choice, dict):
        kind = choice.get("type")
        if kind == "none":
            return []
        if kind == "tool":
            name = choice.get("name")
            if not name:
                raise invalid_request('tool_choice.type is "tool" but no name was provided')
            chosen = [s for s in specs if s.name == name]
            if not chosen:
                raise invalid_request(
                    f'tool_choice references tool "{name}" which is not present in the request\'s tools list'
                )
            return chosen
    return specs


def _required_tool(body: dict[str, Any]) -> ToolRequirement | None:
    """``tool_choice`` ``any`` (some tool) or ``tool`` (that one); validated by _tools."""
    choice = body.get("tool_choice")
    if not isinstance(choice, dict):
        return None
    if choice.get("type") == "any":
        return ToolRequirement()
    if choice.get("type") == "tool":
        return ToolRequirement(str(choice["name"]))
    return None


def to_conversation(body: dict[str, Any], thinking: bool) -> Conversation:
    system_parts = _system_text(body.get("system"))
    messages: list[Message] = []
    for raw in body["messages"]:
        role, content = raw.get("role"), raw.get("content")
        if role == "user":
            _user_turn(content, messages)
        elif role == "assistant":
            messages.append(_assistant_turn(content))
        elif role == "system":
            # Not in the public API, but Claude Code's SessionStart hooks send it.
            text = _block_text(content, "system-role message")
            if text:
                system_parts.append(text)
        else:
            raise invalid_request(f'Unsupported message role: "{role}" (use "user" or "assistant")')
    if system_parts:
        messages.insert(0, Message("system", "\n\n".join(system_parts)))
    tools = _tools(body)
    return Conversation(messages, tools, thinking, _required_tool(body) if tools else None)


def tool_input_json(arguments: str) -> dict[str, Any]:
    value = json.loads(arguments)
    return value if isinstance(value, dict) else {"input": value}
