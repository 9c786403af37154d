"""Logging set-up shared by ``mlxtrio serve`` and ``hypercorn mlxtrio.app:app``."""

from __future__ import annotations

import logging

# Libraries whose lines are noise to a user of the server, and the level from
# which they are shown. transformers warns once per tokenizer that a long agent
# prompt is "longer than the specified maximum sequence length" of a config
# field the server does not use.
QUIET_LOGGERS = {
    "alembic": logging.WARNING,
    "httpx": logging.WARNING,
    "urllib3": logging.WARNING,
    "filelock": logging.WARNING,
    "huggingface_hub": logging.WARNING,
    "transformers": logging.ERROR,
}


def configure_logging(level: str, rank: int | None = None) -> None:
    """The server's log format at ``level``; library chatter quieter. Each
    line names its ``rank`` when the model is served across ranks (a launcher
    merges their output)."""
    where = "" if rank is None else f"[rank {rank}] "
    if not logging.getLogger().handlers:
        logging.basicConfig(
            level=level.upper(), format=f"%(asctime)s {where}%(levelname)s %(name)s: %(message)s"
        )
    root_level = logging.getLogger().level
    for name, floor in QUIET_LOGGERS.items():
        logging.getLogger(name).setLevel(max(floor, root_level))
    # Under hypercorn's own command line its error logger already has a handler
    # of its own: passing its lines on to ours as well printed each twice.
    # (``mlxtrio serve`` hands hypercorn this logger, with no handler of its own.)
    hypercorn = logging.getLogger("hypercorn.error")
    if hypercorn.handlers:
        hypercorn.propagate = False
