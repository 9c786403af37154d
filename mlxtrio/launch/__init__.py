"""``mlxtrio launch claude|codex|opencode``: run a coding agent against this
server, with everything set for the served model.

    mlxtrio launch claude [--model M] [--print-config] [-- claude's own args]

A server already answering on the configured address is used as it is (its
``/health`` says which models it serves and whether they are ready);
otherwise one is started as a child process (``python -m mlxtrio serve``, its
log in ``data_dir/launch-PORT.log``) and stopped when the agent exits. While
the model loads, its state (and any load progress ``/health`` reports) is
shown; a server that exits, a model that fails, or one not ready within
``--load-timeout`` seconds ends the launch with a clear error.

Each agent is configured from the outside only, for this run, from what the
server reports (``GET /v1/models/{name}``: context window and output cap):

* **Claude Code**: environment variables (``ANTHROPIC_BASE_URL``, a bearer
  token so no login or API-key prompt appears, every model slot mapped to the
  served name, the real context and output cap, generous stream timeouts for
  slow prefill, no non-essential traffic). ``~/.claude.json`` is not touched.
* **Codex**: ``-c`` overrides only (a ``mlxtrio`` model provider on the
  Responses API over WebSocket, with the server's model catalog);
  ``~/.codex`` is not written by launch.
* **OpenCode**: ``OPENCODE_CONFIG_CONTENT`` (the highest-precedence config
  layer) with an ``@ai-sdk/openai-compatible`` provider, and ``-m`` for the
  TUI and ``opencode run``.

The agent binary is the one on ``PATH``, or ``$MLXTRIO_AGENT_BIN_<NAME>``
(e.g. ``MLXTRIO_AGENT_BIN_CLAUDE``). Arguments after ``--`` go to the agent
unchanged; launch returns the agent's exit status. ``--print-config`` prints
the address, environment and argv it would use, and starts nothing.

This module imports nothing of the server (no MLX, no Trio): only
:mod:`mlxtrio.settings` and the standard library.
"""

from .agents import (
    AGENTS,
    BIN_OVERRIDE,
    KEY_VARIABLE,
    SETTINGS_OPTIONS,
    AgentPlan,
    LaunchError,
    Target,
    find_agent,
    plan,
)
from .command import Invocation, add_parser, main, parse_invocation, run
from .server import ServerProcess, client_url, describe_load, serve_argv

__all__ = [
    "AGENTS",
    "BIN_OVERRIDE",
    "KEY_VARIABLE",
    "SETTINGS_OPTIONS",
    "AgentPlan",
    "Invocation",
    "LaunchError",
    "ServerProcess",
    "Target",
    "add_parser",
    "client_url",
    "describe_load",
    "find_agent",
    "main",
    "parse_invocation",
    "plan",
    "run",
    "serve_argv",
]
