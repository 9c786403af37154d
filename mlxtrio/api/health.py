"""Liveness and observability: ``/health``, ``/`` and ``/metrics``."""

from __future__ import annotations

from typing import Any

from quart import Blueprint, Response, jsonify

from .. import blas
from ..engine.engine import EngineState
from ..metrics import CONTENT_TYPE
from ..serving.call import services
from ..serving.residency import Resident

blueprint = Blueprint("health", __name__)

# Which BLAS MLX's CPU backend multiplies with (settled when mlxtrio was imported).
BLAS = blas.describe()


@blueprint.route("/health", methods=["GET"])
@blueprint.route("/v1/health", methods=["GET"])
async def health() -> Response:
    svc = services()
    models = [_model(resident) for resident in svc.models]
    serving = [r.engine for r in svc.models if r.engine is not None]
    ok = bool(serving) and all(e.state is EngineState.READY for e in serving)
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


def _model(resident: Resident) -> dict[str, Any]:
    """One served model: its state and, while loaded, its engine's figures;
    while loading, how many bytes of its weights were read of the total."""
    engine = resident.engine
    entry: dict[str, Any] = {"id": resident.name, "state": resident.state.value}
    if engine is None:
        return entry
    loaded = engine.loaded
    progress = engine.load_progress
    entry.update(
        {
            "state": engine.state.value,
            "error": engine.error,
            "load_seconds": loaded.load_seconds if loaded else None,
            "dtype": loaded.dtype if loaded else None,
            "active_sequences": engine.active_sequences,
            "queued_requests": resident.lane.waiting,
            "capacity": resident.lane.capacity,
            "steps": engine.stats.steps,
            "speculation": _speculation(engine.stats),
        }
    )
    if loaded is None and progress.total_bytes:
        entry["load"] = {"read_bytes": progress.done_bytes, "total_bytes": progress.total_bytes}
    return entry


def _speculation(stats: Any) -> dict[str, Any]:
    """The mode in force (with why it is off, when it cannot be on), the
    acceptance rate of the drafts so far, and the decode rates measured per
    batch width with and without drafts (what ``auto`` decides from)."""
    mode, _, reason = stats.speculation.partition(": ")
    out: dict[str, Any] = {"mode": mode, "reason": reason or None}
    # Accepted first: the engine thread adds to both, drafts first.
    accepted, drafted = stats.accepted_tokens, stats.draft_tokens
    out["draft_tokens"], out["accepted_tokens"] = drafted, accepted
    out["acceptance_rate"] = round(accepted / drafted, 3) if drafted else None
    switch = stats.speculation_switch
    if switch is not None and mode != "off":
        out["batch_widths"] = switch.describe()
    return out


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
        engine = svc.models.default.engine
        assert engine is not None
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
