"""What the tool-name constraint costs a decode step that it does not steer.

    python benchmarks/constraint_overhead.py [--model PATH] [--tokens 256] [--batch 1 4]

Every request that offers tools carries an ``OpeningConstraint`` (each call must
name an offered tool). Most steps are free text, where it should cost nothing.
Decodes with ``BatchGenerator`` (greedy, the same prompt per sequence) three ways:

* ``none``: no logits processor;
* ``noop``: a processor that returns the logits as they are (what mlx-lm's
  per-sequence processor path costs by itself);
* ``host view``: the constraint as the engine runs it, reading generated tokens
  from the host one step behind and deciding about the pending one on the device;
* ``device read``: the constraint reading each pending token with ``.item()``
  (what it did before), which makes every step wait for the previous one.

The trigger never fires (its token id is -1), so every step is a free step.
Default model: a random-weights copy of the embedded model (never stops early).
Prints tokens/s per mode and batch size, and each ratio to ``none``.
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

from _decode import decode_tps as timed_decode  # noqa: E402
from engine_overhead import PROMPT, random_weights_model  # noqa: E402

import mlxtrio  # noqa: E402, F401  (before MLX: the server's BLAS)


def decode_tps(model, tokenizer, prompt: list[int], batch: int, tokens: int, mode: str) -> float:
    from mlxtrio.engine.processors.openings import OpeningConstraint, TokenTexts
    from mlxtrio.grammar.shapes import CALL_SHAPES

    vocab = TokenTexts.from_tokenizer(tokenizer)
    openings = CALL_SHAPES["json_tools"].openings(["get_weather", "run_command"])
    seen: list[list[int]] = [[] for _ in range(batch)]
    processors = None
    if mode == "noop":
        processors = [[lambda context, logits: logits] for _ in range(batch)]
    elif mode != "none":
        processors = [
            [OpeningConstraint(openings, -1, vocab, True, (), seen[i] if mode == "host" else None)]
            for i in range(batch)
        ]
    return timed_decode(model, prompt, batch, tokens, processors, seen)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="random")
    parser.add_argument("--tokens", type=int, default=256)
    parser.add_argument("--batch", type=int, nargs="+", default=[1, 4])
    parser.add_argument("--runs", type=int, default=3)
    args = parser.parse_args()
    from mlx_lm import load

    from mlxtrio.engine.precision import apply_compute_dtype

    path = random_weights_model() if args.model == "random" else args.model
    model, tokenizer = load(path)
    dtype = apply_compute_dtype(model, "auto").dtype
    prompt = tokenizer.apply_chat_template(
        [{"role": "user", "content": PROMPT}], add_generation_prompt=True
    )
    print(f"model: {path} ({dtype}), {args.tokens} tokens per sequence, median of {args.runs}")
    modes = ["none", "noop", "host", "device"]
    for batch in args.batch:
        decode_tps(model, tokenizer, prompt, batch, 32, "none")  # warm up
        speeds: dict[str, list[float]] = {mode: [] for mode in modes}
        for _ in range(args.runs):  # interleaved, so drift hits every mode alike
            for mode in modes:
                speeds[mode].append(decode_tps(model, tokenizer, prompt, batch, args.tokens, mode))
        base = statistics.median(speeds["none"])
        for mode in modes:
            tps = statistics.median(speeds[mode])
            label = {"none": "none", "noop": "noop", "host": "host view", "device": "device read"}[
                mode
            ]
            print(f"batch {batch}  {label:12s} {tps:8.1f} tok/s  ratio {tps / base:.3f}")


if __name__ == "__main__":
    main()
