"""A Responses turn through the serving pipeline, whatever carries it: SSE
(``routes``), a WebSocket (``socket``) or a background job's event log
(``background``).

:func:`begin` builds the turn and prepares it; :class:`ResponseEvents` are
the API's :class:`~mlxtrio.serving.stream.TurnEvents`: the assembler's
events, with the turn committed to the store before its terminal event goes
out (write-ahead, then announce) and taken back when the call ends unless the
client saw that event.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import trio
from quart import Response

from ...chat.output import Segment
from ...chat.turn import TurnResult
from ...http.sse import Producer
from ...serving.call import services
from ...serving.pipeline import PreparedTurn, prepare
from ...serving.stream import Failure, FailureKind, event_stream
from .events import ENDING, Emit, ResponseAssembler
from .objects import ResponseObject, TextConfig
from .persist import persist, take_back_unless
from .requests import ResponsesRequest
from .tools import FunctionTool, Tool
from .turn import Recall, Turn, build_turn


@dataclass
class ResponseTurn:
    """A Responses turn ready to generate: its input, the prepared turn (its
    admission place and cache match held) and its Response object."""

    turn: Turn
    prepared: PreparedTurn
    response: ResponseObject


async def begin(
    request: ResponsesRequest, recall: Recall | None = None, *, warm_up: bool = False
) -> ResponseTurn:
    """Build the turn and prepare it within the current call (whose end
    releases the place and the pinned prefix). Raises
    :class:`~mlxtrio.http.errors.ApiError` for anything that is the request's
    fault."""
    turn = await build_turn(request, recall, allow_empty=warm_up)
    runs = not warm_up or turn.has_a_prompt_of_its_own
    prepared = await prepare(turn.turn_request(runs=runs))
    return ResponseTurn(turn, prepared, initial_response(turn, prepared))


class ResponseEvents:
    """The Responses API's events of one turn. With ``keep_unfinished``
    (background responses, which clients poll) a failed turn is stored too,
    and the store writes are shielded from the job's cancellation."""

    def __init__(
        self,
        run: ResponseTurn,
        emit: Emit | None,
        delivered: Callable[[], bool],
        *,
        keep_unfinished: bool = False,
    ) -> None:
        self.run = run
        self.assembler = make_assembler(run.turn, run.response, emit)
        self._delivered = delivered
        self._keep = keep_unfinished

    async def start(self) -> None:
        await self.assembler.start()

    async def admitted(self) -> None:
        await self.assembler.admitted()

    async def on_segment(self, segment: Segment) -> None:
        await self.assembler.on_segment(segment)

    async def finish(self, result: TurnResult) -> None:
        run, response = self.run, self.run.response
        await self.assembler.complete(result)
        # A background turn is stored whatever happens to its job now.
        with trio.CancelScope(shield=self._keep):
            stored = await persist(run.turn, response)
        if stored and not self._keep:
            take_back_unless(self._delivered, response.id)
        await self.assembler.announce()

    async def fail(self, failure: Failure) -> None:
        """End with ``response.failed`` (stored first when keeping unfinished turns)."""
        code = "server_shutting_down" if failure.kind is FailureKind.SHUTDOWN else "server_error"
        await self.assembler.mark_failed(failure.message, code)
        if self._keep:
            with trio.CancelScope(shield=True):
                await persist(self.run.turn, self.run.response)
        await self.assembler.announce()


def initial_response(turn: Turn, prepared: PreparedTurn) -> ResponseObject:
    """The Response object's echo of the request, with the sampling values used."""
    request, sampling = turn.request, prepared.sampling
    text = request.text
    tool_choice = request.tool_choice if request.tool_choice is not None else "auto"
    return ResponseObject(
        model=request.model,
        instructions=turn.instructions,
        previous_response_id=request.previous_response_id,
        max_output_tokens=request.max_output_tokens,
        temperature=sampling.temperature,
        top_p=sampling.top_p,
        presence_penalty=sampling.presence_penalty,
        frequency_penalty=sampling.frequency_penalty,
        top_logprobs=request.top_logprobs or 0,
        tools=[_echo_tool(t) for t in request.tools],
        tool_choice=tool_choice if isinstance(tool_choice, str) else tool_choice.wire(),
        parallel_tool_calls=request.parallel_tool_calls is not False,
        reasoning={
            "effort": None,
            "summary": None,
            **(request.reasoning.wire() if request.reasoning is not None else {}),
        },
        text=TextConfig(
            format=text.format.wire() if text and text.format else {"type": "text"},
            verbosity=text.verbosity if text and text.verbosity else "medium",
        ),
        store=request.store is not False and services().store is not None,
        background=request.background is True,
        metadata=request.metadata.wire() if request.metadata is not None else {},
        prompt_cache_key=request.prompt_cache_key,
        safety_identifier=request.safety_identifier,
        user=request.user,
    )


def _echo_tool(tool: Tool) -> dict[str, Any]:
    if isinstance(tool, FunctionTool):
        return {"strict": True, "description": None, "parameters": None, **tool.wire()}
    return tool.wire()


def make_assembler(
    turn: Turn, response: ResponseObject, emit: Emit | None = None
) -> ResponseAssembler:
    seal = services().sealer.seal if turn.request.wants_sealed_reasoning else None
    return ResponseAssembler(response, emit, custom_tools=turn.request.custom_tool_names, seal=seal)


def sse_response(produce: Producer, headers: dict[str, str]) -> tuple[Response, Any]:
    """A Responses event stream run by ``produce`` in the call's nursery."""
    return event_stream(produce, ENDING, headers)
