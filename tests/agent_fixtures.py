"""Request bodies shaped like the ones real agent clients send (see
``shared/spec/captures``), with our own fixture text.

Claude Code: billing-header system block, system blocks with ``cache_control``, 24
tools with JSON Schema draft 2020-12 keywords, a ``role: "system"`` message in the
middle of the array, thinking blocks with signatures, ``tool_result`` with
``is_error`` and ``cache_control``, ``thinking: adaptive``, ``context_management``,
``output_config``, a JSON-string ``metadata.user_id``.

Codex: developer messages, ``store: false``, ``include`` encrypted reasoning,
``prompt_cache_key``, function + namespace + custom (``apply_patch``) + web_search
and tool_search tools, reasoning items with ``encrypted_content`` and
``content: null``, every item with an ``id``.
"""

from __future__ import annotations

from typing import Any

DRAFT = "https://json-schema.org/draft/2020-12/schema"


def _claude_tools() -> list[dict[str, Any]]:
    tools: list[dict[str, Any]] = [
        {
            "name": "get_weather",
            "description": "Look up the current weather for a city.",
            "input_schema": {
                "$schema": DRAFT,
                "type": "object",
                "properties": {
                    "city": {"type": "string", "minLength": 1, "description": "City name"}
                },
                "required": ["city"],
                "additionalProperties": False,
            },
        },
        {
            "name": "Shell",
            "description": "Run a shell command in the workspace.",
            "input_schema": {
                "$schema": DRAFT,
                "type": "object",
                "properties": {
                    "command": {"type": "string"},
                    "timeout": {"type": "number", "exclusiveMinimum": 0, "maximum": 600000},
                    "env": {
                        "type": "object",
                        "propertyNames": {"pattern": "^[A-Z_]+$"},
                        "additionalProperties": {"type": "string"},
                    },
                },
                "required": ["command"],
                "additionalProperties": False,
            },
        },
    ]
    for i in range(22):
        tools.append(
            {
                "name": f"Helper{i:02d}",
                "description": f"Fixture helper tool number {i}.",
                "input_schema": {
                    "$schema": DRAFT,
                    "type": "object",
                    "properties": {
                        "mode": {"enum": ["fast", "slow"], "default": "fast"},
                        "items": {"type": "array", "items": {"type": "string"}, "maxItems": 5},
                        "target": {"anyOf": [{"type": "string"}, {"const": None}]},
                    },
                    "additionalProperties": False,
                },
            }
        )
    return tools


def _claude_system() -> list[dict[str, Any]]:
    return [
        {
            "type": "text",
            "text": "x-anthropic-billing-header: cc_version=9.9.9; cc_entrypoint=test; cch=abc123;",
        },
        {
            "type": "text",
            "text": "You are a careful coding assistant.",
            "cache_control": {"type": "ephemeral"},
        },
        {
            "type": "text",
            "text": "\nWork in small steps and report what you did.",
            "cache_control": {"type": "ephemeral"},
        },
    ]


def _claude_common(model: str) -> dict[str, Any]:
    return {
        "model": model,
        "system": _claude_system(),
        "tools": _claude_tools(),
        "metadata": {"user_id": '{"device_id":"fixture","account_uuid":"","session_id":"s-1"}'},
        "max_tokens": 32000,
        "thinking": {"type": "adaptive"},
        "context_management": {"edits": [{"type": "clear_thinking_20251015", "keep": "all"}]},
        "output_config": {"effort": "high"},
        "stream": True,
    }


def claude_plain(model: str) -> dict[str, Any]:
    return {
        **_claude_common(model),
        "messages": [
            {
                "role": "user",
                "content": [
                    {
                        "type": "text",
                        "text": "<reminder>Fixture context for the session.</reminder>",
                    },
                    {
                        "type": "text",
                        "text": "what is the weather in paris",
                        "cache_control": {"type": "ephemeral"},
                    },
                ],
            },
            {"role": "system", "content": "Helper agents available: general, planner."},
        ],
    }


def claude_toolcall(model: str) -> dict[str, Any]:
    return {
        **_claude_common(model),
        "messages": [
            {
                "role": "user",
                "content": [
                    {"type": "text", "text": "<reminder>Fixture context.</reminder>"},
                    {"type": "text", "text": "weather in paris?"},
                ],
            },
            {"role": "system", "content": "Helper agents available: general, planner."},
            {
                "role": "assistant",
                "content": [
                    {
                        "type": "thinking",
                        "thinking": "The user wants the weather; call the tool.",
                        "signature": "fixture-signature-1",
                    },
                    {"type": "text", "text": "Checking."},
                    {
                        "type": "tool_use",
                        "id": "toolu_fixture0001",
                        "name": "get_weather",
                        "input": {"city": "Paris"},
                    },
                ],
            },
            {
                "role": "user",
                "content": [
                    {
                        "tool_use_id": "toolu_fixture0001",
                        "type": "tool_result",
                        "content": [{"type": "text", "text": "sunny, 21C"}],
                        "is_error": False,
                        "cache_control": {"type": "ephemeral"},
                    }
                ],
            },
        ],
    }


def _codex_tools() -> list[dict[str, Any]]:
    return [
        {
            "type": "function",
            "name": "exec_command",
            "description": "Run a command.",
            "strict": False,
            "parameters": {
                "type": "object",
                "properties": {"cmd": {"type": "string"}},
                "required": ["cmd"],
                "additionalProperties": False,
            },
        },
        {
            "type": "function",
            "name": "get_weather",
            "description": "Weather for a city.",
            "strict": False,
            "parameters": {
                "type": "object",
                "properties": {"city": {"type": "string"}},
                "required": ["city"],
            },
        },
        {
            "type": "namespace",
            "name": "goals",
            "description": "Goal tracking.",
            "tools": [
                {
                    "type": "function",
                    "name": "create_goal",
                    "description": "Create a goal.",
                    "parameters": {"type": "object", "properties": {"title": {"type": "string"}}},
                },
            ],
        },
        {
            "type": "custom",
            "name": "apply_patch",
            "description": "Edit files with a patch.",
            "format": {"type": "grammar", "syntax": "lark", "definition": "start: /.+/s"},
        },
        {"type": "web_search", "external_web_access": False},
        {
            "type": "tool_search",
            "execution": "client",
            "description": "Find more tools.",
            "parameters": {"type": "object", "properties": {}},
        },
    ]


def _codex_common(model: str) -> dict[str, Any]:
    return {
        "model": model,
        "stream": True,
        "tools": _codex_tools(),
        "tool_choice": "auto",
        "parallel_tool_calls": True,
        "reasoning": {"summary": "auto"},
        "store": False,
        "include": ["reasoning.encrypted_content"],
        "prompt_cache_key": "fixture-session-0001",
        "text": {"verbosity": "low"},
        "client_metadata": {"fixture": "yes"},
    }


def _codex_prelude() -> list[dict[str, Any]]:
    return [
        {
            "type": "message",
            "id": "m1",
            "role": "developer",
            "content": [{"type": "input_text", "text": "You are a coding agent in a sandbox."}],
        },
        {
            "type": "message",
            "id": "m2",
            "role": "developer",
            "content": [
                {"type": "input_text", "text": "Rule one."},
                {"type": "input_text", "text": "Rule two."},
            ],
        },
        {
            "type": "message",
            "id": "m3",
            "role": "user",
            "content": [{"type": "input_text", "text": "<environment>cwd=/work</environment>"}],
        },
        {
            "type": "message",
            "id": "m4",
            "role": "user",
            "content": [{"type": "input_text", "text": "weather in paris?"}],
        },
    ]


def codex_plain(model: str) -> dict[str, Any]:
    return {**_codex_common(model), "input": _codex_prelude()}


def codex_toolcall(model: str) -> dict[str, Any]:
    return {
        **_codex_common(model),
        "input": [
            *_codex_prelude(),
            {
                "type": "reasoning",
                "id": "rs_1",
                "summary": [],
                "content": None,
                "encrypted_content": "opaque-blob-from-elsewhere",
            },
            {
                "type": "function_call",
                "id": "fc_1",
                "call_id": "call_1",
                "name": "get_weather",
                "arguments": '{"city":"Paris"}',
                "status": "completed",
            },
            {
                "type": "function_call_output",
                "id": "fco_1",
                "call_id": "call_1",
                "output": "sunny, 21C",
            },
        ],
    }


def codex_patch(model: str) -> dict[str, Any]:
    return {
        **_codex_common(model),
        "reasoning": {"effort": "medium"},
        "input": [
            *_codex_prelude(),
            {
                "type": "custom_tool_call",
                "id": "ctc_1",
                "call_id": "call_p1",
                "name": "apply_patch",
                "input": "*** Begin Patch\n*** Add File: hello.txt\n+hello\n*** End Patch\n",
                "status": "completed",
            },
            {
                "type": "custom_tool_call_output",
                "id": "ctco_1",
                "call_id": "call_p1",
                "output": "Success. Updated the following files:\nA hello.txt\n",
            },
        ],
    }


def codex_patch_first(model: str) -> dict[str, Any]:
    """The turn before ``codex_patch``: the model is asked and should patch."""
    body = codex_patch(model)
    body["input"] = _codex_prelude()
    return body
