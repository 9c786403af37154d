"""Real-world text in the prompts of synthetic samples.

Real agent clients send system prompts, tool descriptions and user-turn
preambles (``<system-reminder>`` blocks, environment context) of ordinary
English prose, markdown and code. The synthetic data's own system prompts are
short or made of a dozen stock lines, so the model never saw such text: on the
captured Claude Code and Codex requests every shipped model up to run 13 wrote
"helpful helpful ..." to the output cap, even with the prompts cut to 3k tokens
(the README, runs 13 to 15).

The text comes from the Python standard library installed with the interpreter
that runs training: the language reference topics (``pydoc_data/topics.py``,
prose) and module sources (code, comments, docstrings). Nothing is downloaded.
The ``train`` and ``eval`` splits hold disjoint files and disjoint parts of the
topics text. Excerpts draw from their own ``random.Random``, so adding foreign
context leaves the rest of a run's data as it was.
"""

from __future__ import annotations

import ast
import random
import sysconfig
import zlib
from pathlib import Path
from typing import Any

import tinychat_data as data

# Generic wrappers of the kind agent clients put around injected context.
TAGS = ["system-reminder", "environment_context", "context", "user_instructions", "info"]


class ForeignText:
    """Excerpts of prose and code for one split (``"train"`` or ``"eval"``)."""

    def __init__(self, split: str, stdlib: Path | None = None) -> None:
        root = stdlib or Path(sysconfig.get_paths()["stdlib"])
        held_out = split == "eval"
        self.code = [
            text
            for path in sorted(root.glob("*.py"))
            if (zlib.crc32(path.name.encode()) % 5 == 0) == held_out
            and len(text := path.read_text(encoding="utf-8", errors="replace")) > 2000
        ]
        topics = root / "pydoc_data" / "topics.py"
        prose = _topics_text(topics) if topics.exists() else ""
        cut = len(prose) * 4 // 5
        self.prose = prose[cut:] if held_out else prose[:cut]
        if not self.code:
            raise RuntimeError(f"no Python sources under {root}")

    def excerpt(self, rng: random.Random, chars: int) -> str:
        """About ``chars`` characters from a random place, cut at line starts."""
        use_prose = len(self.prose) > chars and rng.random() < 0.6
        text = self.prose if use_prose else rng.choice(self.code)
        start = rng.randrange(max(1, len(text) - chars))
        start = text.find("\n", start) + 1
        return text[start : start + chars].strip()

    def sized(self, rng: random.Random, low: int, high: int) -> str:
        """An excerpt of log-uniform length between ``low`` and ``high`` characters."""
        return self.excerpt(rng, int(low * (high / low) ** rng.random()))


def _topics_text(path: Path) -> str:
    """The reference topics' text (a dict literal of strings), parsed, not run."""
    tree = ast.parse(path.read_text(encoding="utf-8", errors="replace"))
    return "\n\n".join(
        node.value
        for node in ast.walk(tree)
        if isinstance(node, ast.Constant) and isinstance(node.value, str) and len(node.value) > 200
    )


def add_foreign_context(
    sample: data.Sample,
    foreign: ForeignText,
    rng: random.Random,
    max_chars: int = 6000,
    max_tools: int = 6,
    tool_chance: float = 0.3,
) -> None:
    """Put real-world text where agent clients put theirs, in place.

    Each of these happens independently: a system prompt of foreign text (before
    or after the sample's own system prompt, if any); a tagged block of foreign
    text before the user's request; distractor tools whose descriptions are
    foreign text (``tool_chance``, up to ``max_tools`` of them; their
    descriptions shrink as there are more, so that samples still fit). The
    completion does not change: the model learns to answer the last request
    whatever surrounds it.
    """
    messages = sample.messages
    if rng.random() < 0.7:
        text = foreign.sized(rng, 200, max_chars)
        if messages and messages[0]["role"] == "system":
            own = messages[0]["content"]
            messages[0]["content"] = (
                f"{own}\n\n{text}" if rng.random() < 0.5 else f"{text}\n\n{own}"
            )
        else:
            messages.insert(0, {"role": "system", "content": text})
    if rng.random() < 0.35:
        user = max(i for i, m in enumerate(messages) if m["role"] == "user")
        tag = rng.choice(TAGS)
        block = f"<{tag}>\n{foreign.sized(rng, 100, max_chars // 4)}\n</{tag}>"
        messages[user] = {**messages[user], "content": f"{block}\n\n{messages[user]['content']}"}
    if sample.tools and rng.random() < tool_chance:
        longest = 1500 * 6 // max(6, max_tools)
        extra = [_foreign_tool(rng, foreign, i, longest) for i in range(rng.randint(1, max_tools))]
        tools = sample.tools + extra
        rng.shuffle(tools)
        sample.tools = tools


def _foreign_tool(
    rng: random.Random, foreign: ForeignText, i: int, longest: int = 1500
) -> dict[str, Any]:
    """A distractor tool described in foreign text, with a nested schema."""
    name = rng.choice(
        ["Task", "Notebook", "Web", "Skill", "Todo", "Mcp", "Shell", "Lsp"]
    ) + rng.choice(["Fetch", "Write", "Output", "Search", "Kill", "Plan", "Exit", "Read"])
    props: dict[str, Any] = {
        f"opt_{j}": {"type": "string", "description": foreign.sized(rng, 20, 300)}
        for j in range(rng.randint(1, 4))
    }
    if rng.random() < 0.5:
        props["items"] = {
            "type": "array",
            "items": {
                "type": "object",
                "properties": {"value": {"type": "string"}, "kind": {"enum": ["a", "b"]}},
            },
        }
    return {
        "type": "function",
        "function": {
            "name": f"{name}{i}" if rng.random() < 0.5 else name,
            "description": foreign.sized(rng, 100, longest),
            "parameters": {"type": "object", "properties": props, "required": list(props)[:1]},
        },
    }
