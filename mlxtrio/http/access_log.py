"""One log line per request, written when the response is over (for a stream:
after its last event), so users can see what the server did:

    POST /v1/messages 200 model=mlxtrio-tiny prompt=3412 cached=3300 generated=57
        ttft=0.41s duration=1.20s finish=stop

Routes fill in what they know through ``serving.call.access_record()``; the app's
ASGI entry point creates the record and notes the status, and the call scope
writes the line when the call is over.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from typing import Any

log = logging.getLogger("mlxtrio.access")


@dataclass
class AccessRecord:
    method: str
    path: str
    started: float = field(default_factory=time.perf_counter)
    status: int | None = None
    model: str | None = None
    stream: bool = False
    prompt_tokens: int | None = None
    cached_tokens: int | None = None
    cache_miss: str | None = None  # why less was reused than the session offered
    images: str | None = None  # "3:placeholder": three images a text-only model saw as text
    generated_tokens: int | None = None
    draft_tokens: int | None = None  # speculative decoding: drafted, and accepted of them
    accepted_tokens: int | None = None
    ttft: float | None = None
    finish: str | None = None

    def line(self) -> str:
        status = "-" if self.status is None else str(self.status)  # no response: client left
        parts = [_printable(self.method), _printable(self.path), status]
        values: list[tuple[str, Any]] = [
            ("model", self.model),
            ("stream", "yes" if self.stream else None),
            ("prompt", self.prompt_tokens),
            ("cached", self.cached_tokens),
            ("miss", self.cache_miss),
            ("images", self.images),
            ("generated", self.generated_tokens),
            ("draft", self.draft_tokens or None),
            ("accepted", self.accepted_tokens if self.draft_tokens else None),
            ("ttft", None if self.ttft is None else f"{self.ttft:.2f}s"),
            ("duration", f"{time.perf_counter() - self.started:.2f}s"),
            ("finish", self.finish),
        ]
        parts.extend(f"{name}={value}" for name, value in values if value is not None)
        return " ".join(parts)


def _printable(text: str) -> str:
    """``text`` with control characters escaped: a client's path must not be
    able to forge log lines (``%0A`` arrives decoded)."""
    if text.isprintable():
        return text
    return "".join(c if c.isprintable() else repr(c)[1:-1] for c in text)


def write(record: AccessRecord) -> None:
    log.info("%s", record.line())
