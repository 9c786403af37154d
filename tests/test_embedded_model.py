"""The trained embedded model behaves like an agent model, end to end.

These tests go through both APIs with the official SDKs on the model that ships in
the package, and assert structure, not exact text: plain turns stop, tool requests
yield a well-formed call with JSON object arguments, a tool round trip ends in a
text answer, and reasoning comes as a reasoning item / thinking block.

The weights name the right offered tool in about 93 % of held-out requests as
served (the README's figures). The server holds every call to an offered tool
and its schema (the grammar engine), so every call here must validate against
its tool's schema, forced or not; these requests, which name the tool's
family plainly, also check which tool is called, in both tool orders; they do
not check argument values. Agent-sized requests of real-world
text (as Claude Code and Codex send) must stop within a few hundred tokens.
"""

from __future__ import annotations

import json

import jsonschema
import pytest

from .conftest import MODEL, Server

FORECAST = {
    "type": "function",
    "name": "fetch_forecast",
    "description": "Get the current weather for a city.",
    "parameters": {
        "type": "object",
        "properties": {"location": {"type": "string", "description": "The city name."}},
        "required": ["location"],
    },
}
RUN = {
    "type": "function",
    "name": "terminal_exec",
    "description": "Run a shell command and return its output.",
    "parameters": {
        "type": "object",
        "properties": {"cmd": {"type": "string", "description": "The command line to run."}},
        "required": ["cmd"],
    },
}
SCHEMAS = {t["name"]: t["parameters"] for t in (FORECAST, RUN)}
ANTHROPIC_TOOLS = [
    {"name": t["name"], "description": t["description"], "input_schema": t["parameters"]}
    for t in (FORECAST, RUN)
]


async def test_plain_turn_answers_and_stops(server: Server) -> None:
    async with server.openai() as client:
        response = await client.responses.create(
            model=MODEL, input="Hello there!", max_output_tokens=256
        )
    assert response.status == "completed"  # EOS before the cap
    assert response.output_text.strip()
    assert not [item for item in response.output if item.type == "function_call"]


@pytest.mark.parametrize("tools", [[FORECAST, RUN], [RUN, FORECAST]])
async def test_tool_request_yields_a_call_to_the_offered_tool(server: Server, tools) -> None:
    async with server.openai() as client:
        response = await client.responses.create(
            model=MODEL,
            input="What's the weather in Lisbon?",
            tools=tools,
            max_output_tokens=256,
        )
    calls = [item for item in response.output if item.type == "function_call"]
    assert response.status == "completed"
    assert [call.name for call in calls] == [FORECAST["name"]], response.output
    arguments = json.loads(calls[0].arguments)
    jsonschema.validate(arguments, FORECAST["parameters"])


async def test_tool_round_trip_ends_in_a_text_answer(server: Server) -> None:
    async with server.openai() as client:
        first = await client.responses.create(
            model=MODEL,
            input="Run `git status` please.",
            tools=[FORECAST, RUN],
            max_output_tokens=256,
        )
        call = next(item for item in first.output if item.type == "function_call")
        assert call.name == RUN["name"]
        jsonschema.validate(json.loads(call.arguments), RUN["parameters"])
        second = await client.responses.create(
            model=MODEL,
            previous_response_id=first.id,
            tools=[FORECAST, RUN],
            input=[
                {
                    "type": "function_call_output",
                    "call_id": call.call_id,
                    "output": "On branch main",
                }
            ],
            max_output_tokens=256,
        )
    assert second.status == "completed"
    assert second.output_text.strip()
    assert not [item for item in second.output if item.type == "function_call"]


async def test_reasoning_item_then_answer(server: Server) -> None:
    async with server.openai() as client:
        response = await client.responses.create(
            model=MODEL,
            input="What is the capital of France?",
            reasoning={"effort": "medium"},
            max_output_tokens=256,
        )
    kinds = [item.type for item in response.output]
    assert kinds[0] == "reasoning" and response.output[0].summary[0].text.strip()
    assert "message" in kinds and response.output_text.strip()
    assert response.status == "completed"


async def test_messages_tool_use_and_thinking(server: Server) -> None:
    async with server.anthropic() as client:
        async with client.messages.stream(
            model="claude-sonnet-4-5",
            max_tokens=256,
            thinking={"type": "enabled", "budget_tokens": 1024},
            tools=ANTHROPIC_TOOLS,
            messages=[{"role": "user", "content": "What's the weather in Oslo?"}],
        ) as stream:
            final = await stream.get_final_message()
    kinds = [block.type for block in final.content]
    assert kinds[0] == "thinking" and final.content[0].thinking.strip()
    tool_uses = [block for block in final.content if block.type == "tool_use"]
    assert [block.name for block in tool_uses] == [FORECAST["name"]]
    jsonschema.validate(tool_uses[0].input, FORECAST["parameters"])
    assert final.stop_reason == "tool_use"


async def test_messages_round_trip_answers_with_text(server: Server) -> None:
    async with server.anthropic() as client:
        reply = await client.messages.create(
            model="claude-sonnet-4-5",
            max_tokens=256,
            tools=ANTHROPIC_TOOLS,
            messages=[
                {"role": "user", "content": "What's the weather in Oslo?"},
                {
                    "role": "assistant",
                    "content": [
                        {
                            "type": "tool_use",
                            "id": "toolu_1",
                            "name": "fetch_forecast",
                            "input": {"location": "Oslo"},
                        }
                    ],
                },
                {
                    "role": "user",
                    "content": [
                        {
                            "type": "tool_result",
                            "tool_use_id": "toolu_1",
                            "content": '{"condition": "sunny", "temperature": 18}',
                        }
                    ],
                },
            ],
        )
    assert reply.stop_reason == "end_turn"
    assert reply.content[-1].type == "text" and reply.content[-1].text.strip()


async def test_required_tool_choice_forces_a_call_on_a_plain_request(server: Server) -> None:
    async with server.openai() as client:
        free, response = [
            await client.responses.create(
                model=MODEL,
                input="Good morning!",
                tools=[FORECAST, RUN],
                tool_choice=choice,
                max_output_tokens=256,
            )
            for choice in ("auto", "required")
        ]
    # a plain greeting: without the requirement the model answers in text
    assert free.output_text.strip()
    assert not [item for item in free.output if item.type == "function_call"]
    calls = [item for item in response.output if item.type == "function_call"]
    assert calls, response.output
    # the server confines the required call's name to the offered tools
    assert calls[0].name in (FORECAST["name"], RUN["name"])
    jsonschema.validate(json.loads(calls[0].arguments), SCHEMAS[calls[0].name])


@pytest.mark.parametrize(
    ("choice", "question", "allowed"),
    [
        # any: a greeting needs no tool, yet the call must name an offered one
        ({"type": "any"}, "Hello there!", {FORECAST["name"], RUN["name"]}),
        # named: a weather question, yet the call must be the named tool
        ({"type": "tool", "name": RUN["name"]}, "What's the weather in Oslo?", {RUN["name"]}),
    ],
)
async def test_required_tool_choice_after_thinking_names_an_allowed_tool(
    server: Server, choice: dict, question: str, allowed: set[str]
) -> None:
    async with server.anthropic() as client:
        reply = await client.messages.create(
            model="claude-sonnet-4-5",
            max_tokens=256,
            thinking={"type": "enabled", "budget_tokens": 1024},
            tools=ANTHROPIC_TOOLS,
            tool_choice=choice,  # type: ignore[arg-type]
            messages=[{"role": "user", "content": question}],
        )
    assert reply.content[0].type == "thinking"
    tool_uses = [block for block in reply.content if block.type == "tool_use"]
    assert len(tool_uses) == 1 and tool_uses[0].name in allowed
    jsonschema.validate(tool_uses[0].input, SCHEMAS[tool_uses[0].name])
    assert reply.stop_reason == "tool_use"


def agent_sized_context(chars: int) -> str:
    """Ordinary English and code, as agent clients' system prompts are, about
    ``chars`` long: the documentation of standard-library modules whose sources
    the model never trained on (the eval split of ``tools/foreign_text.py``)."""
    import argparse
    import doctest
    import inspect
    import shutil
    import tarfile
    import tempfile

    parts = []
    for module in (argparse, shutil, tempfile, tarfile, doctest):
        parts.append(f"# {module.__name__}\n\n{inspect.getdoc(module)}")
        for name, member in sorted(vars(module).items()):
            if not name.startswith("_") and callable(member) and inspect.getdoc(member):
                parts.append(f"## {name}\n\n{inspect.getdoc(member)}")
    text = "\n\n".join(parts)
    assert len(text) >= chars, len(text)
    return text[:chars]


REMINDER = (
    "<system-reminder>\nAs you answer, you can use this context:\n"
    "# currentDate\nToday's date is 2026-11-29.\n</system-reminder>\n\n"
)


async def test_agent_sized_messages_request_stops(server: Server) -> None:
    """A Claude Code-shaped turn: a ~15k-token system prompt of real text, its
    tools, a reminder block before the request, thinking on. Run 13 and earlier
    wrote to the cap on such prompts (the README's runs 13 and 14)."""
    async with server.anthropic() as client:
        final = await client.messages.create(
            model=MODEL,
            max_tokens=512,
            thinking={"type": "enabled", "budget_tokens": 1024},
            system=[{"type": "text", "text": agent_sized_context(30000)}],
            tools=ANTHROPIC_TOOLS,
            messages=[{"role": "user", "content": REMINDER + "say hello"}],
        )
    assert final.usage.input_tokens + (final.usage.cache_read_input_tokens or 0) > 10000
    assert final.stop_reason in ("end_turn", "tool_use"), final.content
    assert final.usage.output_tokens < 400


async def test_agent_sized_responses_request_stops(server: Server) -> None:
    """A Codex-shaped turn: long instructions, a developer message, tools."""
    async with server.openai() as client:
        response = await client.responses.create(
            model=MODEL,
            max_output_tokens=512,
            instructions=agent_sized_context(20000),
            tools=[FORECAST, RUN],
            input=[
                {"role": "developer", "content": agent_sized_context(3000)},
                {
                    "role": "user",
                    "content": "<environment_context>\n  <cwd>/tmp</cwd>\n</environment_context>",
                },
                {"role": "user", "content": "say hello"},
            ],
        )
    assert response.usage.input_tokens > 8000
    assert response.status == "completed", response.output
    assert response.usage.output_tokens < 400
