"""``mlxtrio serve``: run the server through hypercorn's trio API.

Flags override ``MLXTRIO_*`` environment variables, which override defaults.
"""

from __future__ import annotations

import argparse
import dataclasses
import logging
import signal
import sys
from collections.abc import Sequence

import trio

from .http.security import is_loopback_name
from .logs import configure_logging
from .settings import Settings, SettingsError, parse_aliases

log = logging.getLogger("mlxtrio")


HELP = {
    "model": "model path or hub id (default: the embedded model)",
    "model_name": "public name of --model",
    "capacity": "concurrent sequences per model",
    "waiting_room": "queued requests per model before 429",
    "prefix_cache_bytes": "prefix KV cache budget per model (-1 auto, 0 off)",
    "prefix_cache_disk_bytes": "its disk tier in data_dir/kv-cache per model (-1 auto, 0 off)",
    "context_length": "tokens of context served per model (0: the model's own)",
    "prefill_chunk": "most prompt tokens prefilled per engine step",
    "prefill_step_seconds": "seconds of prefill per engine step (bounds token gaps and hang-up latency)",
    "compute_dtype": "auto (float32 on a CPU with a fast BLAS), model, float32, bfloat16, float16",
    "shutdown_grace": "seconds in-flight generations get at shutdown",
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


async def serve(
    settings: Settings, *, task_status: trio.TaskStatus[list[str]] = trio.TASK_STATUS_IGNORED
) -> None:
    """Serve until SIGINT or SIGTERM, then shut down gracefully.

    On a signal: stop taking new generations (503), give in-flight ones
    ``shutdown_grace`` seconds, cancel the rest - every stream still receives its
    terminal event - then let hypercorn close the connections and the engines stop.
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
    config.graceful_timeout = settings.shutdown_grace
    # A WebSocket message carries a request body: the same limit.
    config.websocket_max_message_size = settings.max_body_bytes
    app = create_app(settings)
    services = app.extensions["mlxtrio"]

    async def shutdown_trigger() -> None:
        with trio.open_signal_receiver(signal.SIGINT, signal.SIGTERM) as signals:
            async for signum in signals:
                log.info(
                    "%s: finishing in-flight generations (up to %.0f s)",
                    signal.Signals(signum).name,
                    settings.shutdown_grace,
                )
                break
        await services.drain()

    await hypercorn_serve(app, config, shutdown_trigger=shutdown_trigger, task_status=task_status)  # type: ignore[arg-type]


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        settings = settings_from_args(args)
    except SettingsError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    configure_logging(settings.log_level)
    if args.command == "models":
        from .services import _model_specs

        for name, path in _model_specs(settings):
            print(f"{name}\t{path}")
        return 0
    trio.run(serve, settings)
    return 0


if __name__ == "__main__":
    sys.exit(main())
