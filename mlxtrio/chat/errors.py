"""Errors of the conversation layer, free of HTTP: ``api/`` reports them as 400s."""

from __future__ import annotations


class ConversationError(ValueError):
    """A request that is well-formed but cannot be turned into a conversation
    (a block this server cannot read, a tool choice naming no offered tool, a
    continuation that does not fit its stored chain). ``param`` is the request
    field at fault, when there is one."""

    def __init__(self, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.param = param
