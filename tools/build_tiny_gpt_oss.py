"""Build a tiny random-weight gpt-oss checkpoint that mlx_lm.load() accepts, offline:
the tests' Harmony model (``mlxtrio serve --model OUT_DIR`` serves it).

    python tools/build_tiny_gpt_oss.py OUT_DIR [--seed 0]

Writes OUT_DIR/{config.json, generation_config.json, model.safetensors,
model.safetensors.index.json, tokenizer.json, tokenizer_config.json}.

* Model: mlx_lm.models.gpt_oss with hidden 64, 2 layers (sliding + full
  attention), 4 experts (2 per token), yarn rope like the real config.
  Random weights from the module's own initialisers (seeded).
* Tokenizer: byte-level BPE over the 256 byte symbols (no merges; every byte is
  a token), plus gpt-oss's Harmony special tokens as added special tokens, in
  the same *order* as o200k_harmony (ids differ: 256.. instead of 199998..).
* tokenizer_config.json carries a Jinja ``chat_template`` written for Harmony
  (HARMONY_TEMPLATE below). It follows openai/harmony's format document; it
  differs from gpt-oss's own template in that it renders every tool call of
  a turn (the checkpoint's renders the first), keeps tool results and string
  arguments as they are (it JSON-quotes them), and writes a date only when
  ``current_date`` is given (the checkpoint's writes today's, which changes
  the prompt, and so the prefix cache, every midnight).

Nothing is downloaded. CPU use: well under a second.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

# Same names and relative order as o200k_harmony's specials (the real ids are
# 199998, 199999, 200002, 200003, 200005, 200006, 200007, 200008, 200012, 200018).
SPECIAL_TOKENS = [
    "<|startoftext|>",
    "<|endoftext|>",
    "<|return|>",
    "<|constrain|>",
    "<|channel|>",
    "<|start|>",
    "<|end|>",
    "<|message|>",
    "<|call|>",
    "<|endofprompt|>",
]

HARMONY_TEMPLATE = r"""{#- Harmony (gpt-oss) chat template, for a test model.
    Extra kwargs: reasoning_effort ("low" | "medium" | "high", default "medium"),
    model_identity, current_date (no date when not given), knowledge_cutoff.
    Assistant reasoning is read from reasoning_content, reasoning or thinking. -#}
{%- macro text_of(content) -%}
    {%- if content is none -%}
    {%- elif content is string -%}{{- content -}}
    {%- else -%}{%- for part in content -%}{%- if part.type == "text" -%}{{- part.text -}}{%- endif -%}{%- endfor -%}
    {%- endif -%}
{%- endmacro -%}
{%- macro reasoning_of(m) -%}
    {%- if m.reasoning_content is defined and m.reasoning_content -%}{{- m.reasoning_content -}}
    {%- elif m.reasoning is defined and m.reasoning -%}{{- m.reasoning -}}
    {%- elif m.thinking is defined and m.thinking -%}{{- m.thinking -}}
    {%- endif -%}
{%- endmacro -%}
{%- macro ts_type(s, indent) -%}
    {%- if s is not mapping -%}any
    {%- elif s.enum is defined and s.enum -%}
        {%- for v in s.enum -%}{{- v|tojson -}}{%- if not loop.last %} | {% endif -%}{%- endfor -%}
    {%- elif s.type is defined and s.type is not string and s.type is iterable -%}
        {%- for t in s.type -%}{{- "number" if t == "integer" else t -}}{%- if not loop.last %} | {% endif -%}{%- endfor -%}
    {%- elif s.type == "string" -%}string
    {%- elif s.type == "number" or s.type == "integer" -%}number
    {%- elif s.type == "boolean" -%}boolean
    {%- elif s.type == "array" -%}
        {%- if s['items'] is defined -%}{{- ts_type(s['items'], indent) -}}[]{%- else -%}Array<any>{%- endif -%}
    {%- elif s.type == "object" -%}
        {{- "{\n" -}}
        {%- for k, v in (s.properties or {}).items() -%}
            {%- if v.description is defined and v.description -%}{{- indent ~ "// " ~ v.description ~ "\n" -}}{%- endif -%}
            {{- indent ~ k -}}{%- if k not in (s.required or []) -%}?{%- endif -%}: {{ ts_type(v, indent ~ "    ") -}},
            {%- if v.default is defined %} // default: {{ v.default if (v.default is string and v.enum is defined) else v.default|tojson }}{%- endif -%}
            {{- "\n" -}}
        {%- endfor -%}
        {{- indent ~ "}" -}}
    {%- elif s.anyOf is defined -%}
        {%- for v in s.anyOf -%}{{- ts_type(v, indent) -}}{%- if not loop.last %} | {% endif -%}{%- endfor -%}
    {%- else -%}any
    {%- endif -%}
{%- endmacro -%}
{%- macro render_functions(tools) -%}
    {{- "## functions\n\nnamespace functions {\n\n" -}}
    {%- for tool in tools -%}
        {%- set f = tool.function if tool.function is defined else tool -%}
        {%- if f.description is defined and f.description -%}{{- "// " ~ f.description ~ "\n" -}}{%- endif -%}
        {%- if f.parameters is defined and f.parameters and f.parameters.properties -%}
            {{- "type " ~ f.name ~ " = (_: " ~ ts_type(f.parameters, "") ~ ") => any;\n\n" -}}
        {%- else -%}
            {{- "type " ~ f.name ~ " = () => any;\n\n" -}}
        {%- endif -%}
    {%- endfor -%}
    {{- "} // namespace functions" -}}
{%- endmacro -%}

{#- System message: identity, dates, reasoning effort, channels. -#}
{{- "<|start|>system<|message|>" -}}
{{- (model_identity if model_identity is defined and model_identity else "You are ChatGPT, a large language model trained by OpenAI.") ~ "\n" -}}
{{- "Knowledge cutoff: " ~ (knowledge_cutoff if knowledge_cutoff is defined and knowledge_cutoff else "2024-06") ~ "\n" -}}
{%- if current_date is defined and current_date -%}{{- "Current date: " ~ current_date ~ "\n" -}}{%- endif -%}
{{- "\nReasoning: " ~ (reasoning_effort if reasoning_effort is defined and reasoning_effort else "medium") ~ "\n\n" -}}
{{- "# Valid channels: analysis, commentary, final. Channel must be included for every message." -}}
{%- if tools -%}{{- "\nCalls to these tools must go to the commentary channel: 'functions'." -}}{%- endif -%}
{{- "<|end|>" -}}

{#- Developer message: the client's system/developer instructions and the function tools. -#}
{%- set ns = namespace(instructions=[]) -%}
{%- for m in messages -%}
    {%- if m.role == "system" or m.role == "developer" -%}{%- set ns.instructions = ns.instructions + [text_of(m.content)] -%}{%- endif -%}
{%- endfor -%}
{%- set loop_messages = messages | rejectattr("role", "in", ["system", "developer"]) | list -%}
{%- if ns.instructions or tools -%}
    {{- "<|start|>developer<|message|>" -}}
    {%- if ns.instructions -%}{{- "# Instructions\n\n" ~ (ns.instructions | join("\n\n")) -}}{%- endif -%}
    {%- if ns.instructions and tools -%}{{- "\n\n" -}}{%- endif -%}
    {%- if tools -%}{{- "# Tools\n\n" ~ render_functions(tools) -}}{%- endif -%}
    {{- "<|end|>" -}}
{%- endif -%}

{#- Conversation. -#}
{%- set last_call = namespace(name=none) -%}
{%- for message in loop_messages -%}
    {%- if message.role == "user" -%}
        {{- "<|start|>user<|message|>" ~ text_of(message.content) ~ "<|end|>" -}}
    {%- elif message.role == "assistant" and message.tool_calls is defined and message.tool_calls -%}
        {#- Analysis before a call is kept while the model is still working on the turn,
            i.e. until an assistant message without tool calls (a final answer) follows. -#}
        {%- set later = namespace(final=false) -%}
        {%- for m in loop_messages[loop.index:] -%}
            {%- if m.role == "assistant" and not (m.tool_calls is defined and m.tool_calls) -%}{%- set later.final = true -%}{%- endif -%}
        {%- endfor -%}
        {%- set r = reasoning_of(message) -%}
        {%- if r and not later.final -%}
            {{- "<|start|>assistant<|channel|>analysis<|message|>" ~ r ~ "<|end|>" -}}
        {%- endif -%}
        {%- if text_of(message.content) -%}
            {{- "<|start|>assistant<|channel|>commentary<|message|>" ~ text_of(message.content) ~ "<|end|>" -}}
        {%- endif -%}
        {%- for tc in message.tool_calls -%}
            {%- set f = tc.function if tc.function is defined else tc -%}
            {{- "<|start|>assistant<|channel|>commentary to=functions." ~ f.name ~ " <|constrain|>json<|message|>" -}}
            {{- f.arguments if f.arguments is string else f.arguments|tojson -}}
            {{- "<|call|>" -}}
            {%- set last_call.name = f.name -%}
        {%- endfor -%}
    {%- elif message.role == "assistant" -%}
        {%- if loop.last and not add_generation_prompt -%}
            {#- Training / prefill of a finished turn: keep its analysis, end with <|return|>. -#}
            {%- if reasoning_of(message) -%}
                {{- "<|start|>assistant<|channel|>analysis<|message|>" ~ reasoning_of(message) ~ "<|end|>" -}}
            {%- endif -%}
            {{- "<|start|>assistant<|channel|>final<|message|>" ~ text_of(message.content) ~ "<|return|>" -}}
        {%- else -%}
            {#- Analysis of a finished turn is dropped. -#}
            {{- "<|start|>assistant<|channel|>final<|message|>" ~ text_of(message.content) ~ "<|end|>" -}}
        {%- endif -%}
    {%- elif message.role == "tool" -%}
        {%- set tool = namespace(name=(message.name if message.name is defined and message.name else none)) -%}
        {%- if tool.name is none and message.tool_call_id is defined -%}
            {%- for prev in loop_messages[:loop.index0] -%}
                {%- if prev.role == "assistant" and prev.tool_calls is defined and prev.tool_calls -%}
                    {%- for tc in prev.tool_calls -%}
                        {%- if tc.id is defined and tc.id == message.tool_call_id -%}
                            {%- set tool.name = (tc.function if tc.function is defined else tc).name -%}
                        {%- endif -%}
                    {%- endfor -%}
                {%- endif -%}
            {%- endfor -%}
        {%- endif -%}
        {%- if tool.name is none -%}{%- set tool.name = last_call.name -%}{%- endif -%}
        {%- if tool.name is none -%}{{- raise_exception("A tool message must follow an assistant tool call.") -}}{%- endif -%}
        {{- "<|start|>functions." ~ tool.name ~ " to=assistant<|channel|>commentary<|message|>" -}}
        {{- (message.content if message.content is string else text_of(message.content)) ~ "<|end|>" -}}
    {%- endif -%}
{%- endfor -%}
{%- if add_generation_prompt -%}<|start|>assistant{%- endif -%}"""


def bytes_to_unicode() -> dict[int, str]:
    """GPT-2's byte -> printable character map (what ByteLevel pre-tokenizes to)."""
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1))
    bs += list(range(ord("®"), ord("ÿ") + 1))
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return dict(zip(bs, (chr(c) for c in cs), strict=True))


def build_tokenizer(out: Path) -> int:
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers

    vocab = {ch: i for i, ch in enumerate(bytes_to_unicode().values())}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()  # mlx-lm then picks BPEStreamingDetokenizer
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in SPECIAL_TOKENS])
    tok.save(str(out / "tokenizer.json"))

    (out / "tokenizer_config.json").write_text(
        json.dumps(
            {
                "tokenizer_class": "PreTrainedTokenizerFast",
                "bos_token": "<|startoftext|>",
                "eos_token": "<|return|>",  # as the real gpt-oss tokenizer_config
                "pad_token": "<|endoftext|>",
                "model_max_length": 4096,
                "clean_up_tokenization_spaces": False,
                "chat_template": HARMONY_TEMPLATE,
            },
            indent=2,
        )
    )
    return tok.get_vocab_size(with_added_tokens=True)


def build_model(out: Path, vocab_size: int, ids: dict[str, int], seed: int) -> None:
    import mlx.core as mx
    from mlx_lm.models.gpt_oss import Model, ModelArgs
    from mlx_lm.utils import save_config, save_model

    config = {
        "model_type": "gpt_oss",
        "architectures": ["GptOssForCausalLM"],
        "vocab_size": vocab_size,
        "hidden_size": 64,
        "intermediate_size": 64,
        "head_dim": 16,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "num_hidden_layers": 2,
        "layer_types": ["sliding_attention", "full_attention"],
        "sliding_window": 8,
        "num_local_experts": 4,
        "num_experts_per_tok": 2,
        "experts_per_token": 2,
        "rms_norm_eps": 1e-5,
        "rope_theta": 150000,
        "rope_scaling": {
            "rope_type": "yarn",
            "factor": 32.0,
            "beta_fast": 32.0,
            "beta_slow": 1.0,
            "original_max_position_embeddings": 4096,
            "truncate": False,
        },
        "max_position_embeddings": 131072,
        "tie_word_embeddings": False,
        "eos_token_id": ids["<|return|>"],
        "pad_token_id": ids["<|endoftext|>"],
    }
    mx.random.seed(seed)
    model = Model(ModelArgs.from_dict(config))
    # Attention sinks start at zero; give them (and everything else) random values.
    for layer in model.layers:
        layer.self_attn.sinks = mx.random.normal(layer.self_attn.sinks.shape) * 0.1
    mx.eval(model.parameters())
    save_model(out, model)
    save_config(config, out / "config.json")
    # As gpt-oss's generation_config.json: stop on <|return|>, <|endoftext|>, <|call|>.
    (out / "generation_config.json").write_text(
        json.dumps(
            {
                "bos_token_id": ids["<|startoftext|>"],
                "eos_token_id": [ids["<|return|>"], ids["<|endoftext|>"], ids["<|call|>"]],
                "pad_token_id": ids["<|endoftext|>"],
                "do_sample": True,
            },
            indent=2,
        )
    )


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("out", type=Path)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    vocab_size = build_tokenizer(args.out)
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(args.out / "tokenizer.json"))
    ids = {t: tok.token_to_id(t) for t in SPECIAL_TOKENS}
    build_model(args.out, vocab_size, ids, args.seed)
    print(f"wrote {args.out}: vocab {vocab_size}, specials {ids}")


if __name__ == "__main__":
    main()
