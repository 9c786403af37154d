"""Replay captured agent-client requests against a running server.

    python tools/eval_captures.py CAPTURE.json [...] [--url http://127.0.0.1:8000]
        [--max-tokens 512]

Each capture file holds the requests a real client (Claude Code, Codex) sent,
as ``{"client": ..., "requests": [{"method", "path", "body"}, ...]}``. The first
generation request of each is sent as is, except that streaming is off and the
output is capped at ``--max-tokens``; the script prints how the turn ended
(``end_turn`` / ``tool_use`` / ``completed`` is a stop, ``max_tokens`` /
``incomplete`` is not), the prompt and output token counts, and the head of the
output. Start the server first, e.g.::

    MLXTRIO_MODEL=/tmp/r14 make run

These prompts (16k-34k tokens of real system prompt, tools and reminders) are
the check that matters for "stops on agent-sized prompts": synthetic filler
was passed by models that rambled on these (the README's runs 9 and 13).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Any

import httpx


def first_generation_request(capture: dict[str, Any]) -> tuple[str, dict[str, Any]] | None:
    """(path, body) of the capture's first request that generates, if any."""
    for request in capture.get("requests", []):
        path = request.get("path", "").split("?")[0]
        body = request.get("body")
        if request.get("method") == "POST" and path in ("/v1/messages", "/v1/responses"):
            if isinstance(body, str):
                body = json.loads(body)
            return path, body
    return None


def summarize(path: str, reply: dict[str, Any]) -> tuple[bool, str, int | None, int | None, str]:
    """(stopped, how it ended, prompt tokens, output tokens, output head)."""
    usage = reply.get("usage") or {}
    if path == "/v1/messages":
        ended = str(reply.get("stop_reason"))
        prompt = usage.get("input_tokens", 0) + usage.get("cache_read_input_tokens", 0)
        return (
            ended in ("end_turn", "tool_use", "stop_sequence"),
            ended,
            prompt,
            usage.get("output_tokens"),
            json.dumps(reply.get("content"))[:160],
        )
    ended = str(reply.get("status"))
    return (
        ended == "completed",
        ended,
        usage.get("input_tokens"),
        usage.get("output_tokens"),
        json.dumps(reply.get("output"))[:160],
    )


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("captures", nargs="+", type=Path)
    parser.add_argument("--url", default="http://127.0.0.1:8000")
    parser.add_argument("--max-tokens", type=int, default=512)
    parser.add_argument("--model", help="model name to send instead of the captured one")
    args = parser.parse_args()

    stopped = sent = 0
    with httpx.Client(base_url=args.url, timeout=1800) as client:
        for file in args.captures:
            found = first_generation_request(json.loads(file.read_text()))
            if found is None:
                print(f"{file.name}: no generation request")
                continue
            path, body = found
            body = {**body, "stream": False}
            if args.model:
                body["model"] = args.model
            body["max_tokens" if path == "/v1/messages" else "max_output_tokens"] = args.max_tokens
            started = time.monotonic()
            response = client.post(path, json=body)
            elapsed = time.monotonic() - started
            if response.status_code != 200:
                print(f"{file.name}: HTTP {response.status_code} {response.text[:200]}")
                continue
            ok, ended, prompt, output, head = summarize(path, response.json())
            sent += 1
            stopped += ok
            print(
                f"{file.name}: {ended} after {output} tokens (prompt {prompt}, {elapsed:.0f} s) {head}",
                flush=True,
            )
    print(f"stopped within {args.max_tokens} tokens: {stopped}/{sent}")
    return 0 if sent and stopped == sent else 1


if __name__ == "__main__":
    sys.exit(main())
