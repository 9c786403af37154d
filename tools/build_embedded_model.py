"""Build the embedded default model shipped in ``mlxtrio/assets/tiny-chat``.

The model is a tiny Qwen3-architecture network (mlx-lm's ``qwen3`` class) with its
own byte-level BPE tokenizer and a chat template in the Qwen/Hermes style:
``<tool_call>{json}</tool_call>`` for tool calls and ``<think>``/``</think>`` for
reasoning, so mlx-lm's ``TokenizerWrapper`` detects both features by itself.

This script writes the tokenizer, config and *randomly initialised* weights. A
separate training script can overwrite the weights; the files it needs
(tokenizer, config, template) come from here.

    python tools/build_embedded_model.py [--seed 0] [--out mlxtrio/assets/tiny-chat]

Everything is deterministic for a given seed.
"""

from __future__ import annotations

import argparse
import json
import random
from pathlib import Path

SPECIAL_TOKENS = [
    "<|endoftext|>",
    "<|im_start|>",
    "<|im_end|>",
    "<think>",
    "</think>",
    "<tool_call>",
    "</tool_call>",
    "<tool_response>",
    "</tool_response>",
]

# Architecture: sized so that bf16 weights stay well under 10 MB.
CONFIG = {
    "architectures": ["Qwen3ForCausalLM"],
    "model_type": "qwen3",
    "hidden_size": 256,
    "num_hidden_layers": 4,
    "intermediate_size": 640,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 64,
    "rms_norm_eps": 1e-6,
    "vocab_size": 4096,
    "max_position_embeddings": 65536,
    "rope_theta": 10000.0,
    "tie_word_embeddings": True,
    "torch_dtype": "bfloat16",
}

# The chat template. Rendering rules that matter to the server:
# * a prompt that grows by appending turns renders to a token sequence that
#   extends the previous rendering (prefix-stable): earlier assistant turns keep
#   their reasoning, nothing depends on "is this the last message", and every
#   assistant turn renders its think block - empty ones too - exactly as the
#   generation prompt plus the model's output had it;
# * tools are listed as JSON in the system turn;
# * tool calls (OpenAI ``{function: {...}}`` or flat, arguments as an object or
#   a JSON string) are rendered as (mlx-lm recognises the format by the literal
#   ``tool_call.name`` in the template)
#   <tool_call>{"name": ..., "arguments": {...}}</tool_call>;
# * `enable_thinking` opens a <think> block in the generation prompt, otherwise an
#   empty one is closed straight away.
CHAT_TEMPLATE = (
    "{%- set ns = namespace(start=0) -%}"
    "{%- if messages and messages[0].role == 'system' -%}{%- set ns.start = 1 -%}{%- endif -%}"
    "{%- if tools -%}"
    "{{- '<|im_start|>system\\n' -}}"
    "{%- if ns.start == 1 -%}{{- messages[0].content + '\\n\\n' -}}{%- endif -%}"
    "{{- 'You can call these tools:\\n<tools>\\n' -}}"
    "{%- for tool in tools -%}{{- tool | tojson -}}{{- '\\n' -}}{%- endfor -%}"
    '{{- \'</tools>\\nTo call a tool, answer with <tool_call>{"name": "<tool name>", '
    '"arguments": {<arguments as JSON>}}</tool_call><|im_end|>\\n\' -}}'
    "{%- elif ns.start == 1 -%}"
    "{{- '<|im_start|>system\\n' + messages[0].content + '<|im_end|>\\n' -}}"
    "{%- endif -%}"
    "{%- for message in messages[ns.start:] -%}"
    "{%- if message.role == 'assistant' -%}"
    "{{- '<|im_start|>assistant\\n' -}}"
    "{{- '<think>\\n' + (message.reasoning_content or message.reasoning or '') + '\\n</think>\\n\\n' -}}"
    "{{- message.content or '' -}}"
    "{%- for tool_call in message.tool_calls or [] -%}"
    "{%- if tool_call.function is defined -%}{%- set tool_call = tool_call.function -%}{%- endif -%}"
    '{{- \'<tool_call>{"name": "\' + tool_call.name + \'", "arguments": \' -}}'
    "{%- if tool_call.arguments is string -%}{{- tool_call.arguments -}}"
    "{%- else -%}{{- tool_call.arguments | tojson -}}{%- endif -%}"
    "{{- '}</tool_call>' -}}"
    "{%- endfor -%}"
    "{{- '<|im_end|>\\n' -}}"
    "{%- elif message.role == 'tool' -%}"
    "{{- '<|im_start|>user\\n<tool_response>\\n' + message.content + '\\n</tool_response><|im_end|>\\n' -}}"
    "{%- else -%}"
    "{{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>\\n' -}}"
    "{%- endif -%}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}"
    "{{- '<|im_start|>assistant\\n' -}}"
    "{%- if enable_thinking is defined and enable_thinking -%}{{- '<think>\\n' -}}"
    "{%- else -%}{{- '<think>\\n\\n</think>\\n\\n' -}}{%- endif -%}"
    "{%- endif -%}"
)

# An experiment (``train_tiny_model.py --description-first``; run 7 in the README):
# each tool on one line with its description *before* its name, so a causal model
# can tie the name to what the tool does when it reads the name, which is what
# lets it pick the offered tool that matches the request.
CHAT_TEMPLATE_DESCRIPTION_FIRST = CHAT_TEMPLATE.replace(
    "{%- for tool in tools -%}{{- tool | tojson -}}{{- '\\n' -}}{%- endfor -%}",
    "{%- for tool in tools -%}"
    "{%- set fn = tool.function if tool.function is defined else tool -%}"
    "{{- '{\"description\": ' + (fn.description or '') | tojson + ', \"name\": ' -}}"
    "{{- fn.name | tojson + ', \"parameters\": ' + (fn.parameters or {}) | tojson + '}\\n' -}}"
    "{%- endfor -%}",
)
assert CHAT_TEMPLATE_DESCRIPTION_FIRST != CHAT_TEMPLATE

_WORDS = (
    "the a an and or but if then when while of to in on for with from by at as is are "
    "was were be been it this that these those there here what which who how why "
    "i you we they he she my your our their file files list read write run command "
    "weather time city date today tomorrow hello world thanks please help answer question "
    "code test tests function value result error path directory search query number sum "
    "add total price temperature sunny rain cloudy wind degrees celsius open close start "
    "stop server model token tokens stream request response message tool tools call "
    "calculator compute name arguments json object string integer boolean array true false "
    "null yes no good great fine done ok sure let me check think about first second next "
    "last step plan user assistant system can will should would could do does did make "
    "get set show find look up use new old big small one two three four five ten hundred "
    "paris london tokyo berlin madrid rome oslo lima cairo delhi main src readme python "
    "trio engine cache prefix batch queue slot"
).split()


def synthetic_corpus(seed: int, lines: int = 20000) -> list[str]:
    """English-like lines, JSON snippets and code-ish text for the BPE trainer."""
    rng = random.Random(seed)
    out: list[str] = []
    for i in range(lines):
        kind = i % 4
        if kind == 0:
            words = [rng.choice(_WORDS) for _ in range(rng.randint(4, 14))]
            out.append(" ".join(words).capitalize() + rng.choice([".", "?", "!"]))
        elif kind == 1:
            key, val = rng.choice(_WORDS), rng.choice(_WORDS)
            out.append(json.dumps({"name": f"{key}_{val}", "arguments": {key: val, "n": i}}))
        elif kind == 2:
            out.append(f"def {rng.choice(_WORDS)}_{rng.choice(_WORDS)}(x, y):\n    return x + y\n")
        else:
            out.append(f"/home/user/{rng.choice(_WORDS)}/{rng.choice(_WORDS)}.py {i} {i * 7 % 97}")
    return out


def build_tokenizer(out: Path, seed: int, texts: list[str] | None = None) -> None:
    """Train the byte-level BPE on ``texts`` (default: a generic synthetic corpus)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=CONFIG["vocab_size"],
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(texts or synthetic_corpus(seed), trainer=trainer)
    tokenizer.save(str(out / "tokenizer.json"))
    (out / "tokenizer_config.json").write_text(
        json.dumps(
            {
                "tokenizer_class": "PreTrainedTokenizerFast",
                "bos_token": None,
                "eos_token": "<|im_end|>",
                "pad_token": "<|endoftext|>",
                "unk_token": None,
                "additional_special_tokens": SPECIAL_TOKENS,
                "model_max_length": CONFIG["max_position_embeddings"],
                "clean_up_tokenization_spaces": False,
                "chat_template": CHAT_TEMPLATE,
            },
            indent=2,
        )
    )
    (out / "special_tokens_map.json").write_text(
        json.dumps({"eos_token": "<|im_end|>", "pad_token": "<|endoftext|>"}, indent=2)
    )


def write_template(out: Path, template: str = CHAT_TEMPLATE) -> None:
    """Refresh only the chat template of an existing model directory."""
    path = out / "tokenizer_config.json"
    config = json.loads(path.read_text())
    config["chat_template"] = template
    path.write_text(json.dumps(config, indent=2))


def write_config(out: Path) -> None:
    vocab = json.loads((out / "tokenizer.json").read_text())["model"]["vocab"]
    config = dict(CONFIG)
    config["eos_token_id"] = [vocab["<|im_end|>"], vocab["<|endoftext|>"]]
    (out / "config.json").write_text(json.dumps(config, indent=2))
    (out / "generation_config.json").write_text(
        json.dumps({"eos_token_id": config["eos_token_id"]}, indent=2)
    )


def init_weights(out: Path, seed: int) -> None:
    """Random weights through mlx-lm's own model class, saved as safetensors."""
    import mlx.core as mx
    from mlx.utils import tree_flatten
    from mlx_lm.models import qwen3

    mx.random.seed(seed)
    model = qwen3.Model(qwen3.ModelArgs.from_dict(CONFIG))
    weights = {k: v.astype(mx.bfloat16) for k, v in tree_flatten(model.parameters())}
    mx.save_safetensors(str(out / "model.safetensors"), weights, metadata={"format": "mlx"})


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--out", type=Path, default=Path(__file__).parent.parent / "mlxtrio/assets/tiny-chat"
    )
    parser.add_argument("--no-weights", action="store_true", help="write tokenizer and config only")
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    build_tokenizer(args.out, args.seed)
    write_config(args.out)
    if not args.no_weights:
        init_weights(args.out, args.seed)
    total = sum(p.stat().st_size for p in args.out.iterdir())
    print(f"wrote {args.out} ({total / 1e6:.1f} MB)")


if __name__ == "__main__":
    main()
