"""Liveness and observability: ``/health``, ``/`` and ``/metrics``."""

from __future__ import annotations

from typing import Any

from quart import Blueprint, Response, jsonify

from .. import blas
from ..engine.engine import EngineState
from ..metrics import CONTENT_TYPE
from ..serving.call import services

blueprint = Blueprint("health", __name__)

# Which BLAS MLX's CPU backend multiplies with (settled when mlxtrio was imported).
BLAS = blas.describe()


@blueprint.route("/health", methods=["GET"])
@blueprint.route("/v1/health", methods=["GET"])
async def health() -> Response:
    svc = services()
    models = []
    for engine in svc.registry:
        lane = svc.lanes[engine.name]
        loaded = engine.loaded
        models.append(
            {
                "id": engine.name,
                "state": engine.state.value,
                "error": engine.error,
                "load_seconds": loaded.load_seconds if loaded else None,
                "dtype": loaded.dtype if loaded else None,
                "active_sequences": engine.active_sequences,
                "queued_requests": lane.waiting,
                "capacity": lane.capacity,
                "steps": engine.stats.steps,
            }
        )
    ok = all(e.state is EngineState.READY for e in svc.registry)
    body = {
        "status": "ok" if ok else "unavailable",
        "models": models,
        "blas": BLAS,
        "memory": svc.memory.describe(),
        "world": _world(svc),
    }
    response = jsonify(body)
    response.status_code = 200 if ok else 503
    return response


@blueprint.route("/", methods=["GET", "HEAD"])
async def root() -> Response:
    return jsonify({"name": "mlxtrio", "status": "ok"})


@blueprint.route("/metrics", methods=["GET"])
async def metrics() -> Response:
    return Response(services().metrics.render(), content_type=CONTENT_TYPE)


def _world(svc: Any) -> dict[str, Any]:
    """The ranks the model is served across: their number and, when there
    are several, each one's state as of the latest lock-step round."""
    world: dict[str, Any] = {"size": svc.world.size}
    if svc.world.distributed:
        engine = svc.registry.default
        pids = engine.rank_pids
        world["ranks"] = [
            {
                "rank": rank.rank,
                "pid": pids[rank.rank] if rank.rank < len(pids) else None,
                "active_sequences": rank.live,
                "steps": rank.steps,
                "kv_snapshots": rank.snapshots,
            }
            for rank in engine.ranks
        ]
    return world
