"""Every tool-call family mlx-lm parses, end to end: a scripted model per family
(``tests/scripted_families.py``) served by the real server, driven over real
sockets with the official ``anthropic`` and ``openai`` SDKs, on ``/v1/messages``,
``/v1/responses`` and ``/v1/chat/completions``, streaming and not.

Also: tool choices that require a call force the family's own opening, and the
tool-call marker is masked when no tool is offered."""

from __future__ import annotations

import json
import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import anthropic
import mlx.core as mx
import openai
import pytest
import trio

from mlxtrio.chat.conversation import (
    Conversation,
    Message,
    OutputFormat,
    ToolRequirement,
    ToolSpec,
)
from mlxtrio.engine.model import LoadedModel, load_model
from mlxtrio.engine.processors.openings import OpeningConstraint, TokenTexts
from mlxtrio.engine.types import GrammarConstraint, TextConstraint
from mlxtrio.grammar.calls import CALL_GRAMMARS
from mlxtrio.grammar.compiler import GrammarCompiler
from mlxtrio.grammar.planning import ConstraintError, OutputFacts, forbid, plan_output
from mlxtrio.grammar.shapes import CALL_SHAPES, call_shape, tool_family

from .conftest import SCRIPTED, Server, ServerFactory
from .scripted_families import CALLS, FAMILIES, TEXT
from .scripted_model import EXPECTED_TEXT

PLAIN = EXPECTED_TEXT["<|s_plain|>"]
PARAMETERS = {
    "get_weather": {"type": "object", "properties": {"city": {"type": "string"}}},
    "get_time": {"type": "object", "properties": {"zone": {"type": "string"}}},
}
ANTHROPIC_TOOLS = [{"name": n, "input_schema": p} for n, p in PARAMETERS.items()]
OPENAI_TOOLS = [{"type": "function", "name": n, "parameters": p} for n, p in PARAMETERS.items()]
CHAT_TOOLS = [
    {"type": "function", "function": {"name": n, "parameters": p}} for n, p in PARAMETERS.items()
]
# Families whose start marker cannot be masked (see maskable_marker_token).
UNMASKABLE = {"kimi_k3"}


@dataclass
class Turn:
    """One assistant turn as a client sees it."""

    text: str
    calls: list[tuple[str, dict[str, Any]]]
    finish: str | None
    streamed_text: str = ""  # the text deltas, joined (streaming only)


async def family_server(
    server_factory: ServerFactory, family_model: Callable[[str], str], name: str
) -> Server:
    server: Server = await server_factory(model=family_model(name), model_name=SCRIPTED)
    return server


async def messages_turn(server: Server, stream: bool, content: str, **extra: Any) -> Turn:
    """A ``/v1/messages`` turn through the ``anthropic`` SDK."""
    request: dict[str, Any] = {
        "model": SCRIPTED,
        "max_tokens": 64,
        "messages": [{"role": "user", "content": content}],
        **extra,
    }
    async with anthropic.AsyncAnthropic(
        base_url=server.url, api_key="unused", max_retries=0
    ) as client:
        if not stream:
            return _message_turn(await client.messages.create(**request))
        deltas = []
        async with client.messages.stream(**request) as events:
            async for event in events:
                if event.type == "content_block_delta" and event.delta.type == "text_delta":
                    deltas.append(event.delta.text)
            final = await events.get_final_message()
    return _message_turn(final, "".join(deltas))


def _message_turn(message: Any, streamed: str = "") -> Turn:
    text = "".join(b.text for b in message.content if b.type == "text")
    calls = [(b.name, b.input) for b in message.content if b.type == "tool_use"]
    return Turn(text, calls, message.stop_reason, streamed)


async def responses_turn(server: Server, stream: bool, content: str, **extra: Any) -> Turn:
    """A ``/v1/responses`` turn through the ``openai`` SDK."""
    request: dict[str, Any] = {"model": SCRIPTED, "input": content, **extra}
    async with openai.AsyncOpenAI(
        base_url=server.url + "/v1", api_key="unused", max_retries=0
    ) as client:
        if not stream:
            return _response_turn(await client.responses.create(**request))
        deltas = []
        async with client.responses.stream(**request) as events:
            async for event in events:
                if event.type == "response.output_text.delta":
                    deltas.append(event.delta)
            final = await events.get_final_response()
    return _response_turn(final, "".join(deltas))


def _response_turn(response: Any, streamed: str = "") -> Turn:
    calls = [
        (item.name, json.loads(item.arguments))
        for item in response.output
        if item.type == "function_call"
    ]
    return Turn(response.output_text, calls, response.status, streamed)


async def chat_turn(server: Server, stream: bool, content: str, **extra: Any) -> Turn:
    """A ``/v1/chat/completions`` turn through the ``openai`` SDK (streamed:
    the chunks' deltas put together as a client does)."""
    request: dict[str, Any] = {
        "model": SCRIPTED,
        "messages": [{"role": "user", "content": content}],
        **extra,
    }
    async with openai.AsyncOpenAI(
        base_url=server.url + "/v1", api_key="unused", max_retries=0
    ) as client:
        if not stream:
            completion = await client.chat.completions.create(**request)
            (choice,) = completion.choices
            calls = [
                (call.function.name, json.loads(call.function.arguments))
                for call in choice.message.tool_calls or []
                if call.type == "function"
            ]
            return Turn(choice.message.content or "", calls, choice.finish_reason)
        deltas: list[str] = []
        parts: dict[int, list[str]] = {}  # call index -> [name, arguments]
        finish = None
        chunks = await client.chat.completions.create(**request, stream=True)
        async for chunk in chunks:
            for streamed in chunk.choices:
                deltas.append(streamed.delta.content or "")
                for call in streamed.delta.tool_calls or []:
                    part = parts.setdefault(call.index, ["", ""])
                    if call.function is not None:
                        part[0] += call.function.name or ""
                        part[1] += call.function.arguments or ""
                finish = streamed.finish_reason or finish
    text = "".join(deltas)
    calls = [(name, json.loads(arguments)) for name, arguments in (parts[i] for i in sorted(parts))]
    return Turn(text, calls, finish, text)


async def every_api(server: Server, content: str, **extra: Any) -> dict[str, Turn]:
    """The same turn on every API, streaming and not. ``extra`` holds
    per-API request fields: ``messages={...}``, ``responses={...}``,
    ``chat={...}``."""
    turns = {}
    for stream in (False, True):
        kind = "stream" if stream else "create"
        turns[f"messages-{kind}"] = await messages_turn(
            server, stream, content, **extra.get("messages", {})
        )
        turns[f"responses-{kind}"] = await responses_turn(
            server, stream, content, **extra.get("responses", {})
        )
        turns[f"chat-{kind}"] = await chat_turn(server, stream, content, **extra.get("chat", {}))
    return turns


def check(turns: dict[str, Turn], text: str, calls: list[tuple[str, Any]]) -> None:
    """Every turn shows exactly ``text`` (streamed as it is, so no markup ever
    went out) and ``calls``, and ends as such a turn ends."""
    for how, turn in turns.items():
        assert (turn.text, turn.calls) == (text, calls), how
        if how.endswith("stream"):
            assert turn.streamed_text == text, how
        if how.startswith("messages"):
            assert turn.finish == ("tool_use" if calls else "end_turn"), how
        elif how.startswith("chat"):
            assert turn.finish == ("tool_calls" if calls else "stop"), how
        else:
            assert turn.finish == "completed", how


@pytest.mark.parametrize("family", sorted(FAMILIES))
async def test_two_calls_in_one_turn(
    family: str, server_factory: ServerFactory, family_model: Callable[[str], str]
) -> None:
    server = await family_server(server_factory, family_model, family)
    tools = {
        "messages": {"tools": ANTHROPIC_TOOLS},
        "responses": {"tools": OPENAI_TOOLS},
        "chat": {"tools": CHAT_TOOLS},
    }
    check(await every_api(server, "Weather and time?", **tools), TEXT, CALLS)


@pytest.mark.parametrize("family", sorted(FAMILIES))
async def test_required_tool_choice_opens_a_call(
    family: str, server_factory: ServerFactory, family_model: Callable[[str], str]
) -> None:
    """On a ``TEXT`` prompt the model answers in text; a tool choice that
    requires a call forces the family's opening, and the script then makes
    its calls."""
    server = await family_server(server_factory, family_model, family)
    free = await responses_turn(server, False, "TEXT please", tools=OPENAI_TOOLS)
    assert (free.text, free.calls) == (PLAIN, [])
    forced = {
        "messages": await messages_turn(
            server, False, "TEXT please", tools=ANTHROPIC_TOOLS, tool_choice={"type": "any"}
        ),
        "responses": await responses_turn(
            server, True, "TEXT please", tools=OPENAI_TOOLS, tool_choice="required"
        ),
        "chat-create": await chat_turn(
            server, False, "TEXT please", tools=CHAT_TOOLS, tool_choice="required"
        ),
        "chat-stream": await chat_turn(
            server, True, "TEXT please", tools=CHAT_TOOLS, tool_choice="required"
        ),
    }
    for turn in forced.values():
        assert (turn.text, turn.calls) == ("", CALLS)


@pytest.mark.parametrize("family", sorted(set(FAMILIES) - UNMASKABLE))
async def test_marker_is_masked_without_tools(
    family: str, server_factory: ServerFactory, family_model: Callable[[str], str]
) -> None:
    """A ``STRAY`` prompt draws the model to a tool call when no tool is
    offered (or ``tool_choice`` is none): with the marker masked it answers
    with its second choice."""
    server = await family_server(server_factory, family_model, family)
    turns = {
        "messages-create": await messages_turn(server, False, "STRAY"),
        "responses-create": await responses_turn(
            server, False, "STRAY", tools=OPENAI_TOOLS, tool_choice="none"
        ),
        "chat-create": await chat_turn(server, False, "STRAY"),
        "chat-stream": await chat_turn(server, True, "STRAY", tools=CHAT_TOOLS, tool_choice="none"),
    }
    check(turns, PLAIN, [])


async def test_hermes_model_without_tools_answers_instead_of_calling(scripted: Server) -> None:
    """The issue's case: the embedded template's ``<tool_call>`` with no tool
    offered gave an empty answer (messages) or ran to the output cap
    (responses). The scripted Hermes model's ``STRAY`` prompt opens the
    ``<|s_tool|>`` call unless ``<tool_call>`` is masked."""
    check(await every_api(scripted, "STRAY"), PLAIN, [])
    none = {
        "messages": {"tools": ANTHROPIC_TOOLS, "tool_choice": {"type": "none"}},
        "responses": {"tools": OPENAI_TOOLS, "tool_choice": "none"},
        "chat": {"tools": CHAT_TOOLS, "tool_choice": "none"},
    }
    check(await every_api(scripted, "STRAY", **none), PLAIN, [])


# -- the constraints each family's model gets, without a server ----------------


@pytest.fixture(scope="module")
def loaded_family(family_model: Callable[[str], str]) -> Callable[[str], LoadedModel]:
    loaded: dict[str, LoadedModel] = {}

    def get(name: str) -> LoadedModel:
        if name not in loaded:
            loaded[name] = load_model(name, family_model(name), "auto")
        return loaded[name]

    return get


def constraints_for(
    loaded: LoadedModel,
    tools: bool,
    required: str | None = None,
    grammars: bool = True,
    output: OutputFormat | None = None,
) -> tuple:
    """The server's tool-call constraints for a model loaded here (``grammars``
    False: as for a tokenizer the grammar engine cannot read)."""
    grammar_tokenizer = loaded.grammar_tokenizer if grammars else None
    compiler = GrammarCompiler(grammar_tokenizer) if grammar_tokenizer is not None else None
    facts = OutputFacts.of(SCRIPTED, loaded, compiler)
    conversation = Conversation(
        [Message("user", "hi")],
        [ToolSpec(name, "", p) for name, p in PARAMETERS.items()] if tools else [],
        # Reasoning on: the reasoning opener is not masked, and what is planned
        # is the tool calls' (and the format's) constraints alone.
        thinking=True,
        required_tool=ToolRequirement(required) if required else None,
        output_format=output,
    )
    return trio.run(plan_output, facts, conversation, False).constraints


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_family_openings_match_its_markup(
    family: str, loaded_family: Callable[[str], LoadedModel]
) -> None:
    """What a required call is forced to begin with is how the family's markup
    begins (the parser reads the scripted markup): a named tool's opening,
    where the family has a known shape, else the start marker alone. After
    every single-token marker, calls must open naming an offered tool."""
    loaded = loaded_family(family)
    start = loaded.tokenizer.tool_call_start
    markup = start + FAMILIES[family].call
    shape = call_shape(loaded.tokenizer.tool_parser)
    assert (shape is None) == (family in {"kimi_k3", "muse_spark"})
    *each_call, required = constraints_for(loaded, True, "get_weather")
    # The grammar holds the whole call after the marker (laguna's parser is glm47's).
    if tool_family(loaded.tokenizer.tool_parser) in CALL_GRAMMARS:
        assert required.openings == (start,)
        assert [type(c) for c in each_call] == [GrammarConstraint]
        assert each_call[0].after == loaded.tool_call_token
        return
    required = required.openings
    each_call = [c.openings for c in each_call]
    if shape is None:
        assert required == (start,)
    else:
        assert any(markup.startswith(opening) for opening in required)
        assert all(opening.startswith(start) and opening != start for opening in required)
    if shape is None or loaded.tool_call_token is None:
        assert each_call == []
    else:
        (openings,) = each_call
        assert any(markup.startswith(start + opening) for opening in openings)
        assert not any("get_weather" in o for o in shape.openings(["get_time"]))


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_marker_mask_per_family(family: str, loaded_family: Callable[[str], LoadedModel]) -> None:
    """No tools: the start marker's token is forbidden, unless it is shared with
    the family's other markup (Kimi K3's ``<|open|>``)."""
    loaded = loaded_family(family)
    marker = loaded.tokenizer.tool_call_start_tokens[0]
    expected = () if family in UNMASKABLE else (forbid(marker),)
    assert constraints_for(loaded, tools=False) == expected


def test_without_the_grammar_engine_calls_keep_their_openings(
    loaded_family: Callable[[str], LoadedModel],
) -> None:
    """A model whose tokenizer llguidance cannot read (a slow tokenizer) still
    serves tools: its calls are held to their openings, as before grammars."""
    loaded = loaded_family("json_tools")
    each_call, required = constraints_for(loaded, True, "get_weather", grammars=False)
    assert isinstance(each_call, TextConstraint) and each_call.after == loaded.tool_call_token
    assert required.openings == (
        "<tool_call>" + CALL_SHAPES["json_tools"].openings(["get_weather"])[0],
    )
    with pytest.raises(ConstraintError, match="cannot be constrained") as refused:
        constraints_for(loaded, False, grammars=False, output=OutputFormat({"type": "object"}))
    assert refused.value.param == "text.format"


def test_every_constrained_family_is_scripted() -> None:
    assert set(CALL_SHAPES) <= set(FAMILIES)


def test_a_forbidden_token_is_masked_at_every_step() -> None:
    """The no-tools constraint as the engine builds it: the marker's logit is
    -inf at every step, the others untouched, whatever was generated."""
    constraint = forbid(2)
    vocab = TokenTexts(["", "a", "<call>", "b"])
    process = OpeningConstraint(constraint.openings, constraint.after, vocab, constraint.repeat)
    for step in range(3):  # the context: a prompt token, then what was generated
        out = process(mx.array([0] + [3] * step), mx.array([[0.0, 1.0, 5.0, 2.0]]))
        assert out.tolist() == [[0.0, 1.0, -math.inf, 2.0]]
