"""A real Qwen2.5-VL (mlx-vlm) whose greedy output is exactly known: it asks
for a picture with a ``Read`` tool call, then says it saw it.

The checkpoint is ``tools/build_tiny_vlm.py``'s Qwen2.5-VL with its language
model turned into a bigram table, as ``tests/scripted_model.py`` does for text
models (attention and MLP output projections zero, the embedding and output
rows holding the chains); the vision tower keeps its random weights, so the
image runs through it and into the KV cache for real, but cannot change what
the model says. The chat template (ChatML with Hermes tool calls and image
parts) ends the generation prompt with a selector:

* ``<|s_read|>`` (tools offered, the last message is not a tool result) ->
  ``<tool_call>{"name": "Read", "arguments": {"file_path": PATH}}</tool_call>``
* ``<|s_seen|>`` (after a tool result, or without tools) -> ``I see the picture.``

``python tests/scripted_vision.py OUT_DIR [PATH]`` writes one (for a real
Claude Code run that reads a PNG with its Read tool).
"""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
IMAGE = "<|vision_start|><|image_pad|><|vision_end|>"
SEEN = ["I see", " the picture."]

TEMPLATE = (
    "{%- macro content(c) -%}"
    "{%- if c is string -%}{{- c -}}"
    "{%- else -%}{%- for part in c -%}"
    "{%- if part.type == 'image' or part.type == 'image_url' -%}{{- '" + IMAGE + "' -}}"
    "{%- elif part.type == 'text' -%}{{- part.text -}}{%- endif -%}"
    "{%- endfor -%}{%- endif -%}"
    "{%- endmacro -%}"
    "{%- if tools -%}{{- '<|im_start|>system\\n# Tools\\n<tools>' -}}"
    "{%- for tool in tools -%}{{- tool | tojson -}}{%- endfor -%}"
    "{{- '</tools><|im_end|>\\n' -}}{%- endif -%}"
    "{%- for message in messages -%}"
    "{%- if message.role == 'tool' -%}"
    "{{- '<|im_start|>user\\n<tool_response>\\n' + content(message.content)"
    " + '\\n</tool_response><|im_end|>\\n' -}}"
    "{%- elif message.role == 'assistant' -%}"
    "{{- '<|im_start|>assistant\\n' + content(message.content or '') -}}"
    "{%- for call in message.tool_calls or [] -%}"
    '{{- \'<tool_call>{"name": "\' + call.function.name + \'", "arguments": \''
    " + (call.function.arguments | tojson) + '}</tool_call>' -}}"
    "{%- endfor -%}{{- '<|im_end|>\\n' -}}"
    "{%- else -%}"
    "{{- '<|im_start|>' + message.role + '\\n' + content(message.content) + '<|im_end|>\\n' -}}"
    "{%- endif -%}{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{- '<|im_start|>assistant\\n' -}}"
    "{%- if tools and messages and messages[-1].role != 'tool' -%}{{- '<|s_read|>' -}}"
    "{%- else -%}{{- '<|s_seen|>' -}}{%- endif -%}{%- endif -%}"
)


def read_call(path: str) -> str:
    return json.dumps({"name": "Read", "arguments": {"file_path": path}})


def build_scripted_vlm(out: Path, path: str = "/tmp/shot.png") -> Path:
    """Write the model to ``out`` (its call reads ``path``) and return it."""
    import mlx.core as mx
    from tokenizers import AddedToken, Tokenizer

    from .scripted_model import FIRST_CHOICE, Script, _steps, bigram_tables

    spec = importlib.util.spec_from_file_location("builder", ROOT / "tools/build_tiny_vlm.py")
    assert spec is not None and spec.loader is not None
    builder = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(builder)
    builder.build_qwen2_5_vl(out, "float32", 0)

    script = Script(
        TEMPLATE,
        {"<|s_read|>": ["<tool_call>", read_call(path), "</tool_call>"], "<|s_seen|>": SEEN},
        markers=("<tool_call>", "</tool_call>"),
        tool_parser_type="json_tools",
    )
    tokenizer = Tokenizer.from_file(str(out / "tokenizer.json"))
    tokenizer.add_tokens([AddedToken(p, normalized=False) for p in script.pieces])
    specials = [*script.markers, *script.selectors]
    tokenizer.add_special_tokens([AddedToken(s, special=True, normalized=False) for s in specials])
    tokenizer.save(str(out / "tokenizer.json"))
    ids = dict(tokenizer.get_vocab(with_added_tokens=True))
    config = json.loads((out / "tokenizer_config.json").read_text())
    config["tool_parser_type"] = script.tool_parser_type
    (out / "tokenizer_config.json").write_text(json.dumps(config, indent=2))
    (out / "chat_template.jinja").write_text(TEMPLATE)

    model_config = json.loads((out / "config.json").read_text())
    vocab, hidden = model_config["vocab_size"], model_config["hidden_size"]
    assert max(ids.values()) < vocab, "the scripted pieces do not fit the vocabulary"
    steps = _steps(script, ids)
    embed, head = bigram_tables(steps, vocab, hidden)
    assert all(w == FIRST_CHOICE for _, _, w in steps)
    weights = dict(mx.load(str(out / "model.safetensors")).items())
    weights["language_model.model.embed_tokens.weight"] = embed
    weights["language_model.lm_head.weight"] = head
    for name in list(weights):
        if name.startswith("language_model.") and name.endswith(
            ("o_proj.weight", "down_proj.weight")
        ):
            weights[name] = mx.zeros_like(weights[name])
    mx.save_safetensors(str(out / "model.safetensors"), weights, metadata={"format": "mlx"})
    return out


if __name__ == "__main__":
    sys.path.insert(0, str(ROOT))
    from tests.scripted_vision import build_scripted_vlm as build

    build(Path(sys.argv[1]), *(sys.argv[2:3] or []))
