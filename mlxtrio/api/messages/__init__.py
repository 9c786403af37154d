"""The Anthropic Messages API: ``POST /v1/messages`` and ``/v1/messages/count_tokens``.

``requests`` (wire models) -> ``convert`` (to a Conversation) -> ``routes``
(the pipeline) -> ``events`` (content blocks and the stream); ``objects`` are
the message and its blocks as sent.
"""

from .routes import blueprint

__all__ = ["blueprint"]
