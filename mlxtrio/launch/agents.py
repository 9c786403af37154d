"""What each agent CLI needs to run against this server: its environment
and arguments (:func:`plan`), found on ``PATH`` (:func:`find_agent`)."""

from __future__ import annotations

import json
import os
import shlex
import shutil
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from ..settings import Settings

AGENTS = ("claude", "codex", "opencode")
NPM_PACKAGES = {
    "claude": "@anthropic-ai/claude-code",
    "codex": "@openai/codex",
    "opencode": "opencode-ai",
}
BIN_OVERRIDE = "MLXTRIO_AGENT_BIN_"  # + the agent's name in capitals
# The variable Codex (env_key) and OpenCode ({env:...}) read the API key from:
# not MLXTRIO_API_KEY, so that nothing the agent runs mistakes it for the
# server's own setting.
KEY_VARIABLE = "MLXTRIO_LAUNCH_API_KEY"
PLACEHOLDER_KEY = "unused"  # sent when the server takes any key
PROVIDER = "mlxtrio"  # the provider id in Codex's and OpenCode's configs

# Slow prefill: Claude Code's first prompt is ~34k tokens, which can take
# minutes on a CPU. 30 minutes is the most Claude Code's byte watchdog takes.
SLOW_TIMEOUT_MS = 1_800_000
# Claude Code compacts at context - min(output cap, 20k) - 13k tokens and its
# own system prompt and tools take ~34k: below 64k it cannot work.
CLAUDE_MIN_CONTEXT = 65536
CLAUDE_COMPACT_RESERVE = 13_000
CLAUDE_COMPACT_OUTPUT_CAP = 20_000

LOAD_TIMEOUT = 900.0  # seconds to wait for a model to be ready
PROBE_TIMEOUT = 2.0  # seconds for one request to the server
POLL_INTERVAL = 0.25
STOP_MARGIN = 10.0  # seconds past shutdown_grace before the server is killed

# /health model states: serving (or loadable on the first request), and gone.
READY_STATES = frozenset({"ready", "loaded", "available"})
FAILED_STATES = frozenset({"failed", "stopped", "stopping"})

# Options of `mlxtrio launch` that are settings (the rest are launch's own).
SETTINGS_OPTIONS = ("model", "model_name", "host", "port", "context_length")

# Claude Code variables that would send its requests elsewhere or ask about a
# key (an ANTHROPIC_API_KEY makes the TUI ask whether to use it).
CLAUDE_UNSET = (
    "ANTHROPIC_API_KEY",
    "CLAUDE_CODE_OAUTH_TOKEN",
    "ANTHROPIC_UNIX_SOCKET",
    "CLAUDE_CODE_USE_BEDROCK",
    "CLAUDE_CODE_USE_VERTEX",
    "CLAUDE_CODE_USE_FOUNDRY",
    "CLAUDE_CODE_USE_MANTLE",
    "CLAUDE_CODE_USE_ANTHROPIC_AWS",
    "CLAUDE_CODE_USE_ANTHROPIC_GOOGLE_CLOUD",
)
CLAUDE_MODEL_SLOTS = (
    "ANTHROPIC_MODEL",
    "ANTHROPIC_DEFAULT_OPUS_MODEL",
    "ANTHROPIC_DEFAULT_SONNET_MODEL",
    "ANTHROPIC_DEFAULT_HAIKU_MODEL",
    "ANTHROPIC_DEFAULT_FABLE_MODEL",
    "ANTHROPIC_SMALL_FAST_MODEL",
    "CLAUDE_CODE_SUBAGENT_MODEL",
)
# OpenCode's subcommands; all but `run` (and the default TUI) take no -m.
OPENCODE_COMMANDS = frozenset(
    "acp agent attach auth completion db debug export github import mcp models plug plugin pr "
    "providers run serve session stats uninstall upgrade web".split()
)


class LaunchError(Exception):
    """Launch cannot go on; the message says why and what to do."""


# ---------------------------------------------------------------------------
# What the agent is pointed at, and what it is given


@dataclass(frozen=True)
class Target:
    """The server and model an agent is pointed at."""

    url: str  # http://127.0.0.1:8000, no trailing slash
    model: str  # the served name (or an alias) the agent asks for
    context: int | None  # tokens of context served (None: not known yet)
    output: int | None  # the agent's output cap in tokens
    api_key: str = field(default="", repr=False)  # "" when the server takes any

    @property
    def key(self) -> str:
        return self.api_key or PLACEHOLDER_KEY


@dataclass
class AgentPlan:
    """How one agent is run: its argv and the changes to its environment."""

    agent: str
    argv: list[str]
    set_env: dict[str, str]
    unset_env: tuple[str, ...] = ()
    secret_env: frozenset[str] = frozenset()  # names whose values are not printed
    warnings: list[str] = field(default_factory=list)

    def environment(self, base: Mapping[str, str]) -> dict[str, str]:
        env = {k: v for k, v in base.items() if k not in self.unset_env}
        env.update(self.set_env)
        return env

    def shell_lines(self) -> list[str]:
        """The plan as shell lines (secrets left out, as comments)."""
        lines = []
        if self.unset_env:
            lines.append("unset " + " ".join(self.unset_env))
        for name, value in self.set_env.items():
            if name in self.secret_env:
                lines.append(f"# export {name}=<the server's API key: not shown>")
            else:
                lines.append(f"export {name}={shlex.quote(value)}")
        lines.append(shlex.join(self.argv))
        return lines


def output_cap(settings: Settings, served_output: int | None, context: int | None) -> int:
    """The output cap agents are told: the server's default per request
    (``default_max_tokens``), within what it serves."""
    cap = settings.default_max_tokens
    for limit in (served_output or settings.max_output_tokens, context):
        if limit:
            cap = min(cap, limit)
    return cap


def plan_claude(target: Target, binary: str, args: Sequence[str]) -> AgentPlan:
    env = {
        "ANTHROPIC_BASE_URL": target.url,
        "ANTHROPIC_AUTH_TOKEN": target.key,
    }
    env.update({name: target.model for name in CLAUDE_MODEL_SLOTS})
    if target.context:
        env["CLAUDE_CODE_MAX_CONTEXT_TOKENS"] = str(target.context)
    if target.output:
        env["CLAUDE_CODE_MAX_OUTPUT_TOKENS"] = str(target.output)
    env.update(
        {
            "API_TIMEOUT_MS": str(SLOW_TIMEOUT_MS),
            "CLAUDE_STREAM_IDLE_TIMEOUT_MS": str(SLOW_TIMEOUT_MS),
            "CLAUDE_CODE_DISABLE_NONESSENTIAL_TRAFFIC": "1",
            "DISABLE_TELEMETRY": "1",
            "DISABLE_ERROR_REPORTING": "1",
        }
    )
    warnings = []
    if target.context and target.context < CLAUDE_MIN_CONTEXT:
        threshold = (
            target.context
            - min(target.output or CLAUDE_COMPACT_OUTPUT_CAP, CLAUDE_COMPACT_OUTPUT_CAP)
            - CLAUDE_COMPACT_RESERVE
        )
        warnings.append(
            f"the served context ({target.context} tokens) is below the ~{CLAUDE_MIN_CONTEXT // 1024}k "
            f"Claude Code needs: its own system prompt and tools take ~34k tokens and it "
            f"compacts at {threshold} tokens; serve a longer context "
            "(--context-length, or a model with a longer one)"
        )
    if target.model.startswith("claude-"):
        warnings.append(
            f"Claude Code ignores CLAUDE_CODE_MAX_CONTEXT_TOKENS for names starting with "
            f"claude- ({target.model}): serve the model under another name (--model-name)"
        )
    secret = frozenset({"ANTHROPIC_AUTH_TOKEN"} if target.api_key else ())
    return AgentPlan("claude", [binary, *args], env, CLAUDE_UNSET, secret, warnings)


def toml_value(value: Any) -> str:
    """``value`` as a TOML value (strings, ints, booleans, inline tables)."""
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, int):
        return str(value)
    if isinstance(value, str):
        return json.dumps(value)  # a JSON string is a TOML basic string
    if isinstance(value, Mapping):
        return "{" + ", ".join(f"{k}={toml_value(v)}" for k, v in value.items()) + "}"
    raise TypeError(f"no TOML for {value!r}")


def codex_provider(target: Target) -> dict[str, Any]:
    return {
        "name": PROVIDER,
        "base_url": target.url + "/v1",
        "wire_api": "responses",
        "env_key": KEY_VARIABLE,
        # Codex reads each model's context window and reasoning levels here
        # (GET /v1/models?client_version=...), when it has a key.
        "model_catalog_url": target.url + "/v1/models",
        "supports_websockets": True,
        "stream_idle_timeout_ms": SLOW_TIMEOUT_MS,
    }


def plan_codex(target: Target, binary: str, args: Sequence[str]) -> AgentPlan:
    overrides: list[tuple[str, Any]] = [
        ("model_provider", PROVIDER),
        (f"model_providers.{PROVIDER}", codex_provider(target)),
        ("model", target.model),
    ]
    if target.context:
        overrides.append(("model_context_window", target.context))
    argv = [binary]
    for key, value in overrides:
        argv += ["-c", f"{key}={toml_value(value)}"]
    secret = frozenset({KEY_VARIABLE} if target.api_key else ())
    # The agent's own arguments come last: a later -c wins.
    return AgentPlan("codex", [*argv, *args], {KEY_VARIABLE: target.key}, (), secret)


def opencode_config(target: Target) -> dict[str, Any]:
    model: dict[str, Any] = {"name": target.model}
    if target.context and target.output:
        model["limit"] = {"context": target.context, "output": target.output}
    return {
        "$schema": "https://opencode.ai/config.json",
        "provider": {
            PROVIDER: {
                "npm": "@ai-sdk/openai-compatible",
                "name": PROVIDER,
                "options": {
                    "baseURL": target.url + "/v1",
                    # OpenCode substitutes {env:...} here too: the key stays
                    # out of the config text.
                    "apiKey": "{env:" + KEY_VARIABLE + "}",
                    "headerTimeout": SLOW_TIMEOUT_MS,
                    "chunkTimeout": SLOW_TIMEOUT_MS,
                },
                "models": {target.model: model},
            }
        },
        "model": f"{PROVIDER}/{target.model}",
        "small_model": f"{PROVIDER}/{target.model}",
    }


def opencode_args(model: str, args: Sequence[str]) -> list[str]:
    """``args`` with ``-m provider/model`` where it is taken: before them for
    the TUI (``opencode [project]``), after ``run`` for ``opencode run``;
    not at all when they name a model already or another subcommand."""
    args = list(args)
    if any(a in ("-m", "--model") or a.startswith("--model=") for a in args):
        return args
    choice = ["-m", f"{PROVIDER}/{model}"]
    if args and args[0] == "run":
        return ["run", *choice, *args[1:]]
    if args and args[0] in OPENCODE_COMMANDS:
        return args
    return [*choice, *args]


def plan_opencode(target: Target, binary: str, args: Sequence[str]) -> AgentPlan:
    env = {
        "OPENCODE_CONFIG_CONTENT": json.dumps(opencode_config(target), separators=(",", ":")),
        KEY_VARIABLE: target.key,
        # No models.dev catalog fetch or update check: the provider is here.
        "OPENCODE_DISABLE_MODELS_FETCH": "1",
        "OPENCODE_DISABLE_AUTOUPDATE": "1",
    }
    secret = frozenset({KEY_VARIABLE} if target.api_key else ())
    argv = [binary, *opencode_args(target.model, args)]
    return AgentPlan("opencode", argv, env, (), secret)


PLANNERS: dict[str, Callable[[Target, str, Sequence[str]], AgentPlan]] = {
    "claude": plan_claude,
    "codex": plan_codex,
    "opencode": plan_opencode,
}


def plan(agent: str, target: Target, binary: str, args: Sequence[str] = ()) -> AgentPlan:
    return PLANNERS[agent](target, binary, args)


def find_agent(agent: str, environ: Mapping[str, str] | None = None) -> str | None:
    """The agent's executable: ``$MLXTRIO_AGENT_BIN_<NAME>``, else on PATH."""
    environ = os.environ if environ is None else environ
    override = environ.get(BIN_OVERRIDE + agent.upper())
    if override:
        found = shutil.which(override)
        return found or None
    return shutil.which(agent, path=environ.get("PATH"))


def install_hint(agent: str) -> str:
    return (
        f"{agent} is not installed (not on PATH): npm install -g {NPM_PACKAGES[agent]} "
        f"(or set {BIN_OVERRIDE}{agent.upper()} to its path)"
    )


# ---------------------------------------------------------------------------
# Talking to the server
