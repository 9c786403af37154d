"""Conversations, whatever API they came from: the internal
:class:`~.conversation.Conversation`, prompt rendering through the model's chat
template (:mod:`.prompt`), tool-call order (:mod:`.tool_order`), stop sequences
(:mod:`.stops`), the output parser (:mod:`.output`: text, reasoning, tool
calls) and the turn runner (:mod:`.turn`). Knows nothing about HTTP."""
