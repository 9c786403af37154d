"""What constrained decoding costs: decode speed under a JSON-schema grammar,
and how long grammars take to compile.

    python benchmarks/grammar_overhead.py [--model PATH] [--tokens 256] [--batch 1 4]
                                          [--captures ../shared/spec/captures]

1. Decode: ``BatchGenerator`` (greedy, as the engine drives it), with no logits
   processor and with the engine's :class:`GrammarProcessor` holding every
   sequence to a JSON schema from the first token: ``string`` (one long string
   value: the lexer's cheap case) and ``records`` (an array of objects with a
   string, an integer, an enum and a boolean: keys, separators and numbers all
   steered). The grammar waits for each token on the host before computing the
   next mask, so this is the whole cost, masks and lost overlap alike. Goal:
   >= 0.9x unconstrained.
2. Compile: each grammar the server builds for Claude Code's 24 tools (one call
   grammar with every tool's schema) and Codex's ``apply_patch`` (its Lark
   grammar inlined into a pattern), cold (a new compile) and as the engine
   pays per request (a ``deep_copy`` of the compiled matcher).

Models (random weights: they never stop early, and the schemas below never
close on their own within ``--tokens``): ``random``, the embedded model's
architecture (3 M parameters, ~300 tok/s here: the worst case, where a decode
step is about as long as the host's own work per step); ``small``, the same
tokenizer with 512-wide, 8-layer Qwen3 layers (~29 M parameters, the bench
size); or a path.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

from _decode import decode_tps as timed_decode  # noqa: E402
from engine_overhead import PROMPT, random_weights_model  # noqa: E402

import mlxtrio  # noqa: E402, F401  (before MLX: the server's BLAS)

SCHEMAS: dict[str, dict[str, Any]] = {
    "string": {
        "type": "object",
        "properties": {"story": {"type": "string"}},
        "required": ["story"],
    },
    "records": {
        "type": "array",
        "items": {
            "type": "object",
            "properties": {
                "name": {"type": "string", "maxLength": 12},
                "count": {"type": "integer"},
                "kind": {"enum": ["file", "directory", "link"]},
                "ok": {"type": "boolean"},
            },
            "required": ["name", "count", "kind", "ok"],
        },
    },
}


def small_model() -> str:
    """A ~29 M-parameter Qwen3 with the embedded tokenizer, random weights."""
    import shutil

    import mlx.core as mx
    from mlx.utils import tree_flatten
    from mlx_lm.models import qwen3

    base = Path(random_weights_model())
    out = base.parent / "random-small"
    shutil.copytree(base, out)
    config = json.loads((out / "config.json").read_text())
    config.update(
        hidden_size=512,
        num_hidden_layers=8,
        intermediate_size=1536,
        num_attention_heads=8,
        num_key_value_heads=4,
        head_dim=64,
    )
    (out / "config.json").write_text(json.dumps(config, indent=2))
    mx.random.seed(0)
    model = qwen3.Model(qwen3.ModelArgs.from_dict(config))
    weights = {k: v.astype(mx.bfloat16) for k, v in tree_flatten(model.parameters())}
    mx.save_safetensors(str(out / "model.safetensors"), weights, metadata={"format": "mlx"})
    return str(out)


def decode_tps(
    model: Any, tokenizer: Any, grammars: Any, prompt: list[int], batch: int, tokens: int, mode: str
) -> float:
    from mlxtrio.engine.processors.grammar_masks import GrammarProcessor

    seen: list[list[int]] = [[] for _ in range(batch)]
    processors = None
    if mode != "none":
        matcher = grammars[mode]
        processors = [[GrammarProcessor(matcher, None, seen=seen[i])] for i in range(batch)]
    return timed_decode(model, prompt, batch, tokens, processors, seen)


def compile_seconds(tokenizer: Any, grammar: str, runs: int = 5) -> tuple[float, float]:
    """Median seconds of a cold compile and of a per-request copy."""
    from llguidance import LLMatcher

    cold, copies = [], []
    for _ in range(runs):
        started = time.perf_counter()
        matcher = LLMatcher(tokenizer, LLMatcher.grammar_from_lark(grammar))
        cold.append(time.perf_counter() - started)
        assert not matcher.is_error(), matcher.get_error()
        started = time.perf_counter()
        matcher.deep_copy()
        copies.append(time.perf_counter() - started)
    return statistics.median(cold), statistics.median(copies)


def _tools_in(path: Path) -> list[dict[str, Any]]:
    """The ``tools`` array of the first request in a capture file."""

    def find(node: Any) -> list[dict[str, Any]] | None:
        if isinstance(node, dict):
            if isinstance(node.get("tools"), list) and node["tools"]:
                return node["tools"]
            node = list(node.values())
        if isinstance(node, list):
            for child in node:
                found = find(child)
                if found:
                    return found
        return None

    return find(json.loads(path.read_text())) or []


def agent_grammars(captures: Path, end_token: int) -> dict[str, str]:
    """The call grammars the server builds for the captured clients' tools."""
    from mlxtrio.grammar.build import ToolGrammar
    from mlxtrio.grammar.calls import CallVocabulary, call_grammar
    from mlxtrio.grammar.lark_regex import lark_to_regex

    out = {}
    claude = _tools_in(captures / "claude-toolcall.json")
    if claude:
        tools = [ToolGrammar(t["name"], t.get("input_schema") or {}) for t in claude]
        out[f"Claude Code, {len(tools)} tools"] = (
            call_grammar("json_tools", tools, CallVocabulary(end_token)) or ""
        )
    patch = next(
        (t for t in _tools_in(captures / "codex-patch.json") if t.get("name") == "apply_patch"),
        None,
    )
    if patch is not None:
        pattern = lark_to_regex(patch["format"]["definition"])
        schema = {"type": "object", "properties": {"input": {"type": "string", "pattern": pattern}}}
        tools = [ToolGrammar("apply_patch", schema)]
        out["Codex apply_patch"] = (
            call_grammar("json_tools", tools, CallVocabulary(end_token)) or ""
        )
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="random", help="random, small or a path")
    parser.add_argument("--tokens", type=int, default=256)
    parser.add_argument("--batch", type=int, nargs="+", default=[1, 4])
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--captures", type=Path, default=ROOT.parent / "shared/spec/captures")
    args = parser.parse_args()
    from llguidance import LLMatcher

    from mlxtrio.engine.model import load_model
    from mlxtrio.grammar.build import json_value

    builders = {"random": random_weights_model, "small": small_model}
    path = builders[args.model]() if args.model in builders else args.model
    loaded = load_model("bench", path, "auto")
    model, tokenizer = loaded.model, loaded.tokenizer
    lltok = loaded.grammar_tokenizer
    grammars = {
        name: LLMatcher(lltok, LLMatcher.grammar_from_lark("start: " + json_value(schema, False)))
        for name, schema in SCHEMAS.items()
    }
    prompt = tokenizer.apply_chat_template(
        [{"role": "user", "content": PROMPT}], add_generation_prompt=True
    )
    print(f"model: {path} ({loaded.dtype}, vocabulary {loaded.vocab_size})")
    print(f"decode: {args.tokens} tokens per sequence, median of {args.runs}")
    modes = ["none", *SCHEMAS]
    for batch in args.batch:
        decode_tps(model, tokenizer, grammars, prompt, batch, 32, "none")  # warm up
        speeds: dict[str, list[float]] = {mode: [] for mode in modes}
        for _ in range(args.runs):  # interleaved, so drift hits every mode alike
            for mode in modes:
                speeds[mode].append(
                    decode_tps(model, tokenizer, grammars, prompt, batch, args.tokens, mode)
                )
        base = statistics.median(speeds["none"])
        for mode in modes:
            tps = statistics.median(speeds[mode])
            label = "unconstrained" if mode == "none" else f"schema {mode}"
            print(f"  batch {batch}  {label:16s} {tps:8.1f} tok/s  ratio {tps / base:.3f}")
    if not args.captures.exists():
        print(f"compile: no captures at {args.captures}; skipped")
        return
    print("compile (median of 5): cold compile, per-request copy")
    for name, grammar in agent_grammars(args.captures, loaded.tool_call_end_token or 0).items():
        cold, copy = compile_seconds(lltok, grammar)
        print(f"  {name:26s} {cold * 1000:8.2f} ms  {copy * 1e6:8.1f} us")


if __name__ == "__main__":
    main()
