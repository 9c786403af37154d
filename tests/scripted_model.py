"""A real mlx-lm model whose greedy output is exactly known (DESIGN §9).

Every attention and MLP output projection is zero, so the residual stream carries
the current token's embedding unchanged: the network is a bigram table. Each script
token gets its own embedding direction, and the untied ``lm_head`` row of token *b*
points at the direction of token *a* for every chain step *a -> b*. The chat
template ends the generation prompt with a *selector* token that picks the chain:

* ``<|s_plain|>``  -> ``Hello world.`` EOS
* ``<|s_think|>``  -> (reasoning) ``Let me think.`` ``</think>`` ``Sure.`` EOS
* ``<|s_tool|>``   -> ``<tool_call>{"name": "get_weather", ...}</tool_call>`` EOS
* ``<|s_tools2|>`` -> two tool calls in one turn, EOS
* ``<|s_after|>``  -> (after a tool result) ``It is sunny.`` EOS
* ``<|s_think_tool|>`` -> (tools + thinking) reasoning, text, then a call, EOS
* ``<|s_patch|>``  -> (an ``apply_patch`` tool offered) text, then a freeform patch call
* ``<|s_loop|>``   -> ``la la la ...`` forever (for disconnect tests)

The model is loaded and run by the real engine through ``mlx_lm.load``.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

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

CHAINS: dict[str, list[str]] = {
    "<|s_plain|>": ["Hello", " world."],
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
    "{%- if messages and 'LOOP' in (messages[-1].content or '') -%}{{- '<|s_loop|>' -}}"
    "{%- elif messages and messages[-1].role == 'tool' -%}{{- '<|s_after|>' -}}"
    "{%- elif tools and messages and 'TWO' in (messages[-1].content or '') -%}{{- '<|s_tools2|>' -}}"
    "{%- elif tools and 'apply_patch' in (tools | tojson) -%}{{- '<|s_patch|>' -}}"
    "{%- elif tools and enable_thinking is defined and enable_thinking -%}{{- '<|s_think_tool|>' -}}"
    "{%- elif tools -%}{{- '<|s_tool|>' -}}"
    "{%- elif enable_thinking is defined and enable_thinking -%}{{- '<|s_think|>' -}}"
    "{%- else -%}{{- '<|s_plain|>' -}}{%- endif -%}"
)


def build(out: Path) -> Path:
    """Write the scripted model to ``out`` and return it."""
    import mlx.core as mx
    from mlx.utils import tree_flatten
    from mlx_lm.models import qwen3
    from tokenizers import AddedToken, Tokenizer

    out.mkdir(parents=True, exist_ok=True)
    for name in ("tokenizer_config.json", "special_tokens_map.json", "generation_config.json"):
        shutil.copy(EMBEDDED_MODEL_PATH / name, out / name)

    tokenizer = Tokenizer.from_file(str(EMBEDDED_MODEL_PATH / "tokenizer.json"))
    pieces = sorted({p for chain in CHAINS.values() for p in chain} | {LOOP_TOKEN})
    new_pieces = [p for p in pieces if tokenizer.token_to_id(p) is None]
    tokenizer.add_tokens([AddedToken(p, normalized=False) for p in new_pieces])
    tokenizer.add_special_tokens([AddedToken(s, special=True, normalized=False) for s in SELECTORS])
    tokenizer.save(str(out / "tokenizer.json"))

    tok_config = json.loads((out / "tokenizer_config.json").read_text())
    template = tok_config["chat_template"]
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
    tok_config["chat_template"] = template
    (out / "tokenizer_config.json").write_text(json.dumps(tok_config, indent=2))

    config = json.loads((EMBEDDED_MODEL_PATH / "config.json").read_text())
    vocab_size = tokenizer.get_vocab_size()
    config.update(vocab_size=vocab_size, tie_word_embeddings=False, num_hidden_layers=1)
    (out / "config.json").write_text(json.dumps(config, indent=2))

    eos = tokenizer.token_to_id("<|im_end|>")
    ids = {p: tokenizer.token_to_id(p) for p in [*SELECTORS, *pieces]}
    steps: list[tuple[int, int]] = []
    for selector, chain in CHAINS.items():
        sequence = [ids[selector], *(ids[p] for p in chain), eos]
        steps.extend(zip(sequence, sequence[1:], strict=False))
    steps += [(ids["<|s_loop|>"], ids[LOOP_TOKEN]), (ids[LOOP_TOKEN], ids[LOOP_TOKEN])]

    hidden = config["hidden_size"]
    sources = sorted({a for a, _ in steps})
    assert len(sources) <= hidden
    direction = {token: i for i, token in enumerate(sources)}
    successors: dict[int, int] = {}
    for a, b in steps:
        assert successors.get(a, b) == b, "a token cannot have two successors in a bigram script"
        successors[a] = b

    model = qwen3.Model(qwen3.ModelArgs.from_dict(config))
    weights = dict(tree_flatten(model.parameters()))
    embed = [[0.0] * hidden for _ in range(vocab_size)]
    head = [[0.0] * hidden for _ in range(vocab_size)]
    for a, b in successors.items():
        embed[a][direction[a]] = 1.0
        head[b][direction[a]] = 4.0
    weights["model.embed_tokens.weight"] = mx.array(embed)
    weights["lm_head.weight"] = mx.array(head)
    for name in list(weights):
        if name.endswith(("o_proj.weight", "down_proj.weight")):
            weights[name] = mx.zeros_like(weights[name])
    mx.save_safetensors(
        str(out / "model.safetensors"),
        {k: v.astype(mx.float32) for k, v in weights.items()},
        metadata={"format": "mlx"},
    )
    return out
