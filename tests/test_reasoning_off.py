"""Reasoning only when asked: with reasoning off, a model that opens its
reasoning block unasked is held off it (the opener is masked like the
tool-call marker), on every API and in compaction; asked, it reasons.

The scripted model's first choice after ``UNASKED`` (reasoning off) is
``<think>``; masked, its second choice is ``Hello world.``."""

from __future__ import annotations

from typing import Any

import pytest

from .agent_fixtures import codex_plain, codex_toolcall
from .conftest import SCRIPTED, Server
from .scripted_model import EXPECTED_REASONING, EXPECTED_TEXT

PROMPT = "UNASKED: what now?"
ASKED_TEXT = EXPECTED_TEXT["<|s_think|>"]
PLAIN_TEXT = EXPECTED_TEXT["<|s_plain|>"]


async def messages_turn(server: Server, thinking: bool, stream: bool) -> tuple[str, str]:
    extra: dict[str, Any] = {}
    if thinking:
        extra["thinking"] = {"type": "enabled", "budget_tokens": 1024}
    async with server.anthropic() as client:
        kwargs = dict(
            model=SCRIPTED,
            max_tokens=64,
            messages=[{"role": "user", "content": PROMPT}],
            **extra,
        )
        if stream:
            async with client.messages.stream(**kwargs) as events:
                message = await events.get_final_message()
        else:
            message = await client.messages.create(**kwargs)
    text = "".join(b.text for b in message.content if b.type == "text")
    thought = "".join(b.thinking for b in message.content if b.type == "thinking")
    return text, thought


async def responses_turn(server: Server, thinking: bool, stream: bool) -> tuple[str, str]:
    reasoning = {"effort": "medium"} if thinking else {"effort": "none"}
    async with server.openai() as client:
        if stream:
            async with client.responses.stream(
                model=SCRIPTED, input=PROMPT, reasoning=reasoning
            ) as events:
                response = await events.get_final_response()
        else:
            response = await client.responses.create(
                model=SCRIPTED, input=PROMPT, reasoning=reasoning
            )
    thought = "".join(
        part.text for item in response.output if item.type == "reasoning" for part in item.summary
    )
    return response.output_text, thought


async def chat_turn(server: Server, thinking: bool, stream: bool) -> tuple[str, str]:
    effort = "medium" if thinking else "none"
    messages = [{"role": "user", "content": PROMPT}]
    async with server.openai() as client:
        if not stream:
            completion = await client.chat.completions.create(
                model=SCRIPTED, messages=messages, reasoning_effort=effort
            )
            message = completion.choices[0].message
            return message.content or "", getattr(message, "reasoning_content", None) or ""
        chunks = await client.chat.completions.create(
            model=SCRIPTED, messages=messages, reasoning_effort=effort, stream=True
        )
        text = thought = ""
        async for chunk in chunks:
            if chunk.choices:
                delta = chunk.choices[0].delta
                text += delta.content or ""
                thought += getattr(delta, "reasoning_content", None) or ""
    return text, thought


TURNS = {"messages": messages_turn, "responses": responses_turn, "chat": chat_turn}


@pytest.mark.parametrize("stream", [False, True], ids=["json", "stream"])
@pytest.mark.parametrize("api", sorted(TURNS))
async def test_reasoning_off_gets_no_reasoning(scripted: Server, api: str, stream: bool) -> None:
    text, thought = await TURNS[api](scripted, False, stream)
    assert (text, thought) == (PLAIN_TEXT, "")


@pytest.mark.parametrize("stream", [False, True], ids=["json", "stream"])
@pytest.mark.parametrize("api", sorted(TURNS))
async def test_reasoning_asked_for_is_given(scripted: Server, api: str, stream: bool) -> None:
    text, thought = await TURNS[api](scripted, True, stream)
    assert (text, thought) == (ASKED_TEXT, EXPECTED_REASONING)


async def test_compaction_never_reasons(scripted: Server) -> None:
    """A summary is asked for with reasoning off, whatever the conversation
    asked: the model drawn to reason writes the summary instead."""
    body = {
        "model": SCRIPTED,
        "input": [
            {"role": "user", "content": PROMPT},
            {"role": "assistant", "content": "Hello world."},
        ],
        "reasoning": {"effort": "high"},
    }
    async with scripted.client() as client:
        r = await client.post("/v1/responses/compact", json=body)
    assert r.status_code == 200, r.text
    usage = r.json()["usage"]
    assert usage["output_tokens_details"]["reasoning_tokens"] == 0
    assert usage["output_tokens"] == 3  # "Hello", " world.", EOS


@pytest.mark.parametrize("shape", [codex_plain, codex_toolcall], ids=["plain", "toolcall"])
async def test_compaction_on_the_embedded_model_ends_without_reasoning(
    server: Server, shape: Any
) -> None:
    """A Codex-shaped conversation compacted on the embedded model: no
    reasoning (before the opener was masked it reasoned 29 and 60 tokens on
    these, and on Codex's real histories up to the 4,096-token cap), and the
    summary ends within its default cap."""
    body = {k: v for k, v in shape("mlxtrio-tiny").items() if k != "stream"}
    async with server.client() as client:
        r = await client.post("/v1/responses/compact", json=body)
    assert r.status_code == 200, r.text
    compacted = r.json()
    assert compacted["output"][-1]["type"] == "compaction"
    usage = compacted["usage"]
    assert usage["output_tokens_details"]["reasoning_tokens"] == 0
    assert 0 < usage["output_tokens"] <= 1024
