"""OpenAI Responses request body -> :class:`Conversation`.

Validation errors are :class:`~mlxtrio.http.errors.ApiError` 400s with
``param``, in the order of the reference spec (§3.4); messages say what to fix.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from ..http.errors import invalid_request
from .conversation import Conversation, Message, ToolCall, ToolRequirement, ToolSpec
from .fields import MAX_INT32, dict_field, is_int, list_field, number_in


@dataclass
class ResponsesRequest:
    """The validated fields of a ``POST /v1/responses`` body."""

    body: dict[str, Any]
    model: str
    stream: bool
    max_output_tokens: int | None
    temperature: float | None
    top_p: float | None
    instructions: str | None
    reasoning: dict[str, Any] | None
    tools: list[dict[str, Any]]
    tool_choice: Any
    previous_response_id: str | None = None
    store: bool = True
    include: tuple[str, ...] = ()
    retention_seconds: int | None = None

    @property
    def items(self) -> list[Any]:
        """``input`` as a list of items."""
        value = self.body["input"]
        if isinstance(value, str):
            return [{"type": "message", "role": "user", "content": value}]
        return list(value)

    @property
    def custom_tool_names(self) -> set[str]:
        return {
            t["name"]
            for t in self.tools
            if t.get("type") == "custom" and isinstance(t.get("name"), str)
        }

    @property
    def wants_sealed_reasoning(self) -> bool:
        return "reasoning.encrypted_content" in self.include

    @property
    def thinking(self) -> bool:
        # Any reasoning object turns thinking on (Codex sends {"summary": "auto"}
        # alone, meaning the default effort); "none"/"minimal" turn it off.
        effort = (self.reasoning or {}).get("effort")
        return self.reasoning is not None and effort not in ("none", "minimal")


def parse_request(body: Any) -> ResponsesRequest:
    if not isinstance(body, dict):
        raise invalid_request("Request body must be a JSON object", "body")
    model = body.get("model")
    if not model or not isinstance(model, str):
        raise invalid_request("Missing required field: model", "model")
    if body.get("input") is None:
        raise invalid_request("Missing required field: input", "input")
    if not isinstance(body["input"], str | list):
        raise invalid_request('Field "input" must be a string or an array', "input")
    max_out = body.get("max_output_tokens")
    if max_out is not None and not (is_int(max_out) and 1 <= max_out <= MAX_INT32):
        raise invalid_request(
            f'Field "max_output_tokens" must be an integer between 1 and {MAX_INT32}',
            "max_output_tokens",
        )
    metadata = body.get("metadata")
    if isinstance(metadata, dict) and metadata.get("retention_seconds") is not None:
        value = metadata["retention_seconds"]
        if not (is_int(value) and 60 <= value <= 7776000):
            raise invalid_request(
                "metadata.retention_seconds must be an integer in [60, 7776000]",
                "metadata.retention_seconds",
            )
    tools = body.get("tools") or []
    if not isinstance(tools, list):
        raise invalid_request('Field "tools" must be an array', "tools")
    _check_text_format(body.get("text"))
    instructions = body.get("instructions")
    reasoning = body.get("reasoning")
    include = list_field(body, "include")
    previous = body.get("previous_response_id")
    retention = metadata.get("retention_seconds") if isinstance(metadata, dict) else None
    return ResponsesRequest(
        body=body,
        model=model,
        stream=body.get("stream") is True,
        max_output_tokens=int(max_out) if max_out is not None else None,
        temperature=number_in(body, "temperature", 0, 2, "temperature"),
        top_p=number_in(body, "top_p", 0, 1, "top_p"),
        instructions=instructions if isinstance(instructions, str) else None,
        reasoning=reasoning if isinstance(reasoning, dict) else None,
        tools=[t for t in tools if isinstance(t, dict)],
        tool_choice=body.get("tool_choice"),
        previous_response_id=previous if isinstance(previous, str) and previous else None,
        store=body.get("store") is not False,
        include=tuple(i for i in include if isinstance(i, str)),
        retention_seconds=int(retention) if retention is not None else None,
    )


def _check_text_format(text: Any) -> None:
    if not isinstance(text, dict) or not isinstance(text.get("format"), dict):
        return
    kind = text["format"].get("type")
    if kind not in (None, "text"):
        raise invalid_request(
            f'text.format type "{kind}" (structured output) is not supported by this server yet; '
            'omit text.format or use {"type": "text"} and describe the wanted JSON in the prompt',
            "text.format",
        )


def required_tool(request: ResponsesRequest) -> ToolRequirement | None:
    """``tool_choice: "required"`` or a named function/custom tool."""
    choice = request.tool_choice
    if choice == "required":
        return ToolRequirement()
    if isinstance(choice, dict) and choice.get("type") in ("function", "custom"):
        name = choice.get("name")
        return ToolRequirement(name if isinstance(name, str) and name else None)
    return None


def offered_tools(request: ResponsesRequest) -> list[ToolSpec]:
    """Function tools the model is shown; tools the server cannot offer are skipped."""
    choice = request.tool_choice
    if choice == "none":
        return []
    specs: list[ToolSpec] = []
    for tool in request.tools:
        kind = tool.get("type")
        if kind == "function" and isinstance(tool.get("name"), str):
            specs.append(
                ToolSpec(
                    tool["name"],
                    tool.get("description") or "",
                    tool.get("parameters") or {"type": "object", "properties": {}},
                )
            )
        elif kind == "namespace":
            for inner in tool.get("tools") or []:
                if isinstance(inner, dict) and isinstance(inner.get("name"), str):
                    specs.append(
                        ToolSpec(
                            inner["name"],
                            inner.get("description") or "",
                            inner.get("parameters") or {"type": "object", "properties": {}},
                        )
                    )
        elif kind == "custom" and isinstance(tool.get("name"), str):
            specs.append(_custom_tool_spec(tool))
    if isinstance(choice, dict) and choice.get("type") in ("function", "custom"):
        specs = [s for s in specs if s.name == choice.get("name")]
    return specs


def _custom_tool_spec(tool: dict[str, Any]) -> ToolSpec:
    """A freeform tool (Codex's ``apply_patch``) offered as a function with one
    string argument, ``input``, that carries the raw text."""
    description = (tool.get("description") or "").strip()
    fmt = dict_field(tool, "format")
    if fmt.get("type") == "grammar" and isinstance(fmt.get("definition"), str):
        description += (
            f"\nThe input must follow this {fmt.get('syntax', '')} grammar:\n{fmt['definition']}"
        )
    description += '\nCall it with the raw text in the "input" argument.'
    return ToolSpec(
        tool["name"],
        description.strip(),
        {"type": "object", "properties": {"input": {"type": "string"}}, "required": ["input"]},
    )


def _text_of(content: Any, role: str) -> str:
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise invalid_request(
            f'Message content for role "{role}" must be a string or an array', "input"
        )
    parts = []
    for part in content:
        if not isinstance(part, dict):
            raise invalid_request("Each content part must be an object", "input")
        kind = part.get("type")
        if kind in ("input_text", "output_text", "summary_text", "text"):
            parts.append(str(part.get("text", "")))
        elif kind == "refusal":
            parts.append(str(part.get("refusal", "")))
        elif kind == "input_image":
            parts.append(_image_placeholder(part, role))
        else:
            raise invalid_request(f'Unsupported content part type: "{kind}"', "input")
    return "".join(parts)


IMAGE_PLACEHOLDER = "[image omitted: this model reads text only]"


def _image_placeholder(part: dict[str, Any], role: str) -> str:
    if role != "user":
        raise invalid_request(
            f'input_image content parts are only allowed on user messages (got role="{role}")',
            "input",
        )
    if part.get("file_id"):
        raise invalid_request(
            "input_image.file_id is not supported — inline the image as a data URL", "input"
        )
    url = part.get("image_url")
    if not isinstance(url, str) or not url:
        raise invalid_request("input_image is missing image_url", "input")
    if not (url.startswith("data:") and ";base64," in url):
        raise invalid_request(
            "input_image.image_url must be a base64 data URL (data:<mime>;base64,<payload>); remote http(s) "
            "URLs are not fetched by this server",
            "input",
        )
    return IMAGE_PLACEHOLDER


def _arguments(raw: Any) -> dict[str, Any]:
    if isinstance(raw, dict):
        return raw
    try:
        value = json.loads(raw) if isinstance(raw, str) and raw.strip() else {}
    except json.JSONDecodeError:
        return {"input": raw}
    return value if isinstance(value, dict) else {"input": value}


def to_conversation(request: ResponsesRequest) -> Conversation:
    """A stateless request's conversation: instructions, then the input items."""
    messages: list[Message] = []
    if request.instructions:
        messages.append(Message("system", request.instructions))
    messages.extend(map_items(request.items))
    return Conversation(messages, offered_tools(request), request.thinking, required_tool(request))


Reveal = Callable[[object], str | None]


def map_items(items: list[Any], reveal: Reveal | None = None) -> list[Message]:
    """Input items -> messages. Consecutive reasoning, assistant text and calls form
    one assistant turn; ``reveal`` reads back sealed reasoning blobs."""
    messages: list[Message] = []
    assistant: Message | None = None

    def flush() -> None:
        nonlocal assistant
        if assistant is not None:
            messages.append(assistant)
            assistant = None

    def current_assistant() -> Message:
        nonlocal assistant
        if assistant is None:
            assistant = Message("assistant")
        return assistant

    for item in items:
        if not isinstance(item, dict):
            raise invalid_request("Each input item must be a non-null object", "input")
        kind = item.get("type", "message")
        if kind == "message":
            role = item.get("role")
            if role not in ("user", "assistant", "system", "developer"):
                raise invalid_request(f'Unsupported message role: "{role}"', "input")
            text = _text_of(item.get("content", ""), role)
            if role == "assistant":
                turn = current_assistant()
                if turn.tool_calls:  # text after a call starts a new assistant turn
                    flush()
                    turn = current_assistant()
                turn.content += text
                continue
            flush()
            messages.append(Message("system" if role == "developer" else role, text))
        elif kind == "reasoning":
            summary = item.get("summary") or []
            text = "".join(p.get("text", "") for p in summary if isinstance(p, dict))
            if not text and reveal is not None:
                text = reveal(item.get("encrypted_content")) or ""
            current_assistant().reasoning += text
        elif kind in ("function_call", "custom_tool_call"):
            raw = (
                item.get("arguments")
                if kind == "function_call"
                else {"input": item.get("input", "")}
            )
            call_id = item.get("call_id") or item.get("id") or ""
            current_assistant().tool_calls.append(
                ToolCall(str(call_id), str(item.get("name", "")), _arguments(raw))
            )
        elif kind in ("function_call_output", "custom_tool_call_output"):
            flush()
            call_id = item.get("call_id")
            if not isinstance(call_id, str) or not call_id:
                raise invalid_request("tool message missing tool_call_id", "input")
            output = item.get("output", "")
            if not isinstance(output, str):
                output = (
                    _text_of(output, "tool") if isinstance(output, list) else json.dumps(output)
                )
            messages.append(Message("tool", output, tool_call_id=call_id))
        elif kind in (
            "item_reference",
            "web_search_call",
            "tool_search_call",
            "tool_search_output",
        ):
            continue  # references and server-side tool records carry nothing to render
        else:
            raise invalid_request(f'Unsupported input item type: "{kind}"', "input")
    flush()
    return messages
