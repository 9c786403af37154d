"""Constrained decoding through the grammar engine (llguidance): tool calls
whose arguments match their schema, structured outputs, custom tools' Lark
grammars, and the 400s for what cannot be enforced.

End to end on the scripted Hermes model, whose greedy choice is exactly known:
on a ``PLAIN`` prompt it answers ``Hello world.`` and never wants to call a
tool, and where the grammar forbids the call it would write (``Paris``), every
token of the call is the grammar's doing. The schemas below have finite
languages, so whatever the model prefers among allowed tokens, the output ends.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any

import anthropic
import httpx
import jsonschema
import lark
import llguidance
import openai
import pytest

from mlxtrio.engine.model import load_model
from mlxtrio.grammar.build import ToolGrammar, closed
from mlxtrio.grammar.calls import CALL_GRAMMARS, CallVocabulary, call_grammar
from mlxtrio.grammar.lark_regex import GrammarNotRegular, lark_to_regex
from mlxtrio.settings import EMBEDDED_MODEL_PATH

from .conftest import SCRIPTED, Server, ServerFactory
from .scripted_families import TEXT as FAMILY_TEXT
from .test_tool_families import (
    Turn,
    chat_turn,
    every_api,
    family_server,
    messages_turn,
    responses_turn,
)

CITY = {
    "type": "object",
    "properties": {
        "city": {"enum": ["Oslo", "Bergen"]},
        "days": {"type": "integer", "minimum": 1, "maximum": 9},
    },
    "required": ["city", "days"],
}
TOOLS = {
    "messages": {"tools": [{"name": "get_weather", "input_schema": CITY}]},
    "responses": {"tools": [{"type": "function", "name": "get_weather", "parameters": CITY}]},
    "chat": {
        "tools": [{"type": "function", "function": {"name": "get_weather", "parameters": CITY}}]
    },
}
TIME = {"type": "object", "properties": {"zone": {"enum": ["UTC", "CET"]}}, "required": ["zone"]}
# What a turn that made its calls ends with, by API.
CALLED = {"messages": "tool_use", "responses": "completed", "chat": "tool_calls"}
GREETING = {
    "type": "object",
    "properties": {
        "greeting": {"enum": ["hello", "hi"]},
        "count": {"type": "integer", "minimum": 0, "maximum": 3},
    },
    "required": ["greeting", "count"],
    "additionalProperties": False,
}
# A finite Lark grammar for a custom tool (the model cannot run on forever).
ANSWER_GRAMMAR = 'start: "answer: " WORD "\\n"\nWORD: "yes" | "no" | "maybe"\n'


def _patch_grammar() -> str:
    """Codex's ``apply_patch`` grammar, as Codex sends it."""
    capture = EMBEDDED_MODEL_PATH.parents[3] / "shared/spec/captures/codex-patch.json"
    if capture.exists():
        found = _find_tool(json.loads(capture.read_text()), "apply_patch")
        if found is not None:
            return str(found["format"]["definition"])
    return PATCH_GRAMMAR


def _find_tool(node: Any, name: str) -> dict[str, Any] | None:
    if isinstance(node, dict):
        if node.get("name") == name and "format" in node:
            return node
        node = list(node.values())
    if isinstance(node, list):
        for child in node:
            found = _find_tool(child, name)
            if found is not None:
                return found
    return None


# A copy, for checkouts without the captures next to the project.
PATCH_GRAMMAR = (
    'start: begin_patch hunk+ end_patch\nbegin_patch: "*** Begin Patch" LF\n'
    'end_patch: "*** End Patch" LF?\n\nhunk: add_hunk | delete_hunk | update_hunk\n'
    'add_hunk: "*** Add File: " filename LF add_line+\ndelete_hunk: "*** Delete File: " '
    'filename LF\nupdate_hunk: "*** Update File: " filename LF change_move? change?\n\n'
    'filename: /(.+)/\nadd_line: "+" /(.*)/ LF -> line\n\nchange_move: "*** Move to: " '
    "filename LF\nchange: (change_context | change_line)+ eof_line?\n"
    'change_context: ("@@" | "@@ " /(.+)/) LF\nchange_line: ("+" | "-" | " ") /(.*)/ LF\n'
    'eof_line: "*** End of File" LF\n\n%import common.LF\n'
)
VALID_PATCHES = [
    "*** Begin Patch\n*** Add File: hello.txt\n+hello\n*** End Patch\n",
    "*** Begin Patch\n*** Update File: a.py\n@@ def f():\n-    return 1\n+    return 2\n"
    "*** End Patch",
    "*** Begin Patch\n*** Delete File: old.txt\n*** Add File: b\n+x\n+y\n*** End Patch\n",
]
INVALID_PATCHES = [
    "hello",
    "*** Begin Patch\n*** End Patch\n",  # no hunk
    "*** Begin Patch\n*** Add File: a\nhello\n*** End Patch\n",  # added line without +
]


# -- the grammar builders, against Lark itself and llguidance ---------------------


def test_lark_grammar_as_regex_accepts_what_the_grammar_does(embedded: Any) -> None:
    """The regex of apply_patch's grammar accepts exactly the patches the
    grammar engine's own reading of that grammar accepts (Python's Lark cannot
    read it: it refuses the zero-width ``/(.*)/``)."""
    import re

    grammar = _patch_grammar()
    regex = lark_to_regex(grammar)
    for patch, valid in [(p, True) for p in VALID_PATCHES] + [(p, False) for p in INVALID_PATCHES]:
        assert bool(re.fullmatch(regex, patch)) == valid, patch
        assert _grammar_accepts(embedded, grammar, patch) == valid, patch


def _grammar_accepts(embedded: Any, grammar: str, text: str) -> bool:
    tokenizer = embedded.grammar_tokenizer
    matcher = llguidance.LLMatcher(tokenizer, llguidance.LLMatcher.grammar_from_lark(grammar))
    assert not matcher.is_error(), matcher.get_error()
    tokens = tokenizer.tokenize_str(text)
    return matcher.try_consume_tokens(tokens) == len(tokens) and matcher.is_accepting()


def test_recursive_and_broken_grammars() -> None:
    with pytest.raises(GrammarNotRegular, match="recursive"):
        lark_to_regex('start: "(" start ")" | "x"')
    with pytest.raises(ValueError, match="Lark"):
        lark_to_regex("start: (((")


def test_closed_objects() -> None:
    schema = {
        "type": "object",
        "properties": {"a": {"type": "object", "properties": {"b": {}}}},
        "$defs": {"d": {"properties": {"e": {}}, "additionalProperties": True}},
        "items": [{"properties": {"f": {}}}],
    }
    out = closed(schema)
    assert out["additionalProperties"] is False
    assert out["properties"]["a"]["additionalProperties"] is False
    assert out["$defs"]["d"]["additionalProperties"] is True
    assert out["items"][0]["additionalProperties"] is False
    assert "additionalProperties" not in schema  # the client's copy is left alone
    # Properties composed with others stay open, on both sides.
    composed = {
        "properties": {"kind": {}},
        "anyOf": [{"properties": {"x": {}}, "required": ["x"]}],
        "allOf": [{"properties": {"y": {}}}],
    }
    out = closed(composed)
    assert "additionalProperties" not in out
    assert "additionalProperties" not in out["anyOf"][0]
    assert "additionalProperties" not in out["allOf"][0]
    # Alternatives on their own are whole objects: closed.
    either = closed({"anyOf": [{"properties": {"x": {}}}, {"type": "string"}]})
    assert either["anyOf"][0]["additionalProperties"] is False
    ref = closed({"properties": {"a": {}}, "$ref": "#/$defs/base"})
    assert "additionalProperties" not in ref


def test_lark_features_without_a_regular_form() -> None:
    with pytest.raises(GrammarNotRegular, match="ignore"):
        lark_to_regex('start: "a" "b"\n%ignore " "')
    with pytest.raises(GrammarNotRegular, match="import"):
        lark_to_regex("start: X\n%import mygrammar.X")
    # A terminal used twice keeps no group names (they would clash).
    twice = lark_to_regex("start: N N\nN: /(?P<d>[0-9])/")
    assert "?P<" not in twice
    import re

    assert re.fullmatch(twice, "12")


@pytest.fixture(scope="module")
def embedded() -> Any:
    return load_model("embedded", str(EMBEDDED_MODEL_PATH), "model")


def _body_matcher(embedded: Any, schema: dict[str, Any]) -> Any:
    vocab = CallVocabulary(embedded.tool_call_end_token)
    text = call_grammar("json_tools", [ToolGrammar("apply_patch", schema)], vocab)
    assert text is not None
    matcher = llguidance.LLMatcher(
        embedded.grammar_tokenizer, llguidance.LLMatcher.grammar_from_lark(text)
    )
    assert not matcher.is_error(), matcher.get_error()
    return matcher


def test_apply_patch_call_grammar_on_the_embedded_vocabulary(embedded: Any) -> None:
    """A call body of Codex's apply_patch: a valid patch goes through to the
    closing marker; one the grammar refuses is cut at the first bad token."""
    pattern = lark_to_regex(_patch_grammar())
    schema = {"type": "object", "properties": {"input": {"type": "string", "pattern": pattern}}}
    tokenizer = embedded.tokenizer
    for patch, valid in [(p, True) for p in VALID_PATCHES] + [(p, False) for p in INVALID_PATCHES]:
        body = '{"name": "apply_patch", "arguments": ' + json.dumps({"input": patch}) + "}"
        tokens = tokenizer.encode(body, add_special_tokens=False) + [embedded.tool_call_end_token]
        matcher = _body_matcher(embedded, schema)
        taken = matcher.try_consume_tokens(tokens)
        assert (taken == len(tokens)) == valid, patch
        assert matcher.is_stopped() == valid, patch


def test_qwen3_coder_values_take_the_schema_s_definitions(embedded: Any) -> None:
    """A parameter whose schema refers to the tool's ``$defs`` is compiled with
    them (each value is compiled on its own)."""
    schema = {
        "type": "object",
        "properties": {
            "path": {"type": "string"},
            "edits": {"type": "array", "items": {"$ref": "#/$defs/edit"}},
        },
        "required": ["path", "edits"],
        "$defs": {"edit": {"type": "object", "properties": {"line": {"type": "integer"}}}},
    }
    vocab = CallVocabulary(embedded.tool_call_end_token)
    text = call_grammar("qwen3_coder", [ToolGrammar("edit", schema)], vocab)
    assert text is not None
    matcher = llguidance.LLMatcher(
        embedded.grammar_tokenizer, llguidance.LLMatcher.grammar_from_lark(text)
    )
    assert not matcher.is_error(), matcher.get_error()
    body = (
        "\n<function=edit>\n<parameter=path>\na.py\n</parameter>\n"
        '<parameter=edits>\n[{"line": 3}]\n</parameter>\n</function>\n'
    )
    tokens = embedded.tokenizer.encode(body, add_special_tokens=False)
    tokens.append(embedded.tool_call_end_token)
    assert matcher.try_consume_tokens(tokens) == len(tokens)
    assert matcher.is_stopped()


def test_grammar_processor_follows_the_engine_s_view_of_tokens(embedded: Any) -> None:
    """The processor as the engine drives it: the host learns each token one
    step late, the pending one is on the device. Two calls with text between:
    every token of a call is allowed by the mask, the end of the turn is not,
    and the text between calls is free."""
    import mlx.core as mx

    from mlxtrio.engine.processors.grammar_masks import GrammarProcessor

    tokenizer = embedded.tokenizer
    start, end = embedded.tool_call_token, embedded.tool_call_end_token
    schema = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}
    text = call_grammar("json_tools", [ToolGrammar("get_weather", schema)], CallVocabulary(end))
    assert text is not None
    matcher = llguidance.LLMatcher(
        embedded.grammar_tokenizer, llguidance.LLMatcher.grammar_from_lark(text)
    )

    def spell(piece: str) -> list[int]:
        return list(tokenizer.encode(piece, add_special_tokens=False))

    call = spell('{"name": "get_weather", "arguments": {"city": "Oslo"}}') + [end]
    free = spell(" and then")
    output = [start, *call, *free, start, *call]
    constrained = {i for i in range(len(output)) if output[i - 1 : i] == [start]}
    for first in list(constrained):  # the rest of each call
        constrained |= set(range(first, first + len(call)))
    seen: list[int] = []
    processor = GrammarProcessor(matcher, start, repeat=True, seen=seen)
    prompt = spell("Hello")
    eos = min(tokenizer.eos_token_ids)
    vocab = embedded.vocab_size
    for step, token in enumerate(output):
        context = mx.array(prompt + output[:step])
        logits = processor(context, mx.zeros((1, vocab)))
        row = logits[0]
        assert row[token].item() == 0.0, step  # the model's token is allowed
        if step in constrained:
            assert row[eos].item() == -float("inf"), step
        else:
            assert mx.all(row == 0.0).item(), step  # free text: no mask
        seen[:] = output[: max(0, step)]  # the host is one step behind


# -- end to end: tool calls --------------------------------------------------------


def _valid_calls(turns: dict[str, Any], only: bool = True) -> None:
    """Each turn is a call of ``get_weather`` whose arguments match its schema
    (``only``: and nothing else)."""
    for how, turn in turns.items():
        assert turn.text == "", how
        assert turn.calls and (len(turn.calls) == 1 or not only), (how, turn.calls)
        name, arguments = turn.calls[0]
        assert name == "get_weather", how
        jsonschema.validate(arguments, CITY)
        assert turn.finish == CALLED[how.split("-")[0]], how


@pytest.mark.parametrize("choice", ["any", "tool", "required"])
async def test_a_required_call_is_a_valid_call(scripted: Server, choice: str) -> None:
    """A model that does not want to call (it would say ``Hello world.``) and,
    forced to, would write ``Paris``: every tool choice that requires a call
    gets one whose arguments match the schema, on every API, streaming or not."""
    messages_choice = (
        {"type": "tool", "name": "get_weather"} if choice == "tool" else {"type": "any"}
    )
    responses_choice: Any = (
        {"type": "function", "name": "get_weather"} if choice == "tool" else "required"
    )
    chat_choice: Any = (
        {"type": "function", "function": {"name": "get_weather"}}
        if choice == "tool"
        else "required"
    )
    extra = {
        "messages": {**TOOLS["messages"], "tool_choice": messages_choice},
        "responses": {**TOOLS["responses"], "tool_choice": responses_choice},
        "chat": {**TOOLS["chat"], "tool_choice": chat_choice},
    }
    _valid_calls(await every_api(scripted, "PLAIN", **extra))


@pytest.mark.parametrize("family", sorted(CALL_GRAMMARS))
async def test_every_call_grammar_family(
    family: str, server_factory: ServerFactory, family_model: Callable[[str], str]
) -> None:
    """Each family with a call grammar, on its scripted model answering in
    text (``TEXT``): a required call is written in the family's markup, and
    its arguments match the schema."""
    server = await family_server(server_factory, family_model, family)
    extra = {
        # Room for a whole call: the scripted vocabulary spells markup the
        # script does not write in single characters.
        "messages": {**TOOLS["messages"], "tool_choice": {"type": "any"}, "max_tokens": 512},
        "responses": {**TOOLS["responses"], "tool_choice": "required"},
        "chat": {**TOOLS["chat"], "tool_choice": "required"},
    }
    # The family script goes on with a second call whose opening is not the
    # marker's own token (see scripted_families): free, and not checked here.
    _valid_calls(await every_api(server, "TEXT", **extra), only=False)


@pytest.mark.parametrize("family", sorted(CALL_GRAMMARS))
async def test_each_family_s_broken_arguments_are_held(
    family: str, server_factory: ServerFactory, family_model: Callable[[str], str]
) -> None:
    """Each family with a call grammar, on its scripted model calling as it
    likes: it would call ``get_weather`` with ``Paris`` and no ``days``,
    which the schema refuses; what reaches the client is a schema-valid call
    instead, after the model's own text, on every API, streaming or not."""
    server = await family_server(server_factory, family_model, family)
    schemas = {"get_weather": CITY, "get_time": TIME}
    tools = {
        "messages": {
            "tools": [{"name": n, "input_schema": p} for n, p in schemas.items()],
            "max_tokens": 512,
        },
        "responses": {
            "tools": [{"type": "function", "name": n, "parameters": p} for n, p in schemas.items()]
        },
        "chat": {
            "tools": [
                {"type": "function", "function": {"name": n, "parameters": p}}
                for n, p in schemas.items()
            ]
        },
    }
    for how, turn in (await every_api(server, "Weather?", **tools)).items():
        assert turn.text == FAMILY_TEXT, how
        assert turn.calls, how
        for name, arguments in turn.calls:
            jsonschema.validate(arguments, schemas[name])
        assert ("get_weather", {"city": "Paris"}) not in turn.calls, how
        assert turn.finish == CALLED[how.split("-")[0]], how


async def test_the_model_s_own_call_is_held_to_the_schema(scripted: Server) -> None:
    """Unforced, the model calls ``get_weather`` with ``Paris``; the enum makes
    it a valid city instead (no call is dropped)."""
    _valid_calls(await every_api(scripted, "Weather?", **TOOLS))


async def test_auto_tool_choice_still_answers_in_text(scripted: Server) -> None:
    turns = await every_api(scripted, "PLAIN", **TOOLS)
    for how, turn in turns.items():
        assert (turn.text, turn.calls) == ("Hello world.", []), how


async def test_custom_tool_input_follows_its_lark_grammar(scripted: Server) -> None:
    tool = {
        "type": "custom",
        "name": "answer",
        "format": {"type": "grammar", "syntax": "lark", "definition": ANSWER_GRAMMAR},
    }
    async with openai.AsyncOpenAI(
        base_url=scripted.url + "/v1", api_key="unused", max_retries=0
    ) as client:
        response = await client.responses.create(
            model=SCRIPTED,
            input="PLAIN",
            tools=[tool],  # type: ignore[list-item]
            tool_choice={"type": "custom", "name": "answer"},
        )
    (item,) = response.output
    assert item.type == "custom_tool_call"
    lark.Lark(ANSWER_GRAMMAR).parse(item.input)


async def test_chat_custom_tool_input_follows_its_lark_grammar(scripted: Server) -> None:
    """The same on ``/v1/chat/completions``: a named custom tool's input is
    held to its Lark grammar, and comes back as a ``custom`` tool call."""
    tool = {
        "type": "custom",
        "custom": {
            "name": "answer",
            "format": {
                "type": "grammar",
                "grammar": {"syntax": "lark", "definition": ANSWER_GRAMMAR},
            },
        },
    }
    async with scripted.openai() as client:
        completion = await client.chat.completions.create(
            model=SCRIPTED,
            messages=[{"role": "user", "content": "PLAIN"}],
            tools=[tool],  # type: ignore[list-item]
            tool_choice={"type": "custom", "custom": {"name": "answer"}},
        )
    (choice,) = completion.choices
    assert choice.finish_reason == "tool_calls"
    (call,) = choice.message.tool_calls or []
    assert call.type == "custom" and call.custom.name == "answer"
    lark.Lark(ANSWER_GRAMMAR).parse(call.custom.input)


# -- end to end: structured output -----------------------------------------------------


async def json_schema_turn(
    server: Server,
    api: str,
    stream: bool,
    content: str,
    schema: dict[str, Any],
    strict: bool | None = True,
    **extra: Any,
) -> Turn:
    """A turn whose answer must match ``schema``, asked for as ``api`` asks:
    Responses' ``text.format``, Chat Completions' ``response_format``."""
    spec: dict[str, Any] = {"name": "g", "schema": schema}
    if strict is not None:
        spec["strict"] = strict
    if api == "responses":
        text = {"format": {"type": "json_schema", **spec}}
        return await responses_turn(server, stream, content, text=text, **extra)
    response_format = {"type": "json_schema", "json_schema": spec}
    return await chat_turn(server, stream, content, response_format=response_format, **extra)


ANSWERED = {"responses": "completed", "chat": "stop"}


@pytest.mark.parametrize("api", ["responses", "chat"])
@pytest.mark.parametrize("stream", [False, True])
async def test_json_schema_output(scripted: Server, stream: bool, api: str) -> None:
    turn = await json_schema_turn(scripted, api, stream, "Hi", GREETING)
    assert turn.finish == ANSWERED[api]
    jsonschema.validate(json.loads(turn.text), GREETING)


@pytest.mark.parametrize("field", ["output_config", "output_format"])
@pytest.mark.parametrize("stream", [False, True])
async def test_anthropic_structured_output(scripted: Server, stream: bool, field: str) -> None:
    fmt = {"type": "json_schema", "schema": GREETING}
    body = (
        {"output_config": {"format": fmt}} if field == "output_config" else {"output_format": fmt}
    )
    turn = await messages_turn(scripted, stream, "Hi", extra_body=body)
    assert turn.finish == "end_turn"
    jsonschema.validate(json.loads(turn.text), GREETING)


async def test_structured_output_after_thinking(scripted: Server) -> None:
    """Reasoning stays free; the answer after it matches the schema."""
    turn_body = {
        "output_config": {"format": {"type": "json_schema", "schema": GREETING}},
        "thinking": {"type": "enabled", "budget_tokens": 1024},
    }
    async with anthropic.AsyncAnthropic(
        base_url=scripted.url, api_key="unused", max_retries=0
    ) as client:
        message = await client.messages.create(
            model=SCRIPTED,
            max_tokens=64,
            messages=[{"role": "user", "content": "Hi"}],
            extra_body=turn_body,
        )
    thinking, text = message.content
    assert thinking.type == "thinking" and thinking.thinking == "Let me think."
    assert text.type == "text"
    jsonschema.validate(json.loads(text.text), GREETING)
    assert message.stop_reason == "end_turn"


@pytest.mark.parametrize("api", ["responses", "chat"])
async def test_structured_output_with_a_required_call(scripted: Server, api: str) -> None:
    """A required call is the answer; the format does not fight it."""
    extra = {**TOOLS[api], "tool_choice": "required"}
    turn = await json_schema_turn(scripted, api, False, "PLAIN", GREETING, None, **extra)
    _valid_calls({f"{api}-create": turn})


async def test_json_object_output_on_the_embedded_model(server: Server) -> None:
    async with openai.AsyncOpenAI(
        base_url=server.url + "/v1", api_key="unused", max_retries=0
    ) as client:
        response = await client.responses.create(
            model=server.engine.name,
            input="Describe a cat as a JSON object.",
            text={"format": {"type": "json_object"}},
            max_output_tokens=400,
        )
    if response.status == "completed":
        assert isinstance(json.loads(response.output_text), dict)
    else:  # the output cap cut it: said so, never a silent half object
        assert response.incomplete_details is not None
        assert response.output_text.startswith("{")


async def test_embedded_model_forced_call_is_valid(server: Server) -> None:
    schema = {
        "type": "object",
        "properties": {"word": {"type": "string"}, "lang": {"enum": ["en", "fr"]}},
        "required": ["word", "lang"],
    }
    async with anthropic.AsyncAnthropic(
        base_url=server.url, api_key="unused", max_retries=0
    ) as client:
        message = await client.messages.create(
            model=server.engine.name,
            max_tokens=300,
            messages=[{"role": "user", "content": "Hello there"}],
            tools=[{"name": "lookup", "description": "Look up a word", "input_schema": schema}],
            tool_choice={"type": "any"},
        )
    assert message.stop_reason == "tool_use"
    (block,) = [b for b in message.content if b.type == "tool_use"]
    jsonschema.validate(block.input, schema)


# -- what cannot be enforced -------------------------------------------------------------

UNSUPPORTED = {"type": "object", "propertyNames": {"pattern": "^a"}}


async def _post(server: Server, path: str, body: dict[str, Any]) -> httpx.Response:
    async with server.client() as client:
        return await client.post(path, json={"model": SCRIPTED, **body})


async def test_unsupported_schema_features_are_named(scripted: Server) -> None:
    strict_format = {"type": "json_schema", "name": "x", "schema": UNSUPPORTED, "strict": True}
    cases = [
        ("/v1/responses", {"input": "Hi", "text": {"format": strict_format}}, "text.format"),
        (
            "/v1/messages",
            {
                "max_tokens": 16,
                "messages": [{"role": "user", "content": "Hi"}],
                "output_config": {"format": {"type": "json_schema", "schema": UNSUPPORTED}},
            },
            "output_config.format",
        ),
        (
            "/v1/responses",
            {
                "input": "Hi",
                "tools": [
                    {"type": "function", "name": "f", "parameters": UNSUPPORTED, "strict": True}
                ],
            },
            "tools",
        ),
        (
            "/v1/chat/completions",
            {
                "messages": [{"role": "user", "content": "Hi"}],
                "response_format": {
                    "type": "json_schema",
                    "json_schema": {"name": "x", "schema": UNSUPPORTED, "strict": True},
                },
            },
            "response_format",
        ),
        (
            "/v1/chat/completions",
            {
                "messages": [{"role": "user", "content": "Hi"}],
                "tools": [
                    {
                        "type": "function",
                        "function": {"name": "f", "parameters": UNSUPPORTED, "strict": True},
                    }
                ],
            },
            "tools",
        ),
    ]
    for path, body, param in cases:
        response = await _post(scripted, path, body)
        assert response.status_code == 400, (path, response.text)
        error = response.json()["error"]
        assert "propertyNames" in error["message"], error
        if path != "/v1/messages":  # the OpenAI envelope names the field
            assert error["param"] == param, (path, error)


async def test_non_strict_tools_with_unsupported_features_still_work(scripted: Server) -> None:
    """A tool the client did not mark strict keeps being offered: the keyword
    the grammar engine does not implement is ignored (Claude Code's SendMessage
    uses propertyNames)."""
    response = await _post(
        scripted,
        "/v1/responses",
        {"input": "PLAIN", "tools": [{"type": "function", "name": "f", "parameters": UNSUPPORTED}]},
    )
    assert response.status_code == 200, response.text
    chat = await _post(
        scripted,
        "/v1/chat/completions",
        {
            "messages": [{"role": "user", "content": "PLAIN"}],
            "tools": [{"type": "function", "function": {"name": "f", "parameters": UNSUPPORTED}}],
        },
    )
    assert chat.status_code == 200, chat.text
    assert chat.json()["choices"][0]["message"]["content"] == "Hello world."


async def test_custom_tool_grammars(scripted: Server) -> None:
    def custom(definition: str, syntax: str = "lark") -> dict[str, Any]:
        return {
            "type": "custom",
            "name": "c",
            "format": {"type": "grammar", "syntax": syntax, "definition": definition},
        }

    broken = await _post(
        scripted, "/v1/responses", {"input": "PLAIN", "tools": [custom("start: (((")]}
    )
    assert broken.status_code == 400, broken.text
    assert broken.json()["error"]["param"] == "tools"
    # A recursive grammar has no regular form: offered, its input left free.
    recursive = custom('start: "(" start ")" | "x"')
    ok = await _post(scripted, "/v1/responses", {"input": "PLAIN", "tools": [recursive]})
    assert ok.status_code == 200, ok.text
    regex = await _post(
        scripted, "/v1/responses", {"input": "PLAIN", "tools": [custom("a+", "regex")]}
    )
    assert regex.status_code == 200, regex.text
