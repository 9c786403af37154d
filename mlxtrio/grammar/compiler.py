"""Compile grammars for one model's vocabulary, off the Trio thread, once
(the vocabulary as llguidance reads it is built with the model, by
:func:`mlxtrio.engine.processors.grammar_masks.grammar_tokenizer`).

A compiled grammar is an llguidance ``LLMatcher`` in its initial state: the
engine thread ``deep_copy()``s it for each sequence (microseconds), so the
compile cost (a few milliseconds for Claude Code's 24 tools, more for large
schemas) is paid once per distinct grammar, on a worker thread.
"""

from __future__ import annotations

import json
import logging
import threading
from collections import OrderedDict
from typing import Any

import trio

log = logging.getLogger("mlxtrio.grammar")

CACHE_ENTRIES = 128


class GrammarError(ValueError):
    """A grammar or schema the engine cannot compile; the message says why."""


class GrammarCompiler:
    """Compiled grammars for one tokenizer, least recently used dropped first.

    :meth:`matcher` and :meth:`check_schema` run the compile on a worker thread,
    one at a time (a compile takes a core); cancelling the caller waits for the
    compile in progress to finish (milliseconds) and caches its result."""

    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer  # an llguidance LLTokenizer
        self._matchers: OrderedDict[str, Any] = OrderedDict()
        self._schema_errors: OrderedDict[str, str] = OrderedDict()
        self._limiter = trio.CapacityLimiter(1)
        self._lock = threading.Lock()

    async def matcher(self, grammar: str) -> Any:
        """The compiled ``grammar`` (llguidance Lark). Raises :class:`GrammarError`."""
        cached = self._get(self._matchers, grammar)
        if cached is None:
            cached = await trio.to_thread.run_sync(self._compile, grammar, limiter=self._limiter)
        if isinstance(cached, GrammarError):
            raise cached
        return cached

    async def check_schema(self, schema: dict[str, Any], strict: bool) -> str:
        """Why ``schema`` cannot constrain a JSON value ("" when it can)."""
        key = json.dumps([schema, strict], sort_keys=True)
        error = self._get(self._schema_errors, key)
        if error is None:
            error = await trio.to_thread.run_sync(
                self._validate, key, schema, strict, limiter=self._limiter
            )
        return error

    # -- worker thread ---------------------------------------------------------

    def _compile(self, grammar: str) -> Any:
        from llguidance import LLMatcher

        done = self._get(self._matchers, grammar)  # by a request just ahead of this one
        if done is not None:
            return done
        matcher = LLMatcher(self.tokenizer, LLMatcher.grammar_from_lark(grammar), log_level=0)
        result: Any = GrammarError(_reason(matcher.get_error())) if matcher.is_error() else matcher
        self._put(self._matchers, grammar, result)
        return result

    def _validate(self, key: str, schema: dict[str, Any], strict: bool) -> str:
        from llguidance import LLMatcher

        from .build import json_value

        grammar = LLMatcher.grammar_from_lark("start: " + json_value(schema, strict))
        error = _reason(LLMatcher.validate_grammar(grammar, self.tokenizer))
        self._put(self._schema_errors, key, error)
        return error

    # -- the caches (read on the Trio thread, written on workers) -----------------

    def _get(self, cache: OrderedDict[str, Any], key: str) -> Any:
        with self._lock:
            value = cache.get(key)
            if value is not None:
                cache.move_to_end(key)
            return value

    def _put(self, cache: OrderedDict[str, Any], key: str, value: Any) -> None:
        with self._lock:
            cache[key] = value
            cache.move_to_end(key)
            while len(cache) > CACHE_ENTRIES:
                cache.popitem(last=False)


def _reason(error: str) -> str:
    """The cause in an llguidance error, without the position and the grammar
    excerpt it quotes (the client's schema, re-serialized)."""
    first = error.strip().splitlines()[0] if error.strip() else ""
    for prefix in ("failed to compile JSON schema: ",):
        if prefix in first:
            return first.split(prefix, 1)[1]
    return first
