"""The OpenAI Chat Completions API: ``POST /v1/chat/completions``.

``requests`` (wire models) -> ``convert`` (to a Conversation) -> ``routes``
(the pipeline) -> ``events`` (the completion object and stream chunks).
"""

from .routes import blueprint

__all__ = ["blueprint"]
