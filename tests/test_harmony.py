"""gpt-oss's Harmony format: detected from the model, parsed by channel (no
markup ever reaches a client), prompts rendered through the model's own
template with the reasoning effort asked for, calls held to the offered tools'
schemas.

The model is a tiny random-weight gpt-oss (mlx-lm's real ``gpt_oss``
architecture) with a byte-level tokenizer that carries Harmony's special
tokens and a Harmony chat template (``tools/build_tiny_gpt_oss.py``)."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import jsonschema
import pytest

from mlxtrio.chat.output import OutputParser, Segment
from mlxtrio.engine.harmony import parse_tool_call
from mlxtrio.engine.model import LoadedModel, load_model
from mlxtrio.grammar import harmony as harmony_grammar

from .conftest import Server, ServerFactory

sys.path.insert(0, str(Path(__file__).parent.parent / "tools"))

OSS = "tiny-oss"
WEATHER = {
    "type": "function",
    "name": "get_weather",
    "description": "Weather in a city",
    "parameters": {
        "type": "object",
        # Bounded values: random weights would write a string for as long as
        # the output cap allows.
        "properties": {
            "city": {"enum": ["Paris", "Oslo", "Zürich"]},
            "days": {"enum": [1, 2, 3]},
        },
        "required": ["city"],
    },
}


@pytest.fixture(scope="session")
def oss_path(tmp_path_factory: pytest.TempPathFactory) -> str:
    from build_tiny_gpt_oss import SPECIAL_TOKENS, build_model, build_tokenizer
    from tokenizers import Tokenizer

    out = tmp_path_factory.mktemp("tiny-oss")
    size = build_tokenizer(out)
    tokenizer = Tokenizer.from_file(str(out / "tokenizer.json"))
    build_model(out, size, {t: tokenizer.token_to_id(t) for t in SPECIAL_TOKENS}, seed=0)
    return str(out)


@pytest.fixture(scope="session")
def oss(oss_path: str) -> LoadedModel:
    return load_model(OSS, oss_path, "auto")


def parsed(loaded: LoadedModel, completion: str, tools: Any = None) -> list[Segment]:
    """``completion`` as the model would write it, token by token, through the
    streaming detokenizer and the output parser, stopping at a stop token."""
    tokenizer = loaded.tokenizer
    parser = OutputParser(tokenizer, tools)
    detokenizer = tokenizer.detokenizer
    detokenizer.reset()
    segments: list[Segment] = []
    for token in tokenizer.encode(completion, add_special_tokens=False):
        if token in tokenizer.eos_token_ids:
            break
        detokenizer.add_token(token)
        segments += parser.feed(detokenizer.last_segment)
    detokenizer.finalize()
    segments += parser.feed(detokenizer.last_segment)
    return segments + parser.finish()


def kinds(segments: list[Segment]) -> dict[str, Any]:
    out: dict[str, Any] = {"reasoning": "", "text": "", "calls": []}
    for s in segments:
        if s.tool_call is not None:
            out["calls"].append((s.tool_call.name, json.loads(s.tool_call.arguments)))
        else:
            out[s.kind] += s.text
    return out


def test_a_harmony_model_is_detected_and_its_stops_set(oss: LoadedModel) -> None:
    assert oss.harmony is not None and set(oss.harmony) >= {"<|channel|>", "<|call|>"}
    eos = oss.tokenizer.eos_token_ids
    assert {oss.harmony[m] for m in ("<|call|>", "<|return|>", "<|endoftext|>")} <= set(eos)
    assert oss.harmony["<|end|>"] not in eos  # it ends a message, not the turn


@pytest.mark.parametrize(
    ("completion", "expected"),
    [
        (
            "<|channel|>analysis<|message|>Überlege: 2+2.<|end|><|start|>assistant"
            "<|channel|>final<|message|>4 — naïve ✓<|return|>",
            {"reasoning": "Überlege: 2+2.", "text": "4 — naïve ✓", "calls": []},
        ),
        (
            "<|channel|>analysis<|message|>Need weather.<|end|><|start|>assistant"
            '<|channel|>commentary to=functions.get_weather <|constrain|>json<|message|>{"city": "Zürich"}<|call|>',
            {
                "reasoning": "Need weather.",
                "text": "",
                "calls": [("get_weather", {"city": "Zürich"})],
            },
        ),
        (  # the recipient in the role, a preamble first
            "<|channel|>commentary<|message|>Checking.<|end|><|start|>assistant to=functions.get_weather"
            '<|channel|>commentary json<|message|>{"city": "Oslo"}<|call|>',
            {"reasoning": "", "text": "Checking.", "calls": [("get_weather", {"city": "Oslo"})]},
        ),
        (  # cut mid-message: what came is kept, no markup
            "<|channel|>analysis<|message|>Let me th",
            {"reasoning": "Let me th", "text": "", "calls": []},
        ),
        (  # cut mid-call: no call, no markup
            '<|channel|>commentary to=functions.get_weather <|constrain|>json<|message|>{"ci',
            {"reasoning": "", "text": "", "calls": []},
        ),
        (  # header markers inside a message's text are not shown
            "<|channel|>analysis<|message|>Th<|constrain|>ink<|endofprompt|>.<|end|><|start|>assistant"
            "<|channel|>final<|message|>Hel<|startoftext|>lo<|message|>!<|return|>",
            {"reasoning": "Think.", "text": "Hello!", "calls": []},
        ),
        (  # a message that starts without ending the last one
            "<|channel|>analysis<|message|>Plan.<|start|>assistant<|channel|>final<|message|>Done"
            "<|return|>",
            {"reasoning": "Plan.", "text": "Done", "calls": []},
        ),
        (  # a channel that starts without ending the last message: a call
            "<|channel|>analysis<|message|>Plan.<|channel|>commentary to=functions.get_weather"
            ' json<|message|>{"city": "Oslo"}<|call|>',
            {"reasoning": "Plan.", "text": "", "calls": [("get_weather", {"city": "Oslo"})]},
        ),
        (  # ... or the answer
            "<|channel|>analysis<|message|>Plan.<|channel|>final<|message|>Hello<|return|>",
            {"reasoning": "Plan.", "text": "Hello", "calls": []},
        ),
    ],
    ids=[
        "final",
        "call",
        "role-recipient",
        "cut-analysis",
        "cut-call",
        "stray",
        "no-end",
        "no-end-call",
        "no-end-final",
    ],
)
def test_the_output_is_split_by_channel(
    oss: LoadedModel, completion: str, expected: dict[str, Any]
) -> None:
    assert kinds(parsed(oss, completion)) == expected


def test_the_call_parser_reads_both_header_orders() -> None:
    assert parse_tool_call('f <|constrain|>json<|message|>{"a": 1}') == {
        "name": "f",
        "arguments": {"a": 1},
    }
    assert parse_tool_call("f<|channel|>commentary json<|message|>{}") == {
        "name": "f",
        "arguments": {},
    }
    with pytest.raises(ValueError):
        parse_tool_call("no message here")


@pytest.fixture
async def oss_server(server_factory: ServerFactory, oss_path: str) -> Server:
    return await server_factory(model=oss_path, model_name=OSS)


def no_markup(text: str) -> None:
    assert "<|" not in text and "|>" not in text, text


@pytest.fixture
def short_reasoning(monkeypatch: pytest.MonkeyPatch) -> None:
    """Random weights write mostly 3- and 4-byte characters, one byte a
    token: the reasoning before a required call is bounded by 32 characters
    here, so that the call comes within a few hundred tokens."""
    monkeypatch.setattr(harmony_grammar, "REASONING_CHARS", 32)


async def test_required_calls_are_valid_on_every_api(
    oss_server: Server, short_reasoning: None
) -> None:
    """Random weights, held by the grammar: a required call names the offered
    tool and its arguments match the schema, through each API's SDK."""
    schema = WEATHER["parameters"]
    async with oss_server.openai() as client:
        response = await client.responses.create(
            model=OSS,
            input="Weather in Paris?",
            tools=[WEATHER],
            tool_choice="required",
            max_output_tokens=1600,
        )
        calls = [i for i in response.output if i.type == "function_call"]
        assert calls and calls[0].name == "get_weather"
        jsonschema.validate(json.loads(calls[0].arguments), schema)
        no_markup(response.output_text)
        completion = await client.chat.completions.create(
            model=OSS,
            messages=[{"role": "user", "content": "Weather in Paris?"}],
            tools=[
                {"type": "function", "function": {k: WEATHER[k] for k in ("name", "parameters")}}
            ],
            tool_choice="required",
            max_tokens=1600,
        )
        choice = completion.choices[0]
        assert choice.finish_reason == "tool_calls"
        jsonschema.validate(json.loads(choice.message.tool_calls[0].function.arguments), schema)
    async with oss_server.anthropic() as claude:
        message = await claude.messages.create(
            model=OSS,
            max_tokens=1600,
            messages=[{"role": "user", "content": "Weather in Paris?"}],
            tools=[{"name": "get_weather", "input_schema": schema}],
            tool_choice={"type": "any"},
        )
    assert message.stop_reason == "tool_use"
    (use,) = [b for b in message.content if b.type == "tool_use"]
    jsonschema.validate(use.input, schema)
    for block in message.content:
        if block.type == "text":
            no_markup(block.text)


async def test_structured_output_holds_the_final_message(
    oss_server: Server, short_reasoning: None
) -> None:
    schema = {"type": "object", "properties": {"n": {"type": "integer"}}, "required": ["n"]}
    async with oss_server.openai() as client:
        response = await client.responses.create(
            model=OSS,
            input="A number.",
            text={"format": {"type": "json_schema", "name": "n", "schema": schema}},
            max_output_tokens=1600,
        )
    jsonschema.validate(json.loads(response.output_text), schema)


@pytest.mark.parametrize("stream", [False, True])
async def test_free_output_never_shows_markup(oss_server: Server, stream: bool) -> None:
    """Whatever random weights write, headers and markers never reach the
    client: what is not a message's content is not shown."""
    async with oss_server.openai() as client:
        if stream:
            events = await client.responses.create(
                model=OSS, input="Hi", tools=[WEATHER], max_output_tokens=200, stream=True
            )
            response = None
            async for event in events:
                if event.type in ("response.completed", "response.incomplete"):
                    response = event.response
            assert response is not None
        else:
            response = await client.responses.create(
                model=OSS, input="Hi", tools=[WEATHER], max_output_tokens=200
            )
    no_markup(response.output_text)
    for item in response.output:
        if item.type == "reasoning":
            no_markup("".join(part.text for part in item.summary))


async def test_reasoning_effort_reaches_the_prompt(oss_server: Server) -> None:
    """Responses ``reasoning.effort``, Anthropic ``thinking.budget_tokens``
    and Chat Completions ``reasoning_effort`` set the Harmony system
    message's ``Reasoning:`` line (the token counts differ by its length)."""
    async with oss_server.client() as client:

        async def count(effort: str) -> int:
            r = await client.post(
                "/v1/responses/input_tokens",
                json={"model": OSS, "input": "Hi", "reasoning": {"effort": effort}},
            )
            return int(r.json()["input_tokens"])

        low, high = await count("low"), await count("high")
        r = await client.post(
            "/v1/messages/count_tokens",
            json={
                "model": OSS,
                "messages": [{"role": "user", "content": "Hi"}],
                "thinking": {"type": "enabled", "budget_tokens": 32000},
            },
        )
    # Byte-level tokens: "high" is one character longer than "low".
    assert high == low + 1
    assert int(r.json()["input_tokens"]) == high


async def test_a_tool_round_trip_reuses_the_first_turn(
    oss_server: Server, short_reasoning: None
) -> None:
    """The second turn (the call and its result appended) starts from the
    first turn's KV: the call's reasoning is kept in the prompt, so the
    prompt goes on where the first one ended."""
    async with oss_server.client() as client:
        first = await client.post(
            "/v1/responses",
            json={
                "model": OSS,
                "input": "Weather in Paris?",
                "tools": [WEATHER],
                "tool_choice": "required",
                "max_output_tokens": 1600,
            },
        )
        assert first.status_code == 200, first.text
        call = next(i for i in first.json()["output"] if i["type"] == "function_call")
        second = await client.post(
            "/v1/responses",
            json={
                "model": OSS,
                "previous_response_id": first.json()["id"],
                "input": [
                    {"type": "function_call_output", "call_id": call["call_id"], "output": "sunny"}
                ],
                "tools": [WEATHER],
                "max_output_tokens": 8,
            },
        )
    assert second.status_code == 200, second.text
    # gpt-oss's sliding-window layers cannot be trimmed: the first turn was
    # snapshotted where its conversation ended, before the generation prompt
    # ("<|start|>assistant": 10 tokens of this byte-level vocabulary), and the
    # second turn goes on from there.
    prompt = first.json()["usage"]["input_tokens"]
    assert int(second.headers["x-cached-tokens"]) == prompt - 10
