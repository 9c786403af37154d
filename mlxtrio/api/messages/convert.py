"""A validated Anthropic Messages request -> :class:`Conversation`.

The request model has checked every shape; what is left here is what this
server can and cannot map (documents, a ``tool_choice`` naming a tool that is not
offered), raised as :class:`ConversationError` with a message a person can act on.
"""

from __future__ import annotations

from ...chat.conversation import (
    Conversation,
    Message,
    OutputFormat,
    ToolCall,
    ToolRequirement,
    ToolSpec,
    effort_for_budget,
    effort_level,
)
from ...chat.errors import ConversationError
from ...chat.images import ImageInput, from_data_url, image_error, image_marker
from ...chat.tool_order import ANTHROPIC, validate_tool_order
from .requests import (
    AnyChoice,
    AssistantMessage,
    CountTokensRequest,
    DocumentBlock,
    ImageBlock,
    NamedChoice,
    NoneChoice,
    PlainContent,
    RedactedThinkingBlock,
    TextBlock,
    ThinkingBlock,
    ThinkingEnabled,
    ToolResultBlock,
    ToolUseBlock,
    UserMessage,
)

BILLING_HEADER_PREFIX = "x-anthropic-billing-header"


def to_conversation(request: CountTokensRequest) -> Conversation:
    """The request's conversation, its tool results in call order. Raises
    :class:`ConversationError` (tool order included)."""
    system_parts = _system_text(request)
    messages: list[Message] = []
    images: list[ImageInput] = []
    for i, message in enumerate(request.messages):
        if isinstance(message, UserMessage):
            _user_turn(message, messages, images, f"messages.{i}.content")
        elif isinstance(message, AssistantMessage):
            messages.append(_assistant_turn(message))
        else:
            # Not in the public API, but Claude Code's SessionStart hooks send it.
            text = _plain_text(message.content, images, f"messages.{i}.content")
            if text:
                system_parts.append(text)
    if system_parts:
        messages.insert(0, Message("system", "\n\n".join(system_parts)))
    validate_tool_order(messages, ANTHROPIC)
    tools = _tools(request)
    required = _required_tool(request) if tools else None
    return Conversation(
        messages,
        tools,
        request.thinking_enabled,
        required,
        _output(request),
        reasoning_effort=_effort(request),
        images=images,
    )


def _effort(request: CountTokensRequest) -> str | None:
    """``output_config.effort``, else ``thinking.budget_tokens`` as an effort
    level (for models that take one)."""
    config = request.output_config
    if config is not None and effort_level(config.effort) is not None:
        return effort_level(config.effort)
    thinking = request.thinking
    if isinstance(thinking, ThinkingEnabled) and thinking.budget_tokens is not None:
        return effort_for_budget(thinking.budget_tokens)
    return None


def _output(request: CountTokensRequest) -> OutputFormat | None:
    """Structured output; Anthropic's is always strict (its schema is compiled
    whole, and a feature it cannot hold to is refused)."""
    wanted = request.json_output
    if wanted is None:
        return None
    fmt, param = wanted
    return OutputFormat(fmt.schema_, strict=True, param=param)


def _system_text(request: CountTokensRequest) -> list[str]:
    system = request.system
    if system is None:
        return []
    if isinstance(system, str):
        return [system]
    # Claude Code's rotating attribution line changes every session; keeping it
    # would change the prompt prefix and defeat prefix caching.
    parts = [b.text for b in system if not b.text.startswith(BILLING_HEADER_PREFIX)]
    return ["".join(parts)] if parts else []


def _plain_text(content: PlainContent | None, images: list[ImageInput], where: str) -> str:
    """Text of tool results and system-role messages; an image stands as the
    placeholder in the text and is recorded in ``images``."""
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    texts = []
    for j, block in enumerate(content):
        if isinstance(block, TextBlock):
            texts.append(block.text)
        else:
            image = _image(block, f"{where}.{j}")
            images.append(image)
            texts.append(image_marker(image))
    return "".join(texts)


def _image(block: ImageBlock, param: str) -> ImageInput:
    """An image block's source, not yet decoded (``chat.images.check`` does)."""
    source = block.source
    kind = source.get("type")
    if kind == "base64":
        data, media_type = source.get("data"), source.get("media_type")
        if not isinstance(data, str) or not isinstance(media_type, str):
            raise image_error(
                "a base64 image source needs media_type and data (strings)", f"{param}.source"
            )
        return ImageInput("base64", data, param, media_type)
    if kind == "url" and isinstance(source.get("url"), str):
        return from_data_url(source["url"], param)
    if kind == "file":
        raise image_error(
            "image sources of type file (the Files API) are not supported: send the image "
            "as base64",
            f"{param}.source.type",
        )
    raise image_error(
        "an image source must be {type: base64, media_type, data} or {type: url, url}",
        f"{param}.source",
    )


def _user_turn(
    message: UserMessage, out: list[Message], images: list[ImageInput], where: str
) -> None:
    if isinstance(message.content, str):
        out.append(Message("user", message.content))
        return
    texts: list[str] = []
    had_tool_result = False
    for j, block in enumerate(message.content):
        if isinstance(block, TextBlock):
            texts.append(block.text)
        elif isinstance(block, ImageBlock):
            image = _image(block, f"{where}.{j}")
            images.append(image)
            texts.append(image_marker(image))
        elif isinstance(block, ToolResultBlock):
            text = _plain_text(block.content, images, f"{where}.{j}.content")
            is_error = block.is_error is True
            if is_error:
                text = f"Error: {text}"
            out.append(Message("tool", text, tool_call_id=block.tool_use_id, is_error=is_error))
            had_tool_result = True
        elif isinstance(block, DocumentBlock):
            raise ConversationError(
                'Unsupported content block type: "document" (send its text as a text block)'
            )
    # Tool results become tool messages; the turn's text (if any) follows them.
    if texts or not had_tool_result:
        out.append(Message("user", "".join(texts)))


def _assistant_turn(message: AssistantMessage) -> Message:
    if isinstance(message.content, str):
        return Message("assistant", message.content)
    turn = Message("assistant")
    for block in message.content:
        if isinstance(block, TextBlock):
            turn.content += block.text
        elif isinstance(block, ThinkingBlock):
            turn.reasoning += block.thinking
        elif isinstance(block, ToolUseBlock):
            turn.tool_calls.append(ToolCall(block.id, block.name, block.input))
        elif isinstance(block, RedactedThinkingBlock):
            continue  # encrypted by another provider: nothing this model can read
    return turn


def _tools(request: CountTokensRequest) -> list[ToolSpec]:
    """The client tools the model is shown (server tools cannot run here)."""
    choice = request.tool_choice
    if isinstance(choice, NoneChoice):
        return []
    specs = [
        ToolSpec(
            tool.name,
            tool.description or "",
            tool.input_schema or {"type": "object", "properties": {}},
            strict=bool(tool.strict),
        )
        for tool in request.tools
        if tool.runs_on_client
    ]
    if isinstance(choice, NamedChoice):
        chosen = [s for s in specs if s.name == choice.name]
        if not chosen:
            raise ConversationError(
                f'tool_choice references tool "{choice.name}" which is not present in the '
                "request's tools list",
                "tool_choice",
            )
        return chosen
    return specs


def _required_tool(request: CountTokensRequest) -> ToolRequirement | None:
    """``tool_choice`` ``any`` (some tool) or ``tool`` (that one)."""
    choice = request.tool_choice
    if isinstance(choice, AnyChoice):
        return ToolRequirement()
    if isinstance(choice, NamedChoice):
        return ToolRequirement(choice.name)
    return None
