"""Freeform (custom) tools as the model is offered them: a function with one
string argument, ``input``, whose text a grammar holds when the tool has one
(Codex's ``apply_patch``). The Responses and Chat Completions APIs both
offer them.

A Lark grammar without recursion is inlined into one regular expression
(:mod:`.lark_regex`), which becomes the JSON-Schema ``pattern`` of ``input``.
"""

from __future__ import annotations

import logging

from ..chat.conversation import ToolSpec
from ..chat.errors import ConversationError
from .lark_regex import GrammarNotRegular, lark_to_regex, llguidance_reads

log = logging.getLogger("mlxtrio.grammar")


def freeform_tool(name: str, description: str | None, grammar: tuple[str, str] | None) -> ToolSpec:
    """A freeform tool (Codex's ``apply_patch``) offered as a function with one
    string argument, ``input``, that carries the raw text."""
    text = (description or "").strip()
    if grammar is not None:
        syntax, definition = grammar
        text += f"\nThe input must follow this {syntax} grammar:\n{definition}"
    text += '\nCall it with the raw text in the "input" argument.'
    parameters = {
        "type": "object",
        "properties": {"input": {"type": "string"}},
        "required": ["input"],
    }
    pattern = _input_pattern(name, grammar)
    constraint = None
    if pattern is not None:
        constraint = {
            "type": "object",
            "properties": {"input": {"type": "string", "pattern": pattern}},
            "required": ["input"],
            "additionalProperties": False,
        }
    return ToolSpec(name, text.strip(), parameters, constraint_schema=constraint)


def _input_pattern(name: str, grammar: tuple[str, str] | None) -> str | None:
    """The regular expression a custom tool's input must match: its grammar
    (Lark, inlined; or a regex), or None when it has none that can be held to
    (a recursive grammar: its input is then any text)."""
    if grammar is None:
        return None
    syntax, definition = grammar
    if syntax == "regex":
        return f"^(?:{_unanchored(definition)})$"
    if syntax != "lark":
        raise ConversationError(
            f'custom tool "{name}": grammar syntax "{syntax}" is not supported '
            '(use "lark" or "regex")',
            "tools",
        )
    try:
        return lark_to_regex(definition)
    except GrammarNotRegular as exc:
        log.warning("custom tool %r: its input is not constrained: %s", name, exc)
        return None
    except ValueError as exc:
        # OpenAI's grammars are written in llguidance's Lark dialect, which
        # Python's Lark does not all read: only what neither reads is refused.
        if llguidance_reads(definition):
            log.warning("custom tool %r: its input is not constrained: %s", name, exc)
            return None
        raise ConversationError(f'custom tool "{name}": {exc}', "tools") from None


def _unanchored(regex: str) -> str:
    """``regex`` without a leading ``^`` or trailing ``$`` (it gets its own)."""
    if regex.startswith("^"):
        regex = regex[1:]
    if regex.endswith("$") and not regex.endswith("\\$"):
        regex = regex[:-1]
    return regex
