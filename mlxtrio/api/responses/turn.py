"""A Responses request as a turn: its ``previous_response_id`` chain read and
checked, its input items mapped and validated onto it (the reference
server's create steps; see ``chain``), nothing asked of a model yet.

What :func:`build_turn` refuses is the request's fault: a 400 for input that
does not fit its chain, a 404 for a previous response that does not exist (or
is another client's), a 503 when the store cannot be read.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol

from ...chat.conversation import Conversation, Message, effort_level
from ...chat.images import ImageInput
from ...chat.tool_order import OPENAI, validate_tool_order
from ...http.errors import ApiError, invalid_request
from ...http.transport import client_domain
from ...serving.call import services
from ...serving.pipeline import TurnRequest
from ...store import StoredResponse, StoreError
from ..validation import conversation_errors
from .chain import check_delta, drop_echoed_calls, outstanding_calls, reconstruct
from .convert import map_items, offered_tools, output_format, required_tool
from .requests import ResponsesRequest
from .storage import open_store, store_failure


@dataclass
class Turn:
    """A validated request and the conversation it makes: everything a turn
    needs to generate and be stored."""

    request: ResponsesRequest
    conversation: Conversation
    delta: list[Message]  # what this turn adds to the stored chain
    instructions: str | None  # effective (inherited on continuations)
    owner: str  # the client's domain: who may read and continue it
    chain: list[StoredResponse] = field(default_factory=list)  # the turns it continues

    @property
    def has_a_prompt_of_its_own(self) -> bool:
        """False for a turn with no messages, no instructions and no stored
        chain (Codex's first warm-up: tools only): chat templates put the
        system and developer messages ahead of the tools, so the next turn's
        prompt parts from its prompt within a few tokens."""
        return bool(self.delta or self.instructions or self.request.previous_response_id)

    def turn_request(self, *, runs: bool = True) -> TurnRequest:
        """What the serving pipeline is asked to generate; ``runs=False``: the
        turn will be answered without running (see :class:`TurnRequest`)."""
        request = self.request
        return TurnRequest(
            request.model,
            self.conversation,
            request.sampling(),
            max_tokens=request.max_output_tokens,
            cache_domain=cache_domain(request),
            continuation=request.previous_response_id is not None,
            session=request.prompt_cache_key,
            runs=runs,
        )


class Recall(Protocol):
    """Where a transport keeps responses it can continue without the store
    (a WebSocket connection's last response): the chain ending at an id, or None."""

    def __call__(self, response_id: str) -> list[StoredResponse] | None: ...


def cache_domain(request: ResponsesRequest) -> str:
    """``cache_salt`` isolates cached prefixes: requests share KV only within a salt."""
    return "" if request.cache_salt is None else "salt:" + request.cache_salt


async def build_turn(
    request: ResponsesRequest, recall: Recall | None = None, *, allow_empty: bool = False
) -> Turn:
    """Read the chain and map and validate the input onto it. ``recall`` is
    asked for the previous response before the store is. An empty
    conversation is refused unless ``allow_empty`` (a warm-up: its tools and
    instructions are worth prefilling on their own)."""
    prior: list[Message] = []
    instructions = request.instructions
    items = request.items
    # A continuation must answer its parent's calls; a parent without output
    # (a warm-up) has none, and what follows it is checked as a history is.
    continuation = False
    chain: list[StoredResponse] = []
    if request.previous_response_id is not None:
        chain = await _chain_ending_at(request.previous_response_id, recall)
        prior = reconstruct(chain)
        continuation = bool(chain[-1].response.get("output"))
        if request.instructions is None:
            instructions = chain[-1].instructions
    with conversation_errors():
        if continuation:
            items = drop_echoed_calls(items, prior)
        images: list[ImageInput] = []
        delta = map_items(items, services().sealer.open, images)
        if continuation:
            delta = check_delta(delta, outstanding_calls(prior))
        head = [Message("system", instructions)] if instructions else []
        messages = head + prior + delta
        validate_tool_order(messages, OPENAI)  # reorders results in place
        tools = offered_tools(request)
    delta = messages[len(head) + len(prior) :]  # after canonical reordering
    if not messages:
        if not allow_empty:
            raise invalid_request(
                "input is empty and there are no instructions: nothing to respond to", "input"
            )
        # Templates render no empty conversation: the warm-up renders its tools
        # ahead of an empty user turn, and only what precedes that turn is
        # shared with what follows. It is not part of the turn (``delta``).
        messages = [Message("user", "")]
    conversation = Conversation(
        messages,
        tools,
        request.thinking,
        required_tool(request),
        output_format(request),
        reasoning_effort=effort_level(request.reasoning.effort if request.reasoning else None),
        images=images,
    )
    return Turn(request, conversation, delta, instructions, client_domain(), chain)


async def _chain_ending_at(response_id: str, recall: Recall | None) -> list[StoredResponse]:
    """The chain to continue; a 400 if its last response has not finished
    (a background response still running) or did not succeed."""
    chain = recall(response_id) if recall is not None else None
    if chain is None:
        if recall is not None and not services().store_configured:
            raise previous_not_found(response_id)
        chain = await _load_chain(response_id)
    status = chain[-1].response.get("status")
    if status not in ("completed", "incomplete"):
        still = status in ("queued", "in_progress")
        raise invalid_request(
            f'previous response "{response_id}" '
            + (
                "has not finished yet: wait for it"
                if still
                else f"ended {status}: it cannot be continued"
            ),
            "previous_response_id",
        )
    return chain


def previous_not_found(response_id: str) -> ApiError:
    return ApiError(
        404,
        f'Previous response "{response_id}" not found or expired',
        "not_found_error",
        param="previous_response_id",
        code="previous_response_not_found",
    )


async def _load_chain(response_id: str) -> list[StoredResponse]:
    store = open_store(
        f"cannot continue from response {response_id!r}",
        invalid_request(
            "previous_response_id requires a response store to be configured",
            "previous_response_id",
        ),
    )
    try:
        chain = await store.chain(response_id)
    except StoreError as exc:
        raise store_failure(exc, f"cannot read previous response {response_id!r}") from None
    if not chain or chain[-1].owner != client_domain():  # another key's: as if absent
        raise previous_not_found(response_id)
    return chain
