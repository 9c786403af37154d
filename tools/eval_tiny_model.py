"""Evaluate the embedded tiny model on held-out prompts.

    python tools/eval_tiny_model.py [--model PATH] [--seed 12345] [--n 300]

Prompts come from the training generator with a different seed and the *eval*
pool of tool names (never seen in training). Generation is greedy through the
real mlx-lm loading path and ``BatchGenerator``; outputs are parsed with the
server's own output parser. Prints:

* EOS rate within the output cap (target >= 99 %),
* tool-call JSON validity (>= 95 %), offered-tool selection accuracy (>= 90 %),
  required-arguments completeness,
* reasoning format rate when thinking is on (>= 95 %),
* EOS rate and output length on agent-sized prompts (~4k and ~20k tokens).
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tools"))

import tinychat_data as data  # noqa: E402
from foreign_text import ForeignText, add_foreign_context  # noqa: E402

from mlxtrio.chat.output import OutputParser  # noqa: E402
from mlxtrio.chat.prompt import ends_in_open_think  # noqa: E402
from mlxtrio.settings import EMBEDDED_MODEL_PATH  # noqa: E402


def generate_all(
    model, tokenizer, prompts: list[list[int]], max_tokens: int, batch: int = 8, processors=None
):
    """Greedy outputs: list of (token ids, finish reason); ``processors``: one
    list of logits processors per prompt."""
    from mlx_lm.generate import BatchGenerator

    results: dict[int, list[int]] = {}
    reasons: dict[int, str] = {}
    gen = BatchGenerator(
        model,
        max_tokens=max_tokens,
        stop_tokens=[[t] for t in tokenizer.eos_token_ids],
        completion_batch_size=batch,
        prefill_batch_size=batch,
        prefill_step_size=1024,
    )
    uids = gen.insert(prompts, [max_tokens] * len(prompts), logits_processors=processors)
    index = {uid: i for i, uid in enumerate(uids)}
    for uid in uids:
        results[uid] = []
    while responses := gen.next_generated():
        for r in responses:
            if r.finish_reason != "stop":
                results[r.uid].append(r.token)
            if r.finish_reason is not None:
                reasons[r.uid] = r.finish_reason
    gen.close()
    out = [None] * len(prompts)
    for uid, i in index.items():
        out[i] = (results[uid], reasons.get(uid, "length"))
    return out


def served_constraints(loaded, sample: data.Sample, starts_in_reasoning: bool) -> list:
    """The logits processors the server puts on this prompt's generation: the
    same constraints (``mlxtrio.grammar.planning.plan_output``: each call held
    to an offered tool and its schema) through the engine's own processors."""
    import trio

    from mlxtrio.chat.conversation import Conversation, Message, ToolSpec
    from mlxtrio.engine.processors.assembly import ProcessorFactory
    from mlxtrio.grammar.planning import plan_output

    tools = [
        ToolSpec(t["function"]["name"], "", t["function"].get("parameters") or {})
        for t in sample.tools or []
    ]
    conversation = Conversation([Message("user", "")], tools, sample.thinking)
    plan = trio.run(plan_output, _output_facts(loaded), conversation, starts_in_reasoning)
    factory = ProcessorFactory(loaded.tokenizer, loaded.token_texts)
    return [factory.constraint(c) for c in plan.constraints]


_FACTS: dict[int, object] = {}


def _output_facts(loaded):
    """What constraint planning reads of a model loaded here (one grammar
    compiler per model, as the server keeps)."""
    from mlxtrio.grammar.compiler import GrammarCompiler
    from mlxtrio.grammar.planning import OutputFacts

    if id(loaded) not in _FACTS:
        compiler = GrammarCompiler(loaded.grammar_tokenizer)
        _FACTS[id(loaded)] = OutputFacts.of("eval", loaded, compiler)
    return _FACTS[id(loaded)]


def _matches_schema(call, tools) -> bool:
    """Whether ``call`` names an offered tool and its arguments validate
    against that tool's JSON Schema."""
    import jsonschema

    for tool in tools or []:
        function = tool["function"]
        if function["name"] == call.name:
            try:
                jsonschema.validate(json.loads(call.arguments), function.get("parameters") or {})
            except jsonschema.ValidationError:
                return False
            return True
    return False


def parse(tokenizer, sample: data.Sample, ids: list[int]):
    text = tokenizer.decode(ids)
    tools = sample.tools
    parser = OutputParser(tokenizer, tools, starts_in_reasoning=sample.thinking)
    segments = parser.feed(text) + parser.finish()
    calls = [s.tool_call for s in segments if s.tool_call is not None]
    reasoning = "".join(s.text for s in segments if s.kind == "reasoning")
    answer = "".join(s.text for s in segments if s.kind == "text")
    raw_calls = text.count("<tool_call>")
    return text, calls, reasoning, answer, raw_calls, parser.invalid_tool_calls


def long_prompt_samples(
    rng: random.Random, target_tokens: int, tokenizer, n: int, foreign: ForeignText | None = None
) -> list[list[int]]:
    """``n`` held-out prompts whose system prompt is grown past ``target_tokens``:
    with the stock rules lines, or with held-out real-world text (``foreign``)."""
    prompts = []
    for _ in range(n):
        sample = data.make_sample(rng, split="eval", long_ratio=1.0)
        system = sample.messages[0]["content"] if sample.messages[0]["role"] == "system" else ""
        filler = system
        messages = sample.messages
        while True:
            ids = tokenizer.apply_chat_template(
                messages,
                tools=sample.tools,
                add_generation_prompt=True,
                enable_thinking=sample.thinking,
            )
            if len(ids) >= target_tokens:
                break
            more = foreign.excerpt(rng, 4000) if foreign else data._system_prompt(rng, True)
            filler += "\n" + more
            messages = [{"role": "system", "content": filler}] + [
                m for m in sample.messages if m["role"] != "system"
            ]
        prompts.append(ids)
    return prompts


def _selection_breakdown(selection: dict[tuple[str, bool, int], list[int]]) -> str:
    """Right/asked by call count, by thinking and by the number of tools offered."""

    def total(match) -> str:
        right = sum(v[0] for k, v in selection.items() if match(k))
        asked = sum(v[1] for k, v in selection.items() if match(k))
        return f"{right}/{asked}"

    offered = sorted({k[2] for k in selection})
    return "selection by case:           " + ", ".join(
        [
            f"one call {total(lambda k: k[0] == 'tool')}",
            f"two calls {total(lambda k: k[0] == 'tool2')}",
            f"thinking on {total(lambda k: k[1])}",
            f"off {total(lambda k: not k[1])}",
            "tools offered "
            + " ".join(
                f"{n if n < 6 else '6+'}: {total(lambda k, n=n: k[2] == n)}" for n in offered
            ),
        ]
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=str(EMBEDDED_MODEL_PATH))
    parser.add_argument("--seed", type=int, default=12345)
    parser.add_argument("--n", type=int, default=300)
    parser.add_argument("--max-tokens", type=int, default=256)
    parser.add_argument("--long", type=int, default=4, help="prompts per long size (0 to skip)")
    parser.add_argument(
        "--constrained",
        action="store_true",
        help="as the server generates: each call held to an offered tool and its schema",
    )
    parser.add_argument(
        "--dtype", default="auto", help="compute dtype, as the server's COMPUTE_DTYPE setting"
    )
    parser.add_argument(
        "--foreign",
        action="store_true",
        help="held-out prompts carry held-out real-world text, as agent clients' do "
        "(see foreign_text), and the long prompts are grown with it",
    )
    args = parser.parse_args()

    from mlxtrio.engine.model import load_model

    loaded = load_model("eval", args.model, args.dtype)
    model, tokenizer = loaded.model, loaded.tokenizer
    print(f"computing in {loaded.dtype}", flush=True)
    rng = random.Random(args.seed)
    samples = [data.make_sample(rng, split="eval", long_ratio=0.05) for _ in range(args.n)]
    foreign = ForeignText("eval") if args.foreign else None
    if foreign is not None:
        foreign_rng = random.Random(args.seed + 13)
        for sample in samples:
            add_foreign_context(sample, foreign, foreign_rng)
    prompts = [
        tokenizer.apply_chat_template(
            s.messages, tools=s.tools, add_generation_prompt=True, enable_thinking=s.thinking
        )
        for s in samples
    ]
    processors = None
    if args.constrained:
        processors = [
            served_constraints(loaded, s, ends_in_open_think(tokenizer, p))
            for s, p in zip(samples, prompts, strict=True)
        ]
    started = time.monotonic()
    outputs = generate_all(model, tokenizer, prompts, args.max_tokens, processors=processors)
    elapsed = time.monotonic() - started

    eos = sum(reason == "stop" for _, reason in outputs)
    valid = complete = exact = 0
    calls_made = schema_valid = markers = 0  # every call, against the called tool's schema
    invalid_examples: list[str] = []
    # selection by (single/two calls, thinking, tools offered): (right, asked)
    selection: dict[tuple[str, bool, int], list[int]] = {}
    thinking_samples = well_formed = 0
    examples: dict[str, str] = {}
    for sample, (ids, _reason) in zip(samples, outputs, strict=True):
        text, calls, reasoning, answer, raw_calls, invalid = parse(tokenizer, sample, ids)
        examples.setdefault(sample.kind + ("+think" if sample.thinking else ""), text)
        markers += raw_calls
        for call in calls:
            calls_made += 1
            schema_valid += _matches_schema(call, sample.tools)
        if sample.kind in ("tool", "tool2"):
            if raw_calls and not invalid and len(calls) == raw_calls:
                valid += 1
            elif len(invalid_examples) < 3:
                invalid_examples.append(text)
            names = [c.name for c in calls]
            cell = selection.setdefault(
                (sample.kind, sample.thinking, min(len(sample.tools), 6)), [0, 0]
            )
            cell[1] += 1
            cell[0] += names == sample.expected_tools
            if (
                calls
                and len(calls) == len(sample.required)
                and all(
                    all(p in json.loads(c.arguments) for p in req)
                    for c, req in zip(calls, sample.required, strict=True)
                )
            ):
                complete += 1
            if [json.loads(c.arguments) for c in calls] == sample.arguments:
                exact += 1
        if sample.thinking:
            thinking_samples += 1
            if reasoning.strip() and "</think>" in text and (answer.strip() or calls):
                well_formed += 1

    correct = sum(right for right, _ in selection.values())
    tool_samples = sum(asked for _, asked in selection.values())

    def pct(a: int, b: int) -> str:
        return f"{100 * a / b:5.1f} % ({a}/{b})" if b else "   n/a"

    print(f"model: {args.model}")
    print(
        f"held-out prompts: {args.n} (seed {args.seed}, unseen tool names), output cap {args.max_tokens}, {elapsed:.0f} s"
        + (
            ", constrained as served (calls held to the offered tools' schemas)"
            if args.constrained
            else ""
        )
        + (", with real-world text in every prompt" if foreign else "")
    )
    print(f"EOS within cap:              {pct(eos, args.n)}   target >= 99 %")
    print(f"valid tool-call JSON:        {pct(valid, tool_samples)}   target >= 95 %")
    print(f"correct offered tool:        {pct(correct, tool_samples)}   target >= 90 %")
    print(f"required arguments present:  {pct(complete, tool_samples)}   (the expected calls' own)")
    print(
        f"calls valid for their tool:  {pct(schema_valid, calls_made)}   (arguments match the called tool's schema)"
    )
    print(f"argument values exact:       {pct(exact, tool_samples)}")
    print(f"well-formed reasoning:       {pct(well_formed, thinking_samples)}   target >= 95 %")
    print(_selection_breakdown(selection))
    for size in (4096, 20000) if args.long else ():
        long_prompts = long_prompt_samples(
            random.Random(args.seed + size), size, tokenizer, args.long, foreign
        )
        outs = generate_all(model, tokenizer, long_prompts, 512, batch=2)
        stops = sum(r == "stop" for _, r in outs)
        lengths = [len(ids) for ids, _ in outs]
        print(f"~{size}-token prompts:        EOS {stops}/{len(outs)}, output tokens {lengths}")
    for text in invalid_examples:
        print(f"  a tool request whose calls did not all parse: {text[:400]!r}")
    print("\nexamples:")
    for kind, text in sorted(examples.items()):
        print(f"  [{kind}] {text[:200]!r}")


if __name__ == "__main__":
    main()
