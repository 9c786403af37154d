"""A validated OpenAI Chat Completions request -> :class:`Conversation`.

The request model has checked every shape; what is left here is what this
server can and cannot map (audio and files it cannot read, a tool call whose
arguments are not a JSON object, a ``tool_choice`` naming no offered tool),
raised as :class:`ConversationError` naming the field at fault.

System and developer messages stay where they are (the chat template decides
what a late one means); images become a placeholder, as on the other routes.
"""

from __future__ import annotations

from ... import jsontext
from ...chat.conversation import (
    Conversation,
    Message,
    OutputFormat,
    ToolCall,
    ToolRequirement,
    ToolSpec,
    effort_level,
)
from ...chat.errors import ConversationError
from ...chat.images import ImageInput, from_data_url, image_error, image_marker
from ...chat.tool_order import CHAT, validate_tool_order
from ...grammar.custom_tools import freeform_tool
from .requests import (
    AssistantMessage,
    AudioPart,
    ChatCompletionRequest,
    FilePart,
    FunctionMessage,
    FunctionToolCall,
    ImagePart,
    JsonObjectFormat,
    JsonSchemaFormat,
    RefusalPart,
    SystemMessage,
    TextParts,
    ToolMessage,
    UserMessage,
)
from .tools import (
    AllowedToolsChoice,
    CustomTool,
    GrammarCustomFormat,
    NamedCustomChoice,
    NamedFunctionChoice,
)


def to_conversation(request: ChatCompletionRequest) -> Conversation:
    """The request's conversation, its tool results in call order. Raises
    :class:`ConversationError` (tool order included)."""
    images: list[ImageInput] = []
    messages = [_message(m, i, images) for i, m in enumerate(request.messages)]
    validate_tool_order(messages, CHAT)
    tools = _tools(request)
    required = _required_tool(request) if tools else None
    return Conversation(
        messages,
        tools,
        request.thinking,
        required,
        _output(request),
        reasoning_effort=effort_level(request.reasoning_effort),
        images=images,
    )


def custom_tool_names(request: ChatCompletionRequest) -> set[str]:
    """Freeform tools, whose calls come back as ``custom`` tool calls."""
    return {t.custom.name for t in request.tools if isinstance(t, CustomTool)}


def _message(message: object, index: int, images: list[ImageInput]) -> Message:
    where = f"messages.{index}"
    if isinstance(message, SystemMessage):
        return Message("system", _text(message.content))
    if isinstance(message, UserMessage):
        return Message("user", _user_text(message, where, images))
    if isinstance(message, AssistantMessage):
        return _assistant(message, where)
    if isinstance(message, ToolMessage):
        return Message("tool", _text(message.content), tool_call_id=message.tool_call_id)
    assert isinstance(message, FunctionMessage)
    raise ConversationError(
        'role "function" (the deprecated function calling) is not supported: send the '
        'result as a "tool" message with its tool_call_id',
        f"{where}.role",
    )


def _text(content: TextParts) -> str:
    return content if isinstance(content, str) else "".join(part.text for part in content)


def _user_text(message: UserMessage, where: str, images: list[ImageInput]) -> str:
    if isinstance(message.content, str):
        return message.content
    parts = []
    for i, part in enumerate(message.content):
        if isinstance(part, ImagePart):
            image = _image(part, f"{where}.content.{i}")
            images.append(image)
            parts.append(image_marker(image))
        elif isinstance(part, AudioPart | FilePart):
            raise ConversationError(
                f'content part type "{part.type}" is not supported: this model reads text '
                "(send the file's text as a text part)",
                f"{where}.content.{i}.type",
            )
        else:
            parts.append(part.text)
    return "".join(parts)


def _image(part: ImagePart, param: str) -> ImageInput:
    """An ``image_url`` part, not yet decoded (``chat.images.check`` does)."""
    url, detail = part.image_url.get("url"), part.image_url.get("detail")
    if not isinstance(url, str):
        raise image_error("image_url.url must be a string", f"{param}.image_url.url")
    return from_data_url(url, f"{param}.image_url.url", detail if isinstance(detail, str) else None)


def _assistant(message: AssistantMessage, where: str) -> Message:
    turn = Message("assistant", reasoning=message.reasoning_content or message.reasoning or "")
    content = message.content
    if isinstance(content, str):
        turn.content = content
    elif content is not None:
        turn.content = "".join(p.refusal if isinstance(p, RefusalPart) else p.text for p in content)
    for i, call in enumerate(message.tool_calls):
        if isinstance(call, FunctionToolCall):
            arguments = _arguments(call.function.arguments, f"{where}.tool_calls.{i}")
            turn.tool_calls.append(ToolCall(call.id, call.function.name, arguments))
        else:
            turn.tool_calls.append(
                ToolCall(call.id, call.custom.name, {"input": call.custom.input})
            )
    return turn


def _arguments(raw: str, where: str) -> dict[str, object]:
    """A call's arguments: a JSON object (empty text is no arguments)."""
    try:
        value = jsontext.loads(raw) if raw.strip() else {}
    except ValueError:
        value = None
    if not isinstance(value, dict):
        raise ConversationError(
            "a tool call's arguments must be a JSON object, serialized as a string",
            f"{where}.function.arguments",
        )
    return value


def _tools(request: ChatCompletionRequest) -> list[ToolSpec]:
    """The tools the model is shown (all of them, or those ``tool_choice`` allows)."""
    choice = request.tool_choice
    if choice == "none":
        return []
    specs = [_spec(tool) for tool in request.tools]
    allowed = _allowed_names(request)
    if allowed is None:
        return specs
    chosen = [s for s in specs if s.name in allowed]
    if not chosen:
        raise ConversationError(
            f"tool_choice names {', '.join(sorted(allowed))}, not among the request's tools",
            "tool_choice",
        )
    return chosen


def _spec(tool: object) -> ToolSpec:
    if isinstance(tool, CustomTool):
        custom = tool.custom
        grammar = None
        if isinstance(custom.format, GrammarCustomFormat):
            spec = custom.format.grammar
            grammar = (spec.syntax, spec.definition)
        return freeform_tool(custom.name, custom.description, grammar)
    function = tool.function  # type: ignore[attr-defined]
    return ToolSpec(
        function.name,
        function.description or "",
        function.parameters or {"type": "object", "properties": {}},
        strict=bool(function.strict),
    )


def _allowed_names(request: ChatCompletionRequest) -> set[str] | None:
    choice = request.tool_choice
    if isinstance(choice, NamedFunctionChoice):
        return {choice.function.name}
    if isinstance(choice, NamedCustomChoice):
        return {choice.custom.name}
    if isinstance(choice, AllowedToolsChoice):
        return choice.allowed_tools.names
    return None


def _required_tool(request: ChatCompletionRequest) -> ToolRequirement | None:
    """``required``, a named tool, or ``allowed_tools`` in ``required`` mode."""
    choice = request.tool_choice
    if choice == "required":
        return ToolRequirement()
    if isinstance(choice, NamedFunctionChoice):
        return ToolRequirement(choice.function.name)
    if isinstance(choice, NamedCustomChoice):
        return ToolRequirement(choice.custom.name)
    if isinstance(choice, AllowedToolsChoice) and choice.allowed_tools.mode == "required":
        return ToolRequirement()
    return None


def _output(request: ChatCompletionRequest) -> OutputFormat | None:
    wanted = request.response_format
    if isinstance(wanted, JsonSchemaFormat):
        spec = wanted.json_schema
        return OutputFormat(spec.schema_, strict=bool(spec.strict), param="response_format")
    if isinstance(wanted, JsonObjectFormat):
        return OutputFormat(None, param="response_format")
    return None
