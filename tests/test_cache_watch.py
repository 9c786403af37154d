"""Why a turn missed the cache: where a prompt parted from its session's
previous turn, said once in the log (secrets masked), counted by cause in
/metrics, and in the access line."""

from __future__ import annotations

import logging

import pytest

from mlxtrio.serving.cache_watch import CacheWatch, mask_secrets

from .conftest import SCRIPTED, Server


def decode(tokens: list[int]) -> str:
    return " ".join(f"t{t}" for t in tokens)


def observe(watch: CacheWatch, prompt: list[int], cached: int, **kwargs: object) -> str | None:
    args: dict = {"model": "m", "domain": "", "session": "s", "decode": decode, **kwargs}
    return watch.observe(prompt=prompt, cached=cached, **args)


def test_causes(caplog: pytest.LogCaptureFixture) -> None:
    watch = CacheWatch()
    first = list(range(400))
    assert observe(watch, first, 0) == "new_conversation"
    # The next turn goes on from the previous one and reuses it: no miss.
    second = first + list(range(1000, 1100))
    assert observe(watch, second, 398) is None
    # The same turn again, but the cache lost it.
    assert observe(watch, second, 0) == "eviction"
    # A prompt that parts 100 tokens in: the log says where, with text.
    caplog.set_level(logging.INFO, "mlxtrio.cache")
    third = first[:100] + [7777] + second[101:] + [5, 6]
    assert observe(watch, third, 96) == "divergence"
    (line,) = [r.getMessage() for r in caplog.records if "parted" in r.getMessage()]
    assert "at token 100" in line and "t7777" in line and "t100" in line
    assert observe(watch, third + [9], 0, model="other") == "other_model"
    # Another session's prompt that shares a cached prefix is a hit, not a miss.
    assert observe(watch, list(range(300)), 256, session="new") is None


def test_secrets_are_masked_in_excerpts() -> None:
    text = "export OPENAI_API_KEY=sk-abcdefghijklmnop1234 and password=hunter2 ok"
    masked = mask_secrets(text)
    assert "sk-abcdefghijklmnop1234" not in masked and "hunter2" not in masked
    assert masked.endswith(" ok") and masked.startswith("export")


SYSTEM = "You are a coding agent working in a repository. " * 30


async def test_a_prompt_that_changed_early_is_explained(
    scripted: Server, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO)
    headers = {"X-Claude-Code-Session-Id": "session-1"}

    async def turn(system: str, content: str) -> int:
        async with scripted.client(headers=headers) as client:
            r = await client.post(
                "/v1/messages",
                json={
                    "model": SCRIPTED,
                    "max_tokens": 16,
                    "system": system,
                    "messages": [{"role": "user", "content": content}],
                },
            )
        assert r.status_code == 200, r.text
        return int(r.headers["x-cached-tokens"])

    assert await turn(SYSTEM, "First question.") == 0
    assert await turn(SYSTEM, "First question. And more.") > 0  # goes on: a hit
    # The date in the system prompt changed near its start: everything after
    # it is prefilled again, and the log says why.
    assert await turn("Today is Friday. " + SYSTEM, "First question. And more.") < 10
    async with scripted.client() as client:
        metrics = (await client.get("/metrics")).text
    assert 'mlxtrio_prefix_cache_misses_total{cause="divergence",model="scripted"} 1.0' in metrics
    assert 'mlxtrio_prefix_cache_misses_total{cause="new_conversation",model="scripted"} 1.0' in (
        metrics
    )
    lines = [r.getMessage() for r in caplog.records]
    parted = [line for line in lines if "parted from the session's previous turn" in line]
    assert len(parted) == 1 and "Today is Friday" in parted[0]
    assert any("POST /v1/messages 200" in line and "miss=divergence" in line for line in lines)
