"""A real mlx-lm model whose greedy output is exactly known (see the scripted-model section of ARCHITECTURE.md).

Every attention and MLP output projection is zero, so the residual stream carries
the current token's embedding unchanged: the network is a bigram table. Each script
token gets its own embedding direction, and the untied ``lm_head`` row of token *b*
points at the direction of token *a* for every chain step *a -> b*. The chat
template ends the generation prompt with a *selector* token that picks the chain.

:func:`write_model` builds such a model from a :class:`Script` (a chat template,
chains, and the family's marker tokens); ``tests/scripted_families.py`` uses it
for every tool-call family mlx-lm parses. :func:`build` writes the Hermes model
most tests use, whose template picks:

* ``<|s_plain|>``  -> ``Hello world.`` EOS (also with tools offered, when the
  last message says ``PLAIN``: a model that does not want to call a tool)
* ``<|s_think|>``  -> (reasoning) ``Let me think.`` ``</think>`` ``Sure.`` EOS
* ``<|s_tool|>``   -> ``<tool_call>{"name": "get_weather", ...}</tool_call>`` EOS
* ``<|s_tools2|>`` -> two tool calls in one turn, EOS
* ``<|s_after|>``  -> (after a tool result) ``It is sunny.`` EOS
* ``<|s_think_tool|>`` -> (tools + thinking) reasoning, text, then a call, EOS
* ``<|s_think_only|>`` -> (thinking, ``ONLY`` in the last message) reasoning, EOS
* ``<|s_patch|>``  -> (an ``apply_patch`` tool offered) text, then a freeform patch call
* ``<|s_stray|>``  -> (no tools offered, ``STRAY`` in the last message) the
  ``<|s_tool|>`` call; its second choice, should the tool-call marker be
  masked, is ``Hello world.``
* ``<|s_unasked|>`` -> (reasoning off, ``UNASKED`` in any message) opens
  ``<think>`` unasked and reasons; its second choice, should ``<think>`` be
  masked, is ``Hello world.``
* ``<|s_loop|>``   -> ``la la la ...`` forever (for disconnect tests)

The model is loaded and run by the real engine through ``mlx_lm.load``.
"""

from __future__ import annotations

import json
import shutil
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from mlxtrio.settings import EMBEDDED_MODEL_PATH

WEATHER_CALL = '{"name": "get_weather", "arguments": {"city": "Paris"}}'
TIME_CALL = '{"name": "get_time", "arguments": {"zone": "UTC"}}'
OSLO_CALL = '<tool_call>{"name": "get_weather", "arguments": {"city": "Oslo"}}</tool_call>'
PATCH_TEXT = "*** Begin Patch\n*** Add File: hello.txt\n+hello\n*** End Patch\n"
PATCH_CALL = (
    '<tool_call>{"name": "apply_patch", "arguments": {"input": '
    + json.dumps(PATCH_TEXT)
    + "}}</tool_call>"
)
PLAIN = ["Hello", " world."]

CHAINS: dict[str, list[str]] = {
    "<|s_plain|>": PLAIN,
    "<|s_think|>": ["Let me", " think.", "</think>", "\n\n", "Sure", "!"],
    "<|s_tool|>": ["<tool_call>", WEATHER_CALL, "</tool_call>"],
    # Markers are matched on text, so one token may carry "</tool_call>\n<tool_call>".
    "<|s_tools2|>": [
        "\n<tool_call>",
        " " + WEATHER_CALL,
        "</tool_call>\n<tool_call>",
        TIME_CALL,
        "</tool_call>",
    ],
    "<|s_after|>": ["It", " is sunny."],
    # Markers are matched on text, so whole pieces may carry them.
    "<|s_think_tool|>": [
        "I should",
        " check Oslo.",
        "\n</think>\n\n",
        "Checking",
        " the weather.",
        OSLO_CALL,
    ],
    "<|s_patch|>": ["Patching", " now.", PATCH_CALL],
    "<|s_stray|>": ["<tool_call>", WEATHER_CALL, "</tool_call>"],
    # Ends its turn inside its reasoning: the answer is in there.
    "<|s_think_only|>": ["Meet", " at ten."],
    # Reasons although nobody asked (the reasoning opener is its first choice).
    "<|s_unasked|>": ["<think>", "Let me", " think.", "</think>", "\n\n", "Sure", "!"],
}
LOOP_TOKEN = " la"
SELECTORS = [*CHAINS, "<|s_loop|>"]

EXPECTED_TEXT = {
    "<|s_plain|>": "Hello world.",
    "<|s_think|>": "Sure!",
    "<|s_after|>": "It is sunny.",
}
EXPECTED_REASONING = "Let me think."

# The embedded template, with a selector token at the end of the generation prompt.
_SELECT = (
    "{%- if messages and not tools and 'STRAY' in (messages[-1].content or '') -%}"
    "{{- '<|s_stray|>' -}}"
    "{%- elif not (enable_thinking is defined and enable_thinking)"
    " and 'UNASKED' in (messages | tojson) -%}{{- '<|s_unasked|>' -}}"
    "{%- elif messages and 'LOOP' in (messages[-1].content or '') -%}{{- '<|s_loop|>' -}}"
    "{%- elif messages and messages[-1].role == 'tool' -%}{{- '<|s_after|>' -}}"
    "{%- elif tools and messages and 'PLAIN' in (messages[-1].content or '') -%}"
    "{{- '<|s_plain|>' -}}"
    "{%- elif tools and messages and 'TWO' in (messages[-1].content or '') -%}{{- '<|s_tools2|>' -}}"
    "{%- elif tools and 'apply_patch' in (tools | tojson) -%}{{- '<|s_patch|>' -}}"
    "{%- elif enable_thinking is defined and enable_thinking and messages"
    " and 'ONLY' in (messages[-1].content or '') -%}{{- '<|s_think_only|>' -}}"
    "{%- elif tools and enable_thinking is defined and enable_thinking -%}{{- '<|s_think_tool|>' -}}"
    "{%- elif tools -%}{{- '<|s_tool|>' -}}"
    "{%- elif enable_thinking is defined and enable_thinking -%}{{- '<|s_think|>' -}}"
    "{%- else -%}{{- '<|s_plain|>' -}}{%- endif -%}"
)

# A chain step's weight in the output layer: the next token's logit is 16x this
# (RMSNorm scales a one-hot 256-wide embedding to 16), so a step wins by ~64
# logits, and a second choice (when the first is masked) by ~32.
FIRST_CHOICE = 4.0
SECOND_CHOICE = 2.0


@dataclass(frozen=True)
class Script:
    """What one scripted model says, and how its prompts select it.

    ``chains`` map a selector (the last token the template renders) to the
    pieces generated after it, each one token, then EOS. ``fallbacks`` give a
    selector a second choice of chain, taken only when the first piece of its
    own chain is masked. ``markers`` are added as special tokens (the family's
    tool-call markers, as real tokenizers have them); they may also be pieces."""

    chat_template: str
    chains: dict[str, list[str]]
    loops: dict[str, str] = field(default_factory=dict)  # selector -> piece repeated forever
    fallbacks: dict[str, list[str]] = field(default_factory=dict)
    markers: tuple[str, ...] = ()
    tool_parser_type: str | None = None

    @property
    def selectors(self) -> list[str]:
        return [*self.chains, *self.loops]

    @property
    def pieces(self) -> list[str]:
        chains = [*self.chains.values(), *self.fallbacks.values()]
        found = {p for chain in chains for p in chain} | set(self.loops.values())
        return sorted(found - set(self.markers))


def hermes_script() -> Script:
    """The Hermes model: the embedded template with a selector appended."""
    config = json.loads((EMBEDDED_MODEL_PATH / "tokenizer_config.json").read_text())
    template = config["chat_template"]
    marker = "{%- if enable_thinking is defined and enable_thinking -%}{{- '<think>\\n' -}}"
    assert marker in template, "embedded template changed; update the scripted model"
    # Insert the selector after the think prefix of the generation prompt.
    tail = "{%- else -%}{{- '<think>\\n\\n</think>\\n\\n' -}}{%- endif -%}"
    template = template.replace(tail, tail + _SELECT, 1)
    # History renders an assistant turn with the selector its generation prompt
    # ended with (for the content-only scripts), so multi-turn prompts are
    # prefix-stable like the embedded template's.
    think = (
        "{{- '<think>\\n' + (message.reasoning_content or message.reasoning or '')"
        " + '\\n</think>\\n\\n' -}}"
    )
    assert think in template, "embedded template changed; update the scripted model"
    reselect = (
        "{%- if not message.tool_calls and message.content == 'Hello world.' -%}{{- '<|s_plain|>' -}}"
        "{%- elif not message.tool_calls and message.content == 'It is sunny.' -%}{{- '<|s_after|>' -}}{%- endif -%}"
    )
    template = template.replace(think, think + reselect, 1)
    return Script(
        template,
        CHAINS,
        loops={"<|s_loop|>": LOOP_TOKEN},
        fallbacks={"<|s_stray|>": PLAIN, "<|s_unasked|>": PLAIN},
    )


def build(out: Path) -> Path:
    """Write the Hermes scripted model to ``out`` and return it."""
    return write_model(out, hermes_script())


def write_model(out: Path, script: Script) -> Path:
    """Write the model ``script`` describes to ``out`` and return it."""
    out.mkdir(parents=True, exist_ok=True)
    for name in ("special_tokens_map.json", "generation_config.json"):
        shutil.copy(EMBEDDED_MODEL_PATH / name, out / name)
    ids = _write_tokenizer(out, script)
    config = json.loads((EMBEDDED_MODEL_PATH / "config.json").read_text())
    config.update(vocab_size=max(ids.values()) + 1, tie_word_embeddings=False, num_hidden_layers=1)
    (out / "config.json").write_text(json.dumps(config, indent=2))
    _write_weights(out, config, _steps(script, ids))
    return out


def _write_tokenizer(out: Path, script: Script) -> dict[str, int]:
    """The embedded tokenizer with every piece a token of its own and the
    markers and selectors special tokens; returns the whole vocabulary."""
    from tokenizers import AddedToken, Tokenizer

    tokenizer = Tokenizer.from_file(str(EMBEDDED_MODEL_PATH / "tokenizer.json"))
    new_pieces = [p for p in script.pieces if tokenizer.token_to_id(p) is None]
    tokenizer.add_tokens([AddedToken(p, normalized=False) for p in new_pieces])
    specials = [m for m in script.markers if tokenizer.token_to_id(m) is None]
    specials += script.selectors
    tokenizer.add_special_tokens([AddedToken(s, special=True, normalized=False) for s in specials])
    tokenizer.save(str(out / "tokenizer.json"))

    tok_config: dict[str, Any] = json.loads(
        (EMBEDDED_MODEL_PATH / "tokenizer_config.json").read_text()
    )
    tok_config["chat_template"] = script.chat_template
    if script.tool_parser_type is not None:
        tok_config["tool_parser_type"] = script.tool_parser_type
    (out / "tokenizer_config.json").write_text(json.dumps(tok_config, indent=2))
    return dict(tokenizer.get_vocab(with_added_tokens=True))


def _steps(script: Script, ids: dict[str, int]) -> list[tuple[int, int, float]]:
    """Every bigram step ``(a, b, weight)``. A token has one first choice: the
    chains must agree wherever they share a token."""
    eos = ids["<|im_end|>"]
    steps: list[tuple[int, int, float]] = []
    successors: dict[int, int] = {}

    def chain(sequence: list[int], first_weight: float) -> None:
        for i, (a, b) in enumerate(zip(sequence, sequence[1:], strict=False)):
            weight = first_weight if i == 0 else FIRST_CHOICE
            if weight == FIRST_CHOICE:
                assert successors.setdefault(a, b) == b, "a token has one first choice"
            steps.append((a, b, weight))

    for selector, pieces in script.chains.items():
        chain([ids[selector], *(ids[p] for p in pieces), eos], FIRST_CHOICE)
    for selector, pieces in script.fallbacks.items():
        chain([ids[selector], *(ids[p] for p in pieces), eos], SECOND_CHOICE)
    for selector, piece in script.loops.items():
        chain([ids[selector], ids[piece], ids[piece]], FIRST_CHOICE)
    return steps


def bigram_tables(
    steps: list[tuple[int, int, float]], vocab_size: int, hidden: int
) -> tuple[Any, Any]:
    """The embedding and output rows of the bigram table: each source token
    its own direction, each step's target row pointing at its source's."""
    import mlx.core as mx

    sources = sorted({a for a, _, _ in steps})
    assert len(sources) <= hidden
    direction = {token: i for i, token in enumerate(sources)}
    embed = mx.zeros((vocab_size, hidden))
    embed[mx.array(sources), mx.array([direction[a] for a in sources])] = 1.0
    head = mx.zeros((vocab_size, hidden))
    head[mx.array([b for _, b, _ in steps]), mx.array([direction[a] for a, _, _ in steps])] = (
        mx.array([w for _, _, w in steps])
    )
    return embed, head


def _write_weights(out: Path, config: dict[str, Any], steps: list[tuple[int, int, float]]) -> None:
    """A 1-layer qwen3 whose output layer holds the bigram table."""
    import mlx.core as mx
    from mlx.utils import tree_flatten
    from mlx_lm.models import qwen3

    embed, head = bigram_tables(steps, config["vocab_size"], config["hidden_size"])
    model = qwen3.Model(qwen3.ModelArgs.from_dict(config))
    weights = dict(tree_flatten(model.parameters()))
    weights["model.embed_tokens.weight"] = embed
    weights["lm_head.weight"] = head
    for name in list(weights):
        if name.endswith(("o_proj.weight", "down_proj.weight")):
            weights[name] = mx.zeros_like(weights[name])
    mx.save_safetensors(
        str(out / "model.safetensors"),
        {k: v.astype(mx.float32) for k, v in weights.items()},
        metadata={"format": "mlx"},
    )
