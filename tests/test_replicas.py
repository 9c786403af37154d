"""Replicas: two servers sharing one PostgreSQL store, as behind a load
balancer. A `previous_response_id` chain started on one continues on the
other, and blobs one seals (reasoning, compactions) the other reads: the
sealing key lives in the store, not in each server's data dir."""

from __future__ import annotations

from pathlib import Path

import openai
import pytest
import trio

from .conftest import SCRIPTED, Server, start_server
from .test_responses_compact import compact
from .test_responses_store import WEATHER, answer_weather
from .test_store_faults import PG, PG_HOST, PG_PORT, pg_database  # noqa: F401 - a fixture

pytestmark = pytest.mark.skipif(not PG, reason="no PostgreSQL on 127.0.0.1:5432")


async def _two_replicas(
    nursery: trio.Nursery, model: str, tmp_path: Path, database: str
) -> tuple[Server, Server]:
    """Two servers on one PostgreSQL database, each with its own data dir."""
    url = f"postgresql://postgres@{PG_HOST}:{PG_PORT}/{database}"
    common = {"model": model, "model_name": SCRIPTED, "database_url": url}
    a = await start_server(nursery, data_dir=str(tmp_path / "a"), **common)
    b = await start_server(nursery, data_dir=str(tmp_path / "b"), **common)
    return a, b


async def test_two_replicas_share_chains_and_sealed_blobs(
    scripted_model_path: str,
    tmp_path: Path,
    pg_database: str,  # noqa: F811 - the fixture imported above
) -> None:
    async with trio.open_nursery() as nursery:
        a, b = await _two_replicas(nursery, scripted_model_path, tmp_path, pg_database)
        async with a.openai() as on_a, b.openai() as on_b:
            first = await on_a.responses.create(
                model=SCRIPTED, input="Weather?", tools=[WEATHER], instructions="Rules."
            )
            second = await answer_weather(on_b, first)
            assert second.output_text == "It is sunny." and second.instructions == "Rules."
            assert (await on_a.responses.retrieve(second.id)).output_text == "It is sunny."
            summary = (await compact(on_a, model=SCRIPTED, input="Hi!"))["output"][-1]
        async with b.client() as client:
            r = await client.post(
                "/v1/responses",
                json={"model": SCRIPTED, "input": [summary, {"role": "user", "content": "Go on."}]},
            )
        nursery.cancel_scope.cancel()
    assert r.status_code == 200, r.text  # B reads the compaction A sealed
    keys = {(tmp_path / name / "reasoning.key").read_bytes() for name in ("a", "b")}
    assert len(keys) == 2  # each data dir has its own file; the store's key is shared


async def test_replicas_share_retention_and_deletion(
    scripted_model_path: str,
    tmp_path: Path,
    pg_database: str,  # noqa: F811 - the fixture imported above
) -> None:
    """What one replica stores expires on its own clock in the shared store
    (a sweep on either removes it), and a deletion on one is seen by all."""
    async with trio.open_nursery() as nursery:
        a, b = await _two_replicas(nursery, scripted_model_path, tmp_path, pg_database)
        async with a.openai() as on_a, b.openai() as on_b:
            short = await on_a.responses.create(
                model=SCRIPTED,
                input="hi",
                metadata={"retention_seconds": 60},  # type: ignore[dict-item]
            )
            kept = await on_a.responses.create(model=SCRIPTED, input="hi")
            assert (await on_b.responses.retrieve(short.id)).id == short.id
            store_b = b.services.store
            assert store_b is not None
            assert await store_b.sweep(now=int(short.created_at) + 59) == 0
            assert await store_b.sweep(now=int(short.created_at) + 61) == 1
            with pytest.raises(openai.NotFoundError):
                await on_a.responses.retrieve(short.id)
            await on_b.responses.delete(kept.id)
            with pytest.raises(openai.NotFoundError):
                await on_a.responses.retrieve(kept.id)
        nursery.cancel_scope.cancel()
