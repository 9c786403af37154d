"""A validated OpenAI Responses request -> messages and offered tools.

The request model has checked every shape; what is left here is what this
server can and cannot map (images it cannot see, tool results without a call),
raised as :class:`ConversationError` with ``param`` ``input``.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Callable
from typing import Any

from ... import jsontext
from ...chat.conversation import (
    Message,
    OutputFormat,
    ToolCall,
    ToolRequirement,
    ToolSpec,
)
from ...chat.errors import ConversationError
from ...chat.images import ImageInput, from_data_url, image_error, image_marker
from ...grammar.custom_tools import freeform_tool
from .items import (
    CompactionItem,
    ContentPart,
    CustomToolCallItem,
    FunctionCallItem,
    ImagePart,
    InputItem,
    MessageItem,
    ReasoningItem,
    RefusalPart,
    ToolOutputItem,
)
from .requests import (
    JsonObjectFormat,
    JsonSchemaFormat,
    NamedToolChoice,
    ResponsesRequest,
)
from .tools import CustomTool, FunctionTool, GrammarFormat, NamespaceTool

log = logging.getLogger("mlxtrio.chat")


Reveal = Callable[[str | None], str | None]

# Sealed compaction summaries start with this mark: reasoning blobs are sealed
# with the same key, and the mark keeps one from passing for the other.
COMPACTION_MARK = "mlxtrio-compaction\n"
# How the model sees a compaction item: a user message with this heading.
SUMMARY_HEADING = "Summary of the conversation so far (earlier turns were compacted into it):\n\n"


def compaction_payload(summary: str) -> str:
    """The text to seal as a compaction item's ``encrypted_content``."""
    return COMPACTION_MARK + summary


def is_compaction_summary(message: Message) -> bool:
    """Whether ``message`` is a compaction item as the model saw it (a later
    compaction replaces it rather than keeping it as a user message)."""
    return message.role == "user" and message.content.startswith(SUMMARY_HEADING)


def required_tool(request: ResponsesRequest) -> ToolRequirement | None:
    """``tool_choice: "required"`` or a named function/custom tool."""
    choice = request.tool_choice
    if choice == "required":
        return ToolRequirement()
    if isinstance(choice, NamedToolChoice):
        return ToolRequirement(choice.name or None)
    return None


def offered_tools(request: ResponsesRequest) -> list[ToolSpec]:
    """Function tools the model is shown; tools the server cannot offer are skipped."""
    choice = request.tool_choice
    if choice == "none":
        return []
    specs: list[ToolSpec] = []
    # Tools an additional_tools input item makes available from that point
    # on: chat templates list tools once, so they join the request's.
    for tool in [*request.tools, *request.added_tools]:
        members = tool.tools if isinstance(tool, NamespaceTool) else [tool]
        for member in members:
            if isinstance(member, FunctionTool):
                specs.append(_function_spec(member))
            elif isinstance(member, CustomTool):
                specs.append(custom_tool_spec(member))
    if isinstance(choice, NamedToolChoice):
        specs = [s for s in specs if s.name == choice.name]
    return specs


def _function_spec(tool: FunctionTool) -> ToolSpec:
    return ToolSpec(
        tool.name,
        tool.description or "",
        tool.parameters or {"type": "object", "properties": {}},
        strict=bool(tool.strict),
    )


def output_format(request: ResponsesRequest) -> OutputFormat | None:
    """``text.format`` ``json_schema`` or ``json_object`` (structured output)."""
    wanted = request.text.format if request.text is not None else None
    if isinstance(wanted, JsonSchemaFormat):
        return OutputFormat(wanted.schema_, strict=bool(wanted.strict))
    if isinstance(wanted, JsonObjectFormat):
        return OutputFormat(None)
    return None


def custom_tool_spec(tool: CustomTool) -> ToolSpec:
    """A freeform tool (Codex's ``apply_patch``): see :mod:`mlxtrio.grammar.custom_tools`."""
    grammar = tool.format if isinstance(tool.format, GrammarFormat) else None
    return freeform_tool(
        tool.name,
        tool.description,
        (grammar.syntax, grammar.definition) if grammar is not None else None,
    )


def _text_of(
    content: str | list[ContentPart], role: str, images: list[ImageInput], where: str
) -> str:
    if isinstance(content, str):
        return content
    parts = []
    for j, part in enumerate(content):
        if isinstance(part, ImagePart):
            image = _image(part, role, f"{where}.{j}")
            images.append(image)
            parts.append(image_marker(image))
        elif isinstance(part, RefusalPart):
            parts.append(part.refusal)
        else:
            parts.append(part.text)
    return "".join(parts)


def _image(part: ImagePart, role: str, param: str) -> ImageInput:
    """An ``input_image`` part, not yet decoded (``chat.images.check`` does)."""
    if role not in ("user", "tool"):
        raise image_error(
            "input_image content parts are only allowed in user messages and tool outputs "
            f'(got role="{role}")',
            param,
        )
    if part.file_id:
        raise image_error(
            "input_image.file_id is not supported: inline the image as a data URL", param
        )
    if not part.image_url:
        raise image_error("input_image is missing image_url", f"{param}.image_url")
    return from_data_url(part.image_url, f"{param}.image_url", part.detail)


def _arguments(raw: str | dict[str, Any]) -> dict[str, Any]:
    if isinstance(raw, dict):
        return raw
    try:
        value = jsontext.loads(raw) if raw.strip() else {}
    except ValueError:
        return {"input": raw}
    return value if isinstance(value, dict) else {"input": value}


def _tool_output(
    output: str | list[ContentPart] | dict[str, Any], images: list[ImageInput], where: str
) -> str:
    if isinstance(output, str):
        return output
    if isinstance(output, list):
        return _text_of(output, "tool", images, where)
    return json.dumps(output)


def _compaction_summary(item: CompactionItem, ordinal: int, reveal: Reveal | None) -> Message:
    """The summary a compaction item carries, as a user message. Unlike a
    reasoning blob (an optional hint), the summary *is* the earlier conversation:
    one that cannot be read is an error, never silently dropped context."""
    opened = reveal(item.encrypted_content) if reveal is not None else None
    if opened is None or not opened.startswith(COMPACTION_MARK):
        name = (
            f'"{item.id}"'
            if item.id
            else f"number {ordinal} (counting the input's compaction items)"
        )
        raise ConversationError(
            f"compaction item {name} cannot be read: its encrypted_content was not issued "
            "by this server (or by its current key), or it was altered. Send compaction "
            "items back exactly as /v1/responses/compact returned them, or compact the "
            "conversation again from its full history.",
            "input",
        )
    return Message("user", SUMMARY_HEADING + opened.removeprefix(COMPACTION_MARK))


def map_items(
    items: list[InputItem], reveal: Reveal | None = None, images: list[ImageInput] | None = None
) -> list[Message]:
    """Input items -> messages. Consecutive reasoning, assistant text and calls form
    one assistant turn; ``reveal`` reads back sealed reasoning blobs and
    compaction summaries; the images met are appended to ``images``."""
    images = [] if images is None else images
    messages: list[Message] = []
    assistant: Message | None = None
    compactions = 0

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

    for i, item in enumerate(items):
        if isinstance(item, MessageItem):
            text = _text_of(item.content, item.role, images, f"input.{i}.content")
            if item.role == "assistant":
                turn = current_assistant()
                if turn.tool_calls:  # text after a call starts a new assistant turn
                    flush()
                    turn = current_assistant()
                turn.content += text
                continue
            flush()
            messages.append(Message("system" if item.role == "developer" else item.role, text))
        elif isinstance(item, ReasoningItem):
            text = "".join(part.text for part in item.summary)
            if not text and reveal is not None:
                text = reveal(item.encrypted_content) or ""
            current_assistant().reasoning += text
        elif isinstance(item, FunctionCallItem):
            current_assistant().tool_calls.append(
                ToolCall(item.call_id or item.id or "", item.name, _arguments(item.arguments))
            )
        elif isinstance(item, CustomToolCallItem):
            current_assistant().tool_calls.append(
                ToolCall(item.call_id or item.id or "", item.name, {"input": item.input})
            )
        elif isinstance(item, ToolOutputItem):
            flush()
            output = _tool_output(item.output, images, f"input.{i}.output")
            if item.call_id is None:  # answers no call: context the client adds
                messages.append(Message("user", f"[{item.source}] {output}"))
            else:
                messages.append(Message("tool", output, tool_call_id=item.call_id))
        elif isinstance(item, CompactionItem):
            flush()
            compactions += 1
            messages.append(_compaction_summary(item, compactions, reveal))
        # Anything else is a reference or a server-side tool record: nothing to render.
    flush()
    return messages
