"""Images on a vision-language model: what an image's encode costs, what it
does to the streams running beside it, and what the prefix cache saves.

    python benchmarks/vision.py [--out benchmarks/results/vision] [--tokens 1024]

Builds a random-weight Qwen2.5-VL at bench size (language model 512 wide, 8
layers; vision tower 512 wide, 8 blocks; images of up to ``--tokens`` image
tokens, a 1280 x 800 screenshot fills them) with ``tools/build_tiny_vlm.py``,
and serves it (``mlxtrio serve`` in a subprocess). Three measurements:

1. **cold vs warm**: a turn with a fresh screenshot (its encode and prefill,
   one output token), then the conversation's next turn with the same image
   (reused from the prefix cache); time to the answer and ``X-Cached-Tokens``.
2. **running streams**: two text streams decode; a request with a new
   screenshot arrives; the streams' inter-token gaps before it and while it is
   encoded and prefilled (p50, p95, max).
3. **a changed image** at the same place: its turn time (a miss past it).
"""

from __future__ import annotations

import argparse
import base64
import importlib.util
import io
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx
import numpy as np
import trio

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(Path(__file__).parent))

from _servers import wait_ready  # noqa: E402


def build_model(out: Path, tokens: int) -> Path:
    spec = importlib.util.spec_from_file_location("builder", ROOT / "tools/build_tiny_vlm.py")
    assert spec is not None and spec.loader is not None
    builder = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(builder)
    text = {
        "hidden_size": 512,
        "intermediate_size": 1536,
        "num_hidden_layers": 8,
        "num_attention_heads": 8,
        "num_key_value_heads": 4,
        "rope_scaling": {"type": "mrope", "mrope_section": [8, 12, 12]},  # head_dim 64
    }
    vision = {
        "depth": 8,
        "hidden_size": 512,
        "intermediate_size": 1536,
        "out_hidden_size": 512,
        "num_heads": 8,
        "fullatt_block_indexes": [3, 7],
        "window_size": 112,
    }
    path = out / "qwen2_5_vl-bench"
    builder.build_qwen2_5_vl(path, "float32", 0, text, vision, max_pixels=28 * 28 * tokens)
    return path


def screenshot(seed: int, size: tuple[int, int] = (1280, 800)) -> str:
    from PIL import Image

    rng = np.random.RandomState(seed)
    # Flat panels with some noise: a screenshot compresses; pure noise does not.
    pixels = np.repeat(
        np.repeat(rng.randint(0, 255, (size[1] // 40, size[0] // 40, 3)), 40, 0), 40, 1
    )
    pixels = (pixels + rng.randint(0, 8, pixels.shape)).clip(0, 255).astype("uint8")
    out = io.BytesIO()
    Image.fromarray(pixels).save(out, "PNG")
    return "data:image/png;base64," + base64.b64encode(out.getvalue()).decode()


def messages(image: str, reply: str | None = None) -> list[dict]:
    first = {
        "role": "user",
        "content": [
            {"type": "text", "text": "Here is a screenshot of the failing page."},
            {"type": "image_url", "image_url": {"url": image}},
        ],
    }
    if reply is None:
        return [first]
    return [first, {"role": "assistant", "content": reply}, {"role": "user", "content": "Why?"}]


async def turn(client: httpx.AsyncClient, body: list[dict], tokens: int = 1) -> dict:
    started = time.perf_counter()
    r = await client.post(
        "/v1/chat/completions",
        json={"model": "vlm", "messages": body, "max_tokens": tokens, "temperature": 0},
    )
    r.raise_for_status()
    return {
        "seconds": time.perf_counter() - started,
        "cached": int(r.headers.get("x-cached-tokens", 0)),
        "prompt": r.json()["usage"]["prompt_tokens"],
        "reply": r.json()["choices"][0]["message"]["content"],
    }


async def stream_gaps(client: httpx.AsyncClient, stamps: list[float], tokens: int) -> None:
    body = {
        "model": "vlm",
        "messages": [{"role": "user", "content": "Write a long story about a lighthouse."}],
        "max_tokens": tokens,
        "stream": True,
        "temperature": 0,
    }
    async with client.stream("POST", "/v1/chat/completions", json=body) as r:
        async for line in r.aiter_lines():
            if line.startswith("data: {"):
                stamps.append(time.perf_counter())


def gaps_between(stamps: list[float], start: float, end: float) -> list[float]:
    return [b - a for a, b in zip(stamps, stamps[1:], strict=False) if start <= b <= end]


def summary(gaps: list[float]) -> dict:
    if not gaps:
        return {"n": 0}
    ordered = sorted(gaps)
    return {
        "n": len(gaps),
        "p50": statistics.median(ordered),
        "p95": ordered[int(0.95 * (len(ordered) - 1))],
        "max": ordered[-1],
    }


async def measure(url: str) -> dict:
    results: dict = {}
    async with httpx.AsyncClient(base_url=url, timeout=600) as client:
        await turn(client, [{"role": "user", "content": "warm up"}], 4)
        image = screenshot(1)
        cold = await turn(client, messages(image))
        warm = await turn(client, messages(image, cold["reply"]))
        changed = await turn(client, messages(screenshot(2), cold["reply"]))
        results["cold"], results["warm"], results["changed"] = cold, warm, changed
        # Streams beside an encode.
        stamps: list[list[float]] = [[], []]
        marks: dict[str, float] = {}
        async with trio.open_nursery() as nursery:
            for s in stamps:
                nursery.start_soon(stream_gaps, client, s, 400)
            await trio.sleep(3.0)
            marks["image_sent"] = time.perf_counter()
            with_image = await turn(client, messages(screenshot(3)))
            marks["image_done"] = time.perf_counter()
        before = [g for s in stamps for g in gaps_between(s, 0, marks["image_sent"])]
        during = [
            g for s in stamps for g in gaps_between(s, marks["image_sent"], marks["image_done"])
        ]
        results["beside"] = {
            "image_turn": with_image,
            "gaps_before": summary(before[2:]),  # the first gaps hold the streams' own prefill
            "gaps_during": summary(during),
        }
    return results


def table(results: dict) -> str:
    lines = [
        "Qwen2.5-VL at bench size (random weights; language model 512 wide, 8 layers; vision"
        " tower 512 wide, 8 blocks, 2 with full attention), float32, a 1280 x 800 screenshot"
        " = 4,000 patches = 1,000 image tokens; `benchmarks/vision.py`.",
        "",
        "| turn | seconds | prompt tokens | cached |",
        "|---|---:|---:|---:|",
    ]
    for name in ("cold", "warm", "changed"):
        r = results[name]
        lines.append(f"| {name} | {r['seconds']:.2f} | {r['prompt']} | {r['cached']} |")
    b = results["beside"]
    lines += [
        "",
        f"Image turn beside two streams: {b['image_turn']['seconds']:.2f} s "
        f"({b['image_turn']['prompt']} prompt tokens).",
        "",
        "| streams' inter-token gap | n | p50 ms | p95 ms | max ms |",
        "|---|---:|---:|---:|---:|",
    ]
    for name in ("gaps_before", "gaps_during"):
        g = b[name]
        if g["n"]:
            lines.append(
                f"| {name.removeprefix('gaps_')} the image | {g['n']} | {g['p50'] * 1e3:.0f} | "
                f"{g['p95'] * 1e3:.0f} | {g['max'] * 1e3:.0f} |"
            )
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tokens", type=int, default=1024, help="image tokens per screenshot")
    parser.add_argument("--out", help="write OUT.json and OUT.md")
    args = parser.parse_args()
    work = Path(tempfile.mkdtemp(prefix="mlxtrio-vision-"))
    model = build_model(work, args.tokens)
    port = 8900 + int(time.time()) % 90
    url = f"http://127.0.0.1:{port}"
    argv = [
        sys.executable, "-m", "mlxtrio", "serve", "--port", str(port), "--model", str(model),
        "--model-name", "vlm", "--data-dir", str(work / "data"),
    ]  # fmt: skip
    log = (work / "server.log").open("w")
    proc = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT)
    try:
        wait_ready(url, "/health", proc)
        results = trio.run(measure, url)
    finally:
        proc.terminate()
        proc.wait(30)
        log.close()
    report = table(results)
    print(report)
    print(f"server log: {work / 'server.log'}")
    if args.out:
        Path(args.out + ".json").write_text(json.dumps(results, indent=2))
        Path(args.out + ".md").write_text(report + "\n")


if __name__ == "__main__":
    main()
