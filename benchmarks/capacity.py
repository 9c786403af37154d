"""How many sequences to decode at once: mlxtrio's ``CAPACITY`` against
aggregate throughput and time to first token, on this machine.

    python benchmarks/capacity.py [--model embedded|small] [--capacities 4,8,16]
                                  [--streams 1,4,8,16] [--out benchmarks/results/capacity.md]

For each capacity, a fresh ``mlxtrio serve --capacity N`` on the model's
random-weight float32 twin (every request decodes what it asks for), then
1, 4, 8 and 16 concurrent streams of ``--tokens`` tokens: generated tokens
per wall-clock second, and the median time to first token (the client's:
a stream beyond the capacity waits for a slot). Figures for the README's
choice of the default.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from side_by_side import concurrent_streams, machine, models, serving  # noqa: E402


def load(server, streams: int, tokens: int) -> tuple[float, float]:
    runs, elapsed = concurrent_streams(server, streams, tokens, "Tale")
    ttft = statistics.median(r.deltas[0] - r.started for r in runs if r.deltas)
    return sum(r.tokens or len(r.deltas) for r in runs) / elapsed, ttft


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="small")
    parser.add_argument("--capacities", default="4,8,16")
    parser.add_argument("--streams", default="1,4,8,16")
    parser.add_argument("--tokens", type=int, default=96)
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    _, twin = models(args.model)
    streams = [int(n) for n in args.streams.split(",")]
    lines = [
        "| capacity | " + " | ".join(f"{n} streams: tok/s, TTFT" for n in streams) + " |",
        "|---" * (len(streams) + 1) + "|",
    ]
    for capacity in (int(c) for c in args.capacities.split(",")):
        cells = []
        with serving(
            "mlxtrio", twin, ("--capacity", str(capacity), "--waiting-room", "64")
        ) as server:
            for n in streams:
                tps, ttft = load(server, n, args.tokens)
                cells.append(f"{tps:.1f}, {ttft:.2f} s")
                print(
                    f"capacity {capacity}, {n} streams: {tps:.1f} tok/s, TTFT {ttft:.2f} s",
                    flush=True,
                )
        lines.append(f"| {capacity} | " + " | ".join(cells) + " |")
    text = "\n".join(lines)
    print(text)
    if args.out:
        args.out.write_text(
            f"# CAPACITY on this machine: {args.model} model\n\n"
            f"`python benchmarks/capacity.py --model {args.model}` ({args.tokens} tokens a stream, "
            f"{time.strftime('%Y-%m-%d')}). Machine: {machine()}.\n\n{text}\n"
        )


if __name__ == "__main__":
    main()
