"""``POST /v1/responses/input_tokens`` and ``POST /v1/responses/compact``.

Both take a Responses request body and resolve it exactly as ``POST
/v1/responses`` does (:func:`.turn.build_turn`, then the serving pipeline:
the ``previous_response_id`` chain read from the store, input items,
instructions, tools, tool order, the model), so what they count or summarize
is the conversation a
create call with the same body would see. Their errors are create's: 400 for a
malformed body or a context overflow, 404 for an unknown model or previous
response, 429 when the waiting room is full.

* ``input_tokens`` renders the prompt with the chat template, as generation
  does, and counts it: exact, no engine work, no admission slot, nothing stored.
* ``compact`` runs the model (admitted like any generation) over the
  conversation plus a checkpoint instruction, and returns the conversation's
  user messages followed by one ``compaction`` item whose ``encrypted_content``
  is the summary, sealed with the installation's key (the reasoning key of
  :mod:`mlxtrio.chat.sealing`). A later request sends those items back as its
  input; the summary is shown to the model as a user message. A compaction is
  not a turn of a stored chain: it is never stored (as with OpenAI, its id
  cannot be retrieved or continued from), and a client goes on statelessly,
  with the compacted items as input.

These routes are registered before the responses blueprint: Werkzeug already
ranks the static ``/v1/responses/compact`` above ``/v1/responses/<response_id>``
whatever the order, and the order states the intent.
"""

from __future__ import annotations

import time
from dataclasses import replace
from typing import Any

from quart import Blueprint, Response, jsonify

from ...chat.conversation import Conversation, Message
from ...chat.output import Segment
from ...chat.turn import TurnResult
from ...http.errors import ApiError, invalid_request
from ...http.transport import read_json_body
from ...serving.call import services
from ...serving.pipeline import CacheLookup, prepare, render_for_model
from ..validation import parse
from .convert import compaction_payload, is_compaction_summary
from .events import usage_of
from .objects import new_id
from .requests import ResponsesRequest
from .turn import Turn, build_turn

blueprint = Blueprint("responses_compact", __name__)

# The checkpoint instruction, appended to the conversation as a user message (the
# conversation itself stays as it was rendered, so its prefix can be reused from
# the prefix cache).
SUMMARY_INSTRUCTION = (
    "Context checkpoint. The conversation above is about to be replaced by the summary "
    "you write now. Whoever continues will see the user's messages and your summary, but "
    "not the assistant replies, tool calls or tool results above. Write the summary as "
    "plain text: the task and the user's goals, constraints and preferences; what has "
    "been done and decided so far, with the facts it depends on (names, file paths, "
    "commands, values, results, errors); and what remains to be done next. Be concise "
    "and specific. Do not call tools and do not go on with the task: only summarize."
)
# A summary shorter than this is not worth writing: a conversation that leaves
# less room in the context is refused as too long.
MIN_SUMMARY_TOKENS = 256
# The summary's output cap when the request sets none: a summary is not an
# essay, and a model that rambles must not hold a slot for minutes.
SUMMARY_MAX_TOKENS = 1024


@blueprint.route("/v1/responses/input_tokens", methods=["POST"])
async def count_input_tokens() -> Response:
    """The prompt tokens a create call with the same body would take, counted on
    the same rendering. ``model`` may be left out (the schema makes it optional):
    the server's default model counts then."""
    default_model = services().models.default_name
    body = _fill_optional(await read_json_body(), default_model)
    request = parse(ResponsesRequest, body)
    turn = await build_turn(request)
    _, prompt = await render_for_model(request.model, turn.conversation)
    return jsonify({"object": "response.input_tokens", "input_tokens": len(prompt.tokens)})


@blueprint.route("/v1/responses/compact", methods=["POST"])
async def compact_conversation() -> Response:
    """Summarize the conversation into a sealed ``compaction`` item.

    A conversation that does not fit the context with the checkpoint
    instruction and room for a summary (``MIN_SUMMARY_TOKENS``) is refused
    with create's ``context_length_exceeded`` 400, rather than trimmed here:
    what may be dropped is the client's call, and agent clients already answer
    that error by dropping their oldest items and compacting again."""
    request = parse(ResponsesRequest, _fill_optional(await read_json_body()))
    if not request.items and request.previous_response_id is None:
        raise invalid_request(
            "input is empty and there is no previous_response_id: nothing to compact", "input"
        )
    turn = await build_turn(request)
    result, cache = await _summarize(turn)
    sealed = services().sealer.seal(compaction_payload(_summary_text(result)))
    out = jsonify(compaction_resource(turn.conversation, sealed, result))
    out.headers.update(cache.headers())
    return out


def _fill_optional(body: Any, default_model: str | None = None) -> Any:
    """Both bodies let ``input`` be absent or null (a ``previous_response_id``
    alone is a conversation); the token count's ``model`` too."""
    if not isinstance(body, dict):
        return body  # parse() reports it
    filled = dict(body)
    if filled.get("input") is None:
        filled["input"] = []
    if default_model is not None and filled.get("model") is None:
        filled["model"] = default_model
    return filled


def summarization(conversation: Conversation) -> Conversation:
    """The conversation with the checkpoint instruction as a last user message.
    Tools stay shown (the rendered prefix stays the one the conversation's
    turns were generated from, so it is likely still in the prefix cache) but
    may not be called: a summary has no use for a call, and a model drawn to
    one writes text instead. Reasoning is off: the summary is the answer."""
    messages = [*conversation.messages, Message("user", SUMMARY_INSTRUCTION)]
    return Conversation(messages, conversation.tools, thinking=False, calls_allowed=False)


async def _summarize(turn: Turn) -> tuple[TurnResult, CacheLookup]:
    """Generate the summary, admitted like any generation (a full waiting room
    is a 429; a client that hangs up while queued or generating stops it).
    A conversation that leaves less than :data:`MIN_SUMMARY_TOKENS` of the
    context is refused with create's ``context_length_exceeded``."""
    request = replace(
        turn.turn_request(),
        conversation=summarization(turn.conversation),
        min_output_tokens=MIN_SUMMARY_TOKENS,
        default_max_tokens=SUMMARY_MAX_TOKENS,
    )
    prepared = await prepare(request)
    result = await prepared.complete(_ignore)
    return result, prepared.cache


async def _ignore(segment: Segment) -> None:
    """The summary is read from the turn's result, not streamed."""


def _summary_text(result: TurnResult) -> str:
    """The visible text (the reasoning when that is all there is). A model that
    wrote nothing would leave the conversation with no summary: an error, not a
    silently emptied context."""
    summary = result.text.strip() or result.reasoning.strip()
    if summary:
        return summary
    raise ApiError(
        500,
        "the model wrote no summary (its output ended at once or began with a tool call); "
        "retry without tools offered, or with fewer input items",
        "server_error",
        code="empty_summary",
    )


def compaction_resource(
    conversation: Conversation, sealed: str, result: TurnResult
) -> dict[str, Any]:
    """The ``response.compaction`` object: the conversation's user messages
    (earlier summaries are replaced, not kept), then the compaction item."""
    kept = [
        _user_item(m)
        for m in conversation.messages
        if m.role == "user" and not is_compaction_summary(m)
    ]
    return {
        "id": new_id("resp"),
        "object": "response.compaction",
        "created_at": int(time.time()),
        "output": [
            *kept,
            {"id": new_id("cmp"), "type": "compaction", "encrypted_content": sealed},
        ],
        "usage": usage_of(result).model_dump(mode="json"),
    }


def _user_item(message: Message) -> dict[str, Any]:
    """A user message as an input message item, as the model saw it (an image
    is its text placeholder)."""
    return {
        "id": new_id("msg"),
        "type": "message",
        "status": "completed",
        "role": "user",
        "content": [{"type": "input_text", "text": message.content}],
    }
