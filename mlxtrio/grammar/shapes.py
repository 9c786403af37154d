"""How a call begins in each tool-call family's markup, right after the
family's start marker: what the engine forces so that a model can only name an
offered tool (see :class:`~mlxtrio.engine.processors.openings.OpeningConstraint`).

Pure data; nothing here imports MLX.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any


def _hermes(name: str) -> tuple[str, ...]:
    # No trailing space after the colon: models emit ' {' as one token.
    return ('{"name": ' + json.dumps(name, ensure_ascii=False) + ', "arguments":',)


@dataclass(frozen=True)
class CallShape:
    """How a call in one tool-call family's markup begins right after the
    family's start marker, up to where the tool's name is unambiguous: forcing
    that much lets the model pick only an offered tool, by its own logits, and
    leaves the arguments to it.

    ``forms`` gives the ways a call naming a tool may begin; ``heads`` what may
    come between the marker and it, the family template's own first (the only
    one allowed when the call is forced from nothing, so the model is not led
    into a spelling it never saw)."""

    forms: Callable[[str], tuple[str, ...]]
    heads: tuple[str, ...] = ("",)

    def openings(self, names: Iterable[str], canonical: bool = False) -> tuple[str, ...]:
        heads = self.heads[:1] if canonical else self.heads
        return tuple(head + form for name in names for head in heads for form in self.forms(name))


def _glm(name: str) -> tuple[str, ...]:
    # The name ends where the first <arg_key> (or the closing marker) starts;
    # GLM 4.5 templates put a newline there.
    return (name + "<", name + "\n")


# By mlx-lm tool parser module (laguna's parser is glm47's). Families left out
# are not constrained (their calls are still parsed):
# * kimi_k3: its start marker is several tokens, so there is no one token to
#   constrain after, and what follows (`<|open|>call tool="..." index=...`,
#   with whatever whitespace the model puts between XTML blocks) is not pinned
#   down by the parser;
# * muse_spark: the parser allows attributes before `name=` in
#   `<atem:invoke ...>` and its response format names the tool in the message
#   header too, so a forced shape could contradict what the model writes.
CALL_SHAPES: dict[str, CallShape] = {
    "json_tools": CallShape(_hermes, ("", "\n")),
    "qwen3_coder": CallShape(lambda name: (f"<function={name}>",), ("\n", "")),
    "glm47": CallShape(_glm),
    "longcat": CallShape(_glm),
    # The call id is `functions.NAME:INDEX`; the index is left to the model.
    "kimi_k2": CallShape(lambda name: (f"<|tool_call_begin|>functions.{name}:",)),
    # `[TOOL_CALLS]name[ARGS]{...}` (v11+ templates) or a JSON list (older ones).
    "mistral": CallShape(
        lambda name: (name + "[ARGS]", "[" + _hermes(name)[0]),
        ("", " "),
    ),
    "pythonic": CallShape(lambda name: (f"[{name}(",)),
    "function_gemma": CallShape(lambda name: (f"call:{name}{{",)),
    "gemma4": CallShape(lambda name: (f"call:{name}{{",)),
    "minimax_m2": CallShape(lambda name: (f'<invoke name="{name}">',), ("\n", "")),
    # The marker is `<function name=`: the quoted name follows.
    "minicpm5": CallShape(lambda name: (f'"{name}">',)),
}


def tool_family(tool_parser: Any) -> str:
    """The tool-call family of ``tool_parser`` (the tokenizer's): its mlx-lm
    parser module's name, e.g. ``json_tools``."""
    module = getattr(tool_parser, "__module__", None) or ""
    return module.rsplit(".", 1)[-1]


def call_shape(tool_parser: Any) -> CallShape | None:
    """The call shape of the family whose parser is ``tool_parser`` (the
    tokenizer's), or None when calls of that family are not constrained."""
    return CALL_SHAPES.get(tool_family(tool_parser))
