"""Wire schemas of the Anthropic Messages API (what goes out on ``/v1/messages``)."""

from __future__ import annotations

import hashlib
import hmac
import secrets
import uuid
from typing import Any, Literal

from pydantic import BaseModel, Field

# Thinking signatures are opaque to clients; ours authenticate the text with a key
# that lives as long as the process (clients send them back; we accept any).
_SIGNING_KEY = secrets.token_bytes(32)


def new_message_id() -> str:
    return f"msg_{uuid.uuid4().hex}"


def new_tool_use_id() -> str:
    return f"toolu_{uuid.uuid4().hex}"


def sign_thinking(text: str) -> str:
    return hmac.new(_SIGNING_KEY, text.encode(), hashlib.sha256).hexdigest()


class TextBlock(BaseModel):
    type: Literal["text"] = "text"
    text: str = ""


class ThinkingBlock(BaseModel):
    type: Literal["thinking"] = "thinking"
    thinking: str = ""
    signature: str = ""


class ToolUseBlock(BaseModel):
    type: Literal["tool_use"] = "tool_use"
    id: str = Field(default_factory=new_tool_use_id)
    name: str
    input: dict[str, Any] = Field(default_factory=dict)


ContentBlock = TextBlock | ThinkingBlock | ToolUseBlock


class MessagesUsage(BaseModel, extra="allow"):
    input_tokens: int = 0
    output_tokens: int = 0
    cache_creation_input_tokens: int = 0
    cache_read_input_tokens: int = 0


StopReason = Literal["end_turn", "max_tokens", "stop_sequence", "tool_use", "pause_turn", "refusal"]


class MessageObject(BaseModel):
    id: str = Field(default_factory=new_message_id)
    type: Literal["message"] = "message"
    role: Literal["assistant"] = "assistant"
    model: str
    content: list[ContentBlock] = Field(default_factory=list)
    stop_reason: StopReason | None = None
    stop_sequence: str | None = None
    usage: MessagesUsage = Field(default_factory=MessagesUsage)

    def wire(self) -> dict[str, Any]:
        return self.model_dump(mode="json")
