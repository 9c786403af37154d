"""Conversation -> prompt token ids, through the model's own chat template.

Rendering and tokenization are CPU work (Jinja plus a Rust tokenizer), so
:func:`render` runs them on a worker thread: the Trio loop
never blocks on a 20k-token agent prompt.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import Any

import trio

from ..engine.image_tokens import ImageTokenError, ImageTokenizer, VisionPrompt
from .conversation import IMAGE_PLACEHOLDER, Conversation, OutputFormat
from .images import IMAGE_MARKER, CheckedImage


@dataclass(frozen=True)
class RenderedPrompt:
    tokens: list[int]
    # True when the prompt ends inside an open reasoning block (the template
    # opened <think> for the model): generated text starts as reasoning.
    starts_in_reasoning: bool
    # Where the system prompt (and tools) end in ``tokens``, when asked for
    # and known: other conversations with the same system prompt go on there.
    system_end: int = 0
    # The images, for a model that sees them: ``tokens`` holds each one's run
    # as key tokens (see mlxtrio.engine.image_tokens).
    vision: VisionPrompt | None = None


MIN_SYSTEM_TOKENS = 256  # a system prompt shorter than this gets no boundary


class PromptError(ValueError):
    """The conversation cannot be rendered with this model's template."""


def render_sync(
    tokenizer: Any,
    conversation: Conversation,
    find_system_end: bool = False,
    images: ImageTokenizer | None = None,
    checked: list[CheckedImage] | None = None,
) -> RenderedPrompt:
    """See :func:`render`."""
    shown = {c.input.key: c for c in checked or ()} if images is not None else {}
    order: list[CheckedImage] = []  # the images as the messages hold them
    messages = [
        _show_images(m.template_dict(), shown, order, images.image_text if images else "")
        for m in conversation.messages
    ]
    if conversation.output_format is not None:
        messages = _asking_for(conversation.output_format, messages)
    tools = [t.template_dict() for t in conversation.tools] or None
    try:
        tokens = _rendered(
            tokenizer, messages, tools, True, conversation.thinking, conversation.reasoning_effort
        )
    except Exception as exc:  # Jinja raises many types; all mean "cannot render"
        raise PromptError(f"cannot render the conversation with the chat template: {exc}") from exc
    system_end = 0
    if find_system_end:
        system_end = _system_end(
            tokenizer, messages, tools, conversation.thinking, tokens, conversation.reasoning_effort
        )
    vision = None
    if order:
        assert images is not None
        try:
            pictures = [(c.open, c.digest, c.input.detail) for c in order]
            tokens, vision = images.splice(tokens, pictures)
        except ImageTokenError as exc:
            raise PromptError(f"cannot show the images to the model: {exc}") from exc
    return RenderedPrompt(tokens, ends_in_open_think(tokenizer, tokens), system_end, vision)


def _show_images(
    message: dict[str, Any],
    shown: dict[str, CheckedImage],
    order: list[CheckedImage],
    image_text: str,
) -> dict[str, Any]:
    """``message`` with each image marker written as the chat template writes
    an image (the processor widens each afterwards) when the model sees that
    image, else as IMAGE_PLACEHOLDER (a model that reads text, or an image of
    an earlier turn that this request does not carry); ``order`` collects
    the images in the order they stand."""
    content = message.get("content")
    if not isinstance(content, str) or "\ue000" not in content:
        return message

    def written(marker: re.Match[str]) -> str:
        image = shown.get(marker.group(1))
        if image is None or image in order:
            return IMAGE_PLACEHOLDER
        order.append(image)
        return image_text

    return {**message, "content": IMAGE_MARKER.sub(written, content)}


def _rendered(
    tokenizer: Any,
    messages: list[dict[str, Any]],
    tools: list[dict[str, Any]] | None,
    generation: bool,
    thinking: bool | None,
    effort: str | None = None,
) -> list[int]:
    extra = {"reasoning_effort": effort} if effort is not None else {}
    tokens = tokenizer.apply_chat_template(
        messages, tools=tools, add_generation_prompt=generation, enable_thinking=thinking, **extra
    )
    if isinstance(tokens, dict):  # some tokenizers return a BatchEncoding
        tokens = tokens["input_ids"]
    return list(tokens)


def _system_end(
    tokenizer: Any,
    messages: list[dict[str, Any]],
    tools: list[dict[str, Any]] | None,
    thinking: bool | None,
    tokens: list[int],
    effort: str | None = None,
) -> int:
    """Where the system prompt ends in ``tokens``: where they part from the
    system messages followed by an empty user message (mlx-lm's server finds
    it the same way); 0 when there is none or it cannot be told."""
    count = next((i for i, m in enumerate(messages) if m["role"] != "system"), len(messages))
    if count == 0 or count == len(messages):
        return 0
    try:
        bare = _rendered(
            tokenizer,
            [*messages[:count], {"role": "user", "content": ""}],
            tools,
            False,
            thinking,
            effort,
        )
    except Exception:  # a template that will not render that: no boundary
        return 0
    shared = min(len(bare), len(tokens))
    end = next((i for i in range(shared) if bare[i] != tokens[i]), shared)
    # A short one is not worth a snapshot of its own (templates that fold the
    # system prompt into the first user turn give a few tokens).
    return end if MIN_SYSTEM_TOKENS <= end < len(tokens) - 1 else 0


def _asking_for(output: OutputFormat, messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """``messages`` with the system message asking for the structured output:
    the grammar guarantees the form, but a model that knows the schema fills
    it with what it means to say instead of whatever fits."""
    if output.schema is None:
        wanted = "Answer with one JSON object and nothing else."
    else:
        schema = json.dumps(output.schema, ensure_ascii=False)
        wanted = (
            f"Answer with one JSON value that matches this JSON Schema, and nothing else: {schema}"
        )
    if messages and messages[0]["role"] == "system":
        first = dict(messages[0])
        first["content"] = (first["content"] + "\n\n" + wanted).strip()
        return [first, *messages[1:]]
    return [{"role": "system", "content": wanted}, *messages]


def ends_in_open_think(tokenizer: Any, tokens: list[int]) -> bool:
    if not getattr(tokenizer, "has_thinking", False):
        return False
    start = tokenizer.rfind_think_start(tokens)
    if start is None or start < 0:
        return False
    end = tokenizer.rfind_think_end(tokens)
    return end is None or end < start


async def render(
    tokenizer: Any,
    conversation: Conversation,
    find_system_end: bool = False,
    images: ImageTokenizer | None = None,
    checked: list[CheckedImage] | None = None,
) -> RenderedPrompt:
    """Render on a worker thread (``find_system_end``: also find where the
    system prompt ends, at the cost of a second, shorter render). ``images``:
    a model that sees images, and ``checked`` the conversation's, in order:
    each placeholder becomes the image's run of tokens (the processor resizes
    the image on this thread too). How many run at once is the caller's to
    bound (the server's render lane runs one). Cancellation waits for the
    render to finish (it is bounded by the prompt-size check before it)."""
    return await trio.to_thread.run_sync(
        render_sync, tokenizer, conversation, find_system_end, images, checked
    )
