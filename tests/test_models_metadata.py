"""``GET /v1/models`` and ``GET /v1/models/{id}``: one body for the openai SDK,
the anthropic SDK and Codex's model catalog, with the served models' limits."""

from __future__ import annotations

import anthropic
import openai
import pytest

from .conftest import MODEL, Server, ServerFactory

# The fields Codex 0.171 refuses a catalog entry without (found by feeding
# entries to `codex debug models`), plus the limits it reads.
CODEX_REQUIRED = {
    "slug",
    "display_name",
    "supported_reasoning_levels",
    "shell_type",
    "visibility",
    "supported_in_api",
    "priority",
    "support_verbosity",
    "truncation_policy",
    "experimental_supported_tools",
    "base_instructions",
}


async def test_openai_sdk_lists_and_retrieves_with_limits(server: Server) -> None:
    context = server.engine.loaded.context_length  # type: ignore[union-attr]
    assert context == 65536  # the embedded model's max_position_embeddings
    client = server.openai()
    page = await client.models.list()
    [model] = page.data
    assert model.id == MODEL and model.object == "model" and model.owned_by == "mlxtrio"
    assert model.model_extra is not None
    assert model.model_extra["context_window"] == context
    assert model.model_extra["max_output_tokens"] == 32768  # MAX_OUTPUT_TOKENS's default
    one = await client.models.retrieve(MODEL)
    assert one.id == MODEL and one.model_extra == model.model_extra
    with pytest.raises(openai.NotFoundError):
        await client.models.retrieve("no-such-model")


async def test_anthropic_sdk_lists_and_retrieves_with_limits(server: Server) -> None:
    context = server.engine.loaded.context_length  # type: ignore[union-attr]
    client = server.anthropic()
    models = [m async for m in client.models.list()]
    assert [m.id for m in models] == [MODEL]
    model = models[0]
    assert model.type == "model" and model.display_name == MODEL
    assert model.created_at.year >= 2025
    # The SDK's own fields: max_input_tokens is the context window, max_tokens the output cap.
    assert model.max_input_tokens == context
    assert model.max_tokens == 32768
    one = await client.models.retrieve(MODEL)
    assert one.id == MODEL
    with pytest.raises(anthropic.NotFoundError):
        await client.models.retrieve("no-such-model")


async def test_output_cap_follows_the_server_setting(server_factory: ServerFactory) -> None:
    server = await server_factory(max_output_tokens=1000)
    async with server.client() as http:
        entry = (await http.get("/v1/models")).json()["data"][0]
    assert entry["max_output_tokens"] == entry["max_tokens"] == 1000


async def test_aliases_are_listed_and_resolved(server_factory: ServerFactory) -> None:
    server = await server_factory(aliases={"gpt-local": MODEL, "claude-*": MODEL})
    client = server.openai()
    page = await client.models.list()
    assert [m.id for m in page.data] == [MODEL, "gpt-local"]  # patterns are not names
    alias = page.data[1].model_extra or {}
    assert alias["alias_of"] == MODEL and alias["context_window"] == 65536
    # A name a pattern catches is served, so it can be retrieved too.
    claude_name = await client.models.retrieve("claude-sonnet-4-5")
    assert claude_name.id == "claude-sonnet-4-5"
    assert (claude_name.model_extra or {})["alias_of"] == MODEL


async def test_anthropic_paging(server_factory: ServerFactory) -> None:
    server = await server_factory(aliases={"a-one": MODEL, "a-two": MODEL})
    async with server.client() as http:
        first = (await http.get("/v1/models", params={"limit": 1})).json()
        rest = (await http.get("/v1/models", params={"after_id": first["last_id"]})).json()
        back = (await http.get("/v1/models", params={"before_id": "a-two", "limit": 1})).json()
        bad = await http.get("/v1/models", params={"limit": 0})
    assert [m["id"] for m in first["data"]] == [MODEL] and first["has_more"] is True
    assert [m["id"] for m in rest["data"]] == ["a-one", "a-two"] and rest["has_more"] is False
    assert [m["id"] for m in back["data"]] == ["a-one"] and back["has_more"] is True
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "limit"
    # The SDK walks the pages by itself.
    ids = [m.id async for m in server.anthropic().models.list(limit=1)]
    assert ids == [MODEL, "a-one", "a-two"]


async def test_codex_catalog_when_client_version_is_sent(server: Server) -> None:
    async with server.client() as http:
        plain = (await http.get("/v1/models")).json()
        body = (await http.get("/v1/models", params={"client_version": "0.171.0"})).json()
    assert "models" not in plain
    assert body["data"] == plain["data"]  # still the OpenAI / Anthropic list
    [info] = body["models"]
    assert CODEX_REQUIRED <= info.keys()
    assert info["slug"] == MODEL and info["visibility"] == "list"
    assert info["context_window"] == info["max_context_window"] == 65536
    assert info["input_modalities"] == ["text"]
    # The embedded model's template can think: Codex may turn it off ("none").
    assert [level["effort"] for level in info["supported_reasoning_levels"]] == ["none", "medium"]
    assert info["default_reasoning_level"] == "medium"
    assert isinstance(info["prefer_websockets"], bool)
