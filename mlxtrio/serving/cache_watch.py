"""Why a turn missed the prefix cache.

Agent clients resend the whole conversation every turn, so a turn normally
reuses everything up to the end of its previous turn. When it reuses less,
users want to know why (a Claude Code session that suddenly re-prefills 30k
tokens): the prompt changed early on (a date, a file list, a reordered tool),
the cache dropped the prefix, or the conversation moved to another model.

:class:`CacheWatch` remembers the last prompt of each session (the client's
session id or ``prompt_cache_key`` when it sends one, else the conversation's
opening tokens) and, for each new turn of it, names the cause of a miss:

* ``new_conversation`` - no earlier turn, nothing reused;
* ``divergence`` - the prompt parted from the previous turn's before its end
  (one INFO line says at which token, with a short excerpt of the text on both
  sides, secrets masked);
* ``eviction`` - the prompt still shares the previous turn's tokens, but the
  cache no longer held them;
* ``other_model`` - the previous turn went to another model.

Misses are counted in ``mlxtrio_prefix_cache_misses_total{cause=...}``. Runs on
the Trio thread: one vectorised comparison of two prompts per request.
"""

from __future__ import annotations

import hashlib
import logging
import re
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

log = logging.getLogger("mlxtrio.cache")

SESSIONS_KEPT = 64
# A new turn's prompt may differ from the previous one's in its last tokens
# (the generation prompt: "<think>\n\n</think>\n\n" and the like).
TAIL_TOLERANCE = 32
OPENING_TOKENS = 64  # a session without an id is named by its first tokens
EXCERPT_TOKENS = 12
CAUSES = ("new_conversation", "divergence", "eviction", "other_model")

# What looks like a credential in a prompt excerpt: API keys, tokens, long
# base64 or hex runs, "password=..." and "Authorization: ..." values.
_SECRETS = re.compile(
    r"(?i)(?:sk|pk|rk|ghp|gho|github_pat|xox[bpas]|AKIA|AIza)[-_A-Za-z0-9]{8,}"
    r"|(?:bearer|basic)\s+[-._~+/A-Za-z0-9]+=*"
    r"|(?:password|passwd|secret|token|api[_-]?key)\s*[:=]\s*\S+"
    r"|[A-Za-z0-9+/_-]{32,}={0,2}"
)


def mask_secrets(text: str) -> str:
    return _SECRETS.sub("[masked]", text)


@dataclass
class _Turn:
    model: str
    prompt: np.ndarray
    cached: int


class CacheWatch:
    """Trio thread only. ``count(cause)`` is called for each miss."""

    def __init__(self, count: Callable[[str], None] = lambda cause: None) -> None:
        self._sessions: OrderedDict[tuple[str, str], _Turn] = OrderedDict()
        self._count = count

    def observe(
        self,
        *,
        model: str,
        domain: str,
        session: str | None,
        prompt: list[int],
        cached: int,
        decode: Callable[[list[int]], str],
    ) -> str | None:
        """Note one request's cache result; the cause of a miss, or None."""
        key = (domain, session or _opening(prompt))
        tokens = np.asarray(prompt, dtype=np.int64)
        previous = self._sessions.pop(key, None)
        self._sessions[key] = _Turn(model, tokens, cached)
        while len(self._sessions) > SESSIONS_KEPT:
            self._sessions.popitem(last=False)
        cause = _cause(previous, model, tokens, cached, decode)
        if cause is not None:
            self._count(cause)
        return cause


def _opening(prompt: list[int]) -> str:
    head = ",".join(map(str, prompt[:OPENING_TOKENS]))
    return "opening:" + hashlib.blake2b(head.encode(), digest_size=8).hexdigest()


def _cause(
    previous: _Turn | None,
    model: str,
    prompt: np.ndarray,
    cached: int,
    decode: Callable[[list[int]], str],
) -> str | None:
    if previous is None:
        return "new_conversation" if cached == 0 else None
    if previous.model != model:
        return "other_model"
    shared = _common_prefix(prompt, previous.prompt)
    if cached > shared + TAIL_TOLERANCE:
        return None  # more than the session's own turn gave (a shared prefix)
    if shared < len(previous.prompt) - TAIL_TOLERANCE:
        _log_divergence(model, prompt, previous.prompt, shared, cached, decode)
        return "divergence"
    if cached + TAIL_TOLERANCE < shared:
        log.info(
            "prefix cache: model %s reused %d of %d prompt tokens; the %d it shares with "
            "the session's previous turn were no longer cached (evicted)",
            model,
            cached,
            len(prompt),
            shared,
        )
        return "eviction"
    return None


def _common_prefix(a: np.ndarray, b: np.ndarray) -> int:
    n = min(len(a), len(b))
    differ = np.flatnonzero(a[:n] != b[:n])
    return int(differ[0]) if differ.size else n


def _log_divergence(
    model: str,
    prompt: np.ndarray,
    before: np.ndarray,
    at: int,
    cached: int,
    decode: Callable[[list[int]], str],
) -> None:
    def text(tokens: np.ndarray) -> str:
        return repr(mask_secrets(decode(tokens.tolist())))

    common = prompt[max(0, at - EXCERPT_TOKENS) : at]
    log.info(
        "prefix cache: model %s reused %d of %d prompt tokens: the prompt parted from "
        "the session's previous turn (%d tokens) at token %d, after ...%s: now %s..., "
        "before %s...",
        model,
        cached,
        len(prompt),
        len(before),
        at,
        text(common),
        text(prompt[at : at + EXCERPT_TOKENS]),
        text(before[at : at + EXCERPT_TOKENS]),
    )
