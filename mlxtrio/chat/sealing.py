"""Opaque, authenticated reasoning blobs (``reasoning.encrypted_content``).

Codex runs with ``store: false`` and sends each turn's reasoning back as the blob
it received. A blob is the reasoning text, compressed, with an HMAC-SHA256 tag
under a per-installation key: the server can read back what it issued and ignores
anything else (another provider's blob, a tampered one) instead of failing.
"""

from __future__ import annotations

import base64
import hashlib
import hmac
import json
import logging
import os
import secrets
import zlib
from pathlib import Path

log = logging.getLogger("mlxtrio")

_PREFIX = "mlxtrio1."
_TAG = 16


class ReasoningSealer:
    """Seals with ``key``; opens what ``key`` or any of ``also`` sealed (a key
    used before, e.g. the file's until the shared store's took over)."""

    def __init__(self, key: bytes, also: tuple[bytes, ...] = ()) -> None:
        self._key = key
        self._keys = (key, *(k for k in also if k != key))

    @property
    def key(self) -> bytes:
        return self._key

    def with_key(self, key: bytes) -> ReasoningSealer:
        """A sealer using ``key`` that still opens this one's blobs."""
        return ReasoningSealer(key, self._keys)

    @classmethod
    def from_key_file(cls, path: Path) -> ReasoningSealer:
        """Load the installation key, creating it (mode 0600) on first use. Falls
        back to a per-process key if the file cannot be written."""
        try:
            if path.exists():
                key = path.read_bytes()
                if len(key) >= 32:
                    return cls(key)
            path.parent.mkdir(parents=True, exist_ok=True)
            key = secrets.token_bytes(32)
            fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
            with os.fdopen(fd, "wb") as f:
                f.write(key)
            return cls(key)
        except OSError as exc:
            log.warning(
                "cannot keep a reasoning key at %s (%s); blobs will not survive a restart",
                path,
                exc,
            )
            return cls(secrets.token_bytes(32))

    def seal(self, text: str) -> str:
        body = zlib.compress(json.dumps({"r": text}).encode(), 6)
        tag = hmac.new(self._key, body, hashlib.sha256).digest()[:_TAG]
        return _PREFIX + base64.urlsafe_b64encode(tag + body).decode()

    def open(self, blob: object) -> str | None:
        """The reasoning text of a blob this installation issued, else None."""
        if not isinstance(blob, str) or not blob.startswith(_PREFIX):
            return None
        try:
            raw = base64.urlsafe_b64decode(blob[len(_PREFIX) :].encode())
            tag, body = raw[:_TAG], raw[_TAG:]
            if not any(
                hmac.compare_digest(tag, hmac.new(key, body, hashlib.sha256).digest()[:_TAG])
                for key in self._keys
            ):
                return None
            value = json.loads(zlib.decompress(body))
            return value["r"] if isinstance(value.get("r"), str) else None
        except (ValueError, KeyError, zlib.error, json.JSONDecodeError):
            return None
