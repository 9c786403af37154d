"""The ASGI application.

``hypercorn -k trio mlxtrio.app:app`` serves the module-level ``app``, built from
the environment (``MLXTRIO_*``). ``create_app(settings)`` builds one explicitly
(the CLI and the tests do).
"""

from __future__ import annotations

import logging
import sys
from typing import Any

import sniffio
from quart_trio import QuartTrio

from .api import chat_completions, health, messages, models, responses
from .engine.distributed.world import SOLO, World
from .http import access_log, transport
from .lifecycle import drain_with_hypercorn, exit_hypercorn
from .logs import configure_logging
from .serving.call import open_call_scope
from .serving.services import Services
from .settings import Settings

log = logging.getLogger("mlxtrio")

EXIT_WRONG_WORKER = 3

TRIO_WORKER_HINT = (
    "mlxtrio needs hypercorn's trio worker: run `hypercorn -k trio mlxtrio.app:app` "
    "(or `mlxtrio serve`)"
)


class MlxtrioApp(QuartTrio):
    """QuartTrio with a per-request scope and a guard against the asyncio worker.

    Every HTTP request and WebSocket connection runs as one call
    (:func:`~mlxtrio.serving.call.open_call_scope`): its streaming producers live
    in the call's nursery, which is cancelled once the response is finished or
    the client went away, and the callbacks registered with ``on_call_end`` run
    then, whether or not a streaming body was ever started.
    """

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        if _async_library() != "trio":
            await _refuse_non_trio(scope, receive, send)
            return
        if scope["type"] not in ("http", "websocket"):
            await super().__call__(scope, receive, send)
            return
        record = access_log.AccessRecord(scope.get("method", "WS"), scope.get("path", "?"))

        async def send_noting_status(message: dict[str, Any]) -> None:
            if message["type"] == "http.response.start":
                record.status = message["status"]
                record.stream = any(
                    name.lower() == b"content-type" and value.startswith(b"text/event-stream")
                    for name, value in message.get("headers", ())
                )
            elif message["type"] == "websocket.accept":
                record.status = 101
            elif message["type"] == "websocket.http.response.start":  # a refused handshake
                record.status = message["status"]
            await send(message)

        async with open_call_scope(self.extensions["mlxtrio"], record):
            await super().__call__(scope, receive, send_noting_status)  # type: ignore[arg-type]


def _async_library() -> str:
    try:
        return sniffio.current_async_library()
    except sniffio.AsyncLibraryNotFoundError:
        return "unknown"


async def _refuse_non_trio(scope: Any, receive: Any, send: Any) -> None:
    """Under another event loop: fail start-up with one clear line, and answer any
    request that still arrives with a plain 500 naming the fix."""
    if scope["type"] == "lifespan":
        message = await receive()
        if message["type"] == "lifespan.startup":
            # One clear line, then leave: hypercorn would add a traceback to a
            # lifespan failure, and a server that cannot serve must not start.
            print(f"error: {TRIO_WORKER_HINT}", file=sys.stderr, flush=True)
            exit_hypercorn(EXIT_WRONG_WORKER)
        return
    if scope["type"] == "http":
        body = TRIO_WORKER_HINT.encode()
        await send(
            {
                "type": "http.response.start",
                "status": 500,
                "headers": [(b"content-type", b"text/plain")],
            }
        )
        await send({"type": "http.response.body", "body": body})


def create_app(settings: Settings | None = None, world: World = SOLO) -> MlxtrioApp:
    """The app for ``settings`` (default: from the environment); ``world``:
    the ranks its model is sharded across (``mlxtrio serve`` under
    ``mlx.launch``; this process is rank 0)."""
    settings = settings or Settings.from_env()
    app = MlxtrioApp("mlxtrio")
    app.config.update(
        RESPONSE_TIMEOUT=None,  # long streams are bounded by our drain deadline instead
        BODY_TIMEOUT=60,
        MAX_CONTENT_LENGTH=settings.max_body_bytes,
        JSON_SORT_KEYS=False,
        PROVIDE_AUTOMATIC_OPTIONS=False,
    )
    app.json.sort_keys = False  # type: ignore[attr-defined]
    app.json.ensure_ascii = False  # type: ignore[attr-defined]
    services = Services(settings, world)
    app.extensions["mlxtrio"] = services
    transport.install(app, settings.api_key, settings.cors_origins, settings.allowed_hosts)
    for blueprint in (
        health.blueprint,
        models.blueprint,
        *responses.BLUEPRINTS,
        messages.blueprint,
        chat_completions.blueprint,
    ):
        app.register_blueprint(blueprint)
    _count_requests(app, services)

    @app.before_serving
    async def _start() -> None:
        services.start(app.nursery)
        await services.open_store(app.nursery)
        app.nursery.start_soon(drain_with_hypercorn, services.drain, settings.shutdown_grace)

    @app.after_serving
    async def _stop() -> None:
        await services.stop()

    return app


def _count_requests(app: MlxtrioApp, services: Services) -> None:
    from quart import Response, request

    @app.after_request
    async def _count(response: Response) -> Response:
        rule = request.url_rule.rule if request.url_rule is not None else "unmatched"
        services.metrics.requests.labels(rule, request.method, str(response.status_code)).inc()
        return response


def _module_app() -> MlxtrioApp:
    settings = Settings.from_env()
    configure_logging(settings.log_level)
    return create_app(settings)


app = _module_app()
