"""``mlxtrio serve``: run the server through hypercorn's trio API.

Flags override ``MLXTRIO_*`` environment variables, which override defaults.
"""

from __future__ import annotations

import argparse
import dataclasses
import logging
import os
import signal
import sys
from collections.abc import Sequence

import trio

from .engine.distributed.world import SOLO, World, join_world
from .http.security import is_loopback_name
from .logs import configure_logging
from .settings import Settings, SettingsError, parse_aliases

log = logging.getLogger("mlxtrio")


HELP = {
    "model": "model path or hub id (default: the embedded model)",
    "model_name": "public name of --model",
    "capacity": "concurrent sequences per model (0: auto, from the model and the memory)",
    "memory_limit_bytes": "memory for weights and admitted requests' KV across models (0: auto, 3/4 of RAM)",
    "waiting_room": "queued requests per model before 429",
    "prefix_cache_bytes": "prefix KV cache budget per model (-1 auto, 0 off)",
    "prefix_cache_disk_bytes": "its disk tier in data_dir/kv-cache per model (-1 auto, 0 off)",
    "context_length": "tokens of context served per model (0: the model's own)",
    "prefill_chunk": "most prompt tokens prefilled per engine step",
    "prefill_step_seconds": "seconds of prefill per engine step (bounds token gaps and hang-up latency)",
    "compute_dtype": "auto (float32 on a CPU with a fast BLAS), model, float32, bfloat16, float16",
    "shutdown_grace": "seconds in-flight generations get at shutdown",
    "sharding": "across ranks (mlx.launch): auto, tensor or pipeline",
    "rank_timeout": "seconds a rank may leave a lock-step round unanswered before the server exits",
    "database_url": "response store URL, or none",
}
REPEATABLE = {
    "extra_models": ("--extra-model", "another model, name=path"),
    "aliases": ("--alias", "alias=model (patterns like claude-*=NAME)"),
}


def build_parser() -> argparse.ArgumentParser:
    """`mlxtrio serve` takes one flag per setting (derived from :class:`Settings`,
    so the two cannot drift apart)."""
    parser = argparse.ArgumentParser(
        prog="mlxtrio", description="Local MLX server for coding agents"
    )
    sub = parser.add_subparsers(dest="command", required=True)
    serve = sub.add_parser("serve", help="serve the OpenAI Responses and Anthropic Messages APIs")
    for field in dataclasses.fields(Settings):
        if field.name in REPEATABLE:
            flag, text = REPEATABLE[field.name]
            serve.add_argument(flag, action="append", dest=field.name, help=text)
            continue
        kind = {"int": int, "float": float}.get(str(field.type), str)
        serve.add_argument(
            "--" + field.name.replace("_", "-"),
            type=kind,
            dest=field.name,
            help=HELP.get(field.name),
        )
    sub.add_parser("models", help="list the models this configuration would serve")
    return parser


def settings_from_args(args: argparse.Namespace) -> Settings:
    overrides = {
        f.name: getattr(args, f.name, None)
        for f in dataclasses.fields(Settings)
        if f.name not in REPEATABLE
    }
    if getattr(args, "extra_models", None):
        overrides["extra_models"] = tuple(args.extra_models)
    if getattr(args, "aliases", None):
        overrides["aliases"] = parse_aliases(",".join(args.aliases))
    return Settings.from_env(**overrides)


EXIT_FATAL = 1  # the server stopped because it could not go on (a rank was lost)
# Seconds a server that cannot go on keeps answering (503) before it closes its
# port, so health checks and load balancers see why it left.
FATAL_LINGER = 2.0


async def serve(
    settings: Settings,
    world: World = SOLO,
    *,
    task_status: trio.TaskStatus[list[str]] = trio.TASK_STATUS_IGNORED,
) -> int:
    """Serve until SIGINT or SIGTERM, then shut down gracefully; returns the
    exit status.

    On a signal: stop taking new generations (503), give in-flight ones
    ``shutdown_grace`` seconds, cancel the rest - every stream still receives its
    terminal event - then let hypercorn close the connections and the engines stop.
    The same when the server cannot go on (its model is served across ranks and
    one was lost), and the status is then :data:`EXIT_FATAL`.
    Must run in the main thread (signal handling).
    """
    from hypercorn.config import Config
    from hypercorn.trio import serve as hypercorn_serve

    from .app import create_app

    if not settings.api_key and not is_loopback_name(settings.host):
        log.warning(
            "listening on %s with no API key: anyone who can reach it can use the server "
            "(set MLXTRIO_API_KEY)",
            settings.host,
        )
    config = Config()
    config.bind = [f"{settings.host}:{settings.port}"]
    config.accesslog = None
    # hypercorn's own lines through our handler (its default adds a second
    # handler, and each line was printed twice).
    config.errorlog = logging.getLogger("hypercorn.error")
    config.graceful_timeout = settings.shutdown_grace
    # A WebSocket message carries a request body: the same limit.
    config.websocket_max_message_size = settings.max_body_bytes
    app = create_app(settings, world)
    services = app.extensions["mlxtrio"]

    async def on_signal(cancel_scope: trio.CancelScope) -> None:
        with trio.open_signal_receiver(signal.SIGINT, signal.SIGTERM) as signals:
            async for signum in signals:
                log.info(
                    "%s: finishing in-flight generations (up to %.0f s)",
                    signal.Signals(signum).name,
                    settings.shutdown_grace,
                )
                break
        cancel_scope.cancel()

    async def on_fatal(cancel_scope: trio.CancelScope) -> None:
        await services.fatal.wait()
        await trio.sleep(min(FATAL_LINGER, settings.shutdown_grace))
        cancel_scope.cancel()

    async def shutdown_trigger() -> None:
        async with trio.open_nursery() as nursery:
            nursery.start_soon(on_signal, nursery.cancel_scope)
            nursery.start_soon(on_fatal, nursery.cancel_scope)
        await services.drain()

    await hypercorn_serve(app, config, shutdown_trigger=shutdown_trigger, task_status=task_status)  # type: ignore[arg-type]
    return EXIT_FATAL if services.fatal.is_set() else 0


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        settings = settings_from_args(args)
    except SettingsError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    if args.command == "models":
        configure_logging(settings.log_level)
        from .serving.services import _model_specs

        for name, path in _model_specs(settings):
            print(f"{name}\t{path}")
        return 0
    return _serve_rank(settings)


def _serve_rank(settings: Settings) -> int:
    """Serve, as this process's rank: under ``mlx.launch`` rank 0 serves HTTP
    and every other rank its shard of the model (:mod:`.engine.distributed.follower`)."""
    try:
        world = join_world()
    except RuntimeError as exc:  # the launcher's backend could not connect the ranks
        configure_logging(settings.log_level)
        log.error("cannot join the distributed world: %s", exc)
        return 2
    configure_logging(settings.log_level, world.rank if world.distributed else None)
    if world.distributed and settings.extra_models:
        log.error("extra_models: a model served across ranks is served alone")
        return 2
    if not world.distributed:
        return trio.run(serve, settings)
    if world.leader:
        status = trio.run(serve, settings, world)
    else:
        from .engine.distributed.follower import serve_follower

        status = serve_follower(world)
    _leave_world(status)
    return status


def _leave_world(status: int) -> None:
    """End a rank's process now that its work is done and its output flushed.

    MLX's ring backend aborts the interpreter's exit (``terminate called
    without an active exception``, status 134) once its peers are gone, and
    an engine thread blocked in a collective is never coming back: leaving
    without running C++ destructors is the only clean way out."""
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(status)


if __name__ == "__main__":
    sys.exit(main())
