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
from typing import Any

import trio

from .engine.distributed.world import SOLO, World, join_world
from .http.security import is_loopback_name
from .launch import add_parser as add_launch_parser
from .launch import run as run_launch
from .logs import configure_logging
from .settings import Settings, SettingsError, parse_aliases, parse_setting

log = logging.getLogger("mlxtrio")


HELP = {
    "model": "model path or hub id (default: the embedded model)",
    "model_name": "public name of --model",
    "capacity": "concurrent sequences per model (0: auto, from the model and the memory)",
    "models_dir": "serve every mlx-lm model in this directory, loaded on first use",
    "max_loaded_models": "models loaded at once (0: the memory budget decides)",
    "keep_alive_seconds": "idle seconds before a model is unloaded (0: never)",
    "model_keep_alive": "per-model keep-alive, name=seconds, comma-separated",
    "pinned_models": "models never unloaded, comma-separated",
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
    "speculation": "speculative decoding: auto (where it measures faster), on, off",
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
    add_setting_flags(serve)
    models = sub.add_parser(
        "models", help="list the models this configuration serves, and their states"
    )
    add_setting_flags(models)
    add_launch_parser(sub)
    return parser


def add_setting_flags(parser: argparse.ArgumentParser) -> None:
    """One flag per setting (derived from :class:`Settings`, so the two
    cannot drift apart)."""
    for field in dataclasses.fields(Settings):
        if field.name in REPEATABLE:
            flag, text = REPEATABLE[field.name]
            parser.add_argument(flag, action="append", dest=field.name, help=text)
            continue
        kind = {"int": int, "float": float}.get(str(field.type), str)
        parser.add_argument(
            "--" + field.name.replace("_", "-"),
            type=kind,
            dest=field.name,
            help=HELP.get(field.name),
        )


def settings_from_args(args: argparse.Namespace) -> Settings:
    overrides = {
        f.name: _flag_value(f, getattr(args, f.name, None))
        for f in dataclasses.fields(Settings)
        if f.name not in REPEATABLE
    }
    if getattr(args, "extra_models", None):
        overrides["extra_models"] = tuple(args.extra_models)
    if getattr(args, "aliases", None):
        overrides["aliases"] = parse_aliases(",".join(args.aliases))
    return Settings.from_env(**overrides)


def _flag_value(field: dataclasses.Field[Any], value: Any) -> Any:
    """A flag's text as the setting's type (lists and maps are comma-separated)."""
    kind = str(field.type)
    if isinstance(value, str) and kind.startswith(("tuple", "Mapping", "bool")):
        return parse_setting(field.name, kind, value)
    return value


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
        print_models(settings)
        return 0
    if args.command == "launch":
        return run_launch(args, settings)
    return _serve_rank(settings)


def print_models(settings: Settings) -> None:
    """The servable models as a table: their states as the server running at
    the configured address reports them, else ``available``."""
    from .serving.catalog import discover

    states = _served_states(settings)
    rows = [("NAME", "STATE", "SIZE", "CONTEXT", "FAMILY", "PATH")]
    for spec in discover(settings):
        rows.append(
            (
                spec.name,
                states.get(spec.name, "available"),
                f"{spec.size_bytes / (1 << 30):.2f} GiB" if spec.size_bytes else "-",
                str(spec.context or "-"),
                spec.family or "-",
                spec.path,
            )
        )
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]) - 1)]
    for row in rows:
        print(
            "  ".join(cell.ljust(width) for cell, width in zip(row, widths, strict=False))
            + "  "
            + row[-1]
        )


def _served_states(settings: Settings) -> dict[str, str]:
    """Each model's state as a server answering on the configured address
    says (empty when none answers)."""
    import json
    import urllib.request

    request = urllib.request.Request(f"http://{settings.host}:{settings.port}/v1/models")
    if settings.api_key:
        request.add_header("x-api-key", settings.api_key.split(",")[0])
    try:
        with urllib.request.urlopen(request, timeout=1.0) as answer:
            body = json.load(answer)
    except (OSError, ValueError):
        return {}
    return {m["id"]: m.get("state", "loaded") for m in body.get("data", []) if "id" in m}


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
    if world.distributed and (settings.extra_models or settings.models_dir):
        log.error(
            "%s: a model served across ranks is served alone, loaded at start; models on "
            "demand are not available across ranks",
            "extra_models" if settings.extra_models else "models_dir",
        )
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
