"""The wire APIs: one package per API, each with its routes, its wire models
(pydantic, with the official field ranges), its conversion into the internal
:class:`~mlxtrio.chat.conversation.Conversation`, and its event assembler with
its own stream ending.

* :mod:`.messages` - Anthropic Messages (``/v1/messages``), what Claude Code speaks;
* :mod:`.responses` - OpenAI Responses (``/v1/responses``, SSE and WebSocket),
  what Codex speaks, with the response store, background mode and compaction;
* :mod:`.chat_completions` - OpenAI Chat Completions (``/v1/chat/completions``);
* :mod:`.models` and :mod:`.health` - the model list and the server's state.

A route parses its body (:mod:`.validation`), converts it, and hands it to
:func:`mlxtrio.serving.pipeline.prepare`; nothing here touches the engine
directly. Errors are :class:`~mlxtrio.http.errors.ApiError`, rendered in the
envelope of the API the path belongs to.
"""
