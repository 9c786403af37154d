"""The engine: one model, one dedicated thread, continuous batching.

Threading contract
------------------
* The engine thread owns every MLX object: weights, KV caches and mlx-lm's
  ``BatchGenerator``. Nothing else touches them.
* The Trio side talks to it through a command queue (``submit``, ``cancel``,
  ``shutdown``); putting a command never blocks.
* The engine talks back with exactly one ``TrioToken.run_sync_soon`` per engine
  step, carrying every event that step produced.
* The gap between two ``BatchGenerator.next()`` calls is the *safepoint*: pending
  commands are applied there, so a cancelled sequence is dropped after at most
  one decode step or one prefill chunk (``prefill_chunk`` tokens).
"""

from __future__ import annotations

import copy
import enum
import functools
import logging
import queue
import threading
import time
from dataclasses import dataclass, field
from typing import Any, cast

import trio

from .handle import EngineError, GenerationHandle
from .precision import apply_compute_dtype
from .prefix_cache import Entry, Match, PrefixIndex
from .types import EngineStats, GenerationEvent, GenerationStats, SamplingParams

log = logging.getLogger("mlxtrio.engine")

_LATENCY_HISTORY = 256


class EngineState(enum.Enum):
    LOADING = "loading"
    READY = "ready"
    STOPPING = "stopping"
    STOPPED = "stopped"
    FAILED = "failed"


@dataclass
class _Sequence:
    """Engine-thread bookkeeping for one live sequence."""

    handle: GenerationHandle
    uid: int
    detokenizer: Any
    submitted_at: float
    stats: GenerationStats
    prefill_started_at: float | None = None
    prefill_done_at: float | None = None
    first_token_at: float | None = None
    generated: list[int] = field(default_factory=list)  # token ids, as received


class Engine:
    """Serve one model from its own thread. Create, ``await start()``, ``submit()``."""

    def __init__(
        self,
        name: str,
        path: str,
        *,
        capacity: int,
        prefill_chunk: int,
        default_max_tokens: int,
        prefix_cache_bytes: int = 0,
        compute_dtype: str = "model",
    ) -> None:
        self.name = name
        self.path = path
        self.capacity = capacity
        self.prefill_chunk = prefill_chunk
        self.default_max_tokens = default_max_tokens
        self.compute_dtype_setting = compute_dtype
        self.dtype: str | None = None  # what it computes in, once loaded
        self.state = EngineState.LOADING
        self.error: str | None = None
        self.stats = EngineStats()
        self.load_seconds: float | None = None
        self.tokenizer: Any = None  # mlx-lm TokenizerWrapper; thread-safe to render with
        self.config: dict[str, Any] = {}
        self._commands: queue.SimpleQueue[tuple[str, Any]] = queue.SimpleQueue()
        self._thread: threading.Thread | None = None
        self._trio_token: trio.lowlevel.TrioToken | None = None
        self._ready = trio.Event()
        self._live_handles: set[GenerationHandle] = set()  # Trio side
        self._idle = trio.Event()
        self._idle.set()
        # Prefix cache: the index lives on the Trio side, the snapshots here.
        self.prefix_index = PrefixIndex(prefix_cache_bytes, self._drop_snapshots)
        self._snapshots: dict[int, list[Any]] = {}  # engine thread only
        self._next_entry = 0
        self._token_texts: Any = None  # engine thread only
        # The id of the model's tool-call marker when it is one token (set at load).
        self.tool_call_token: int | None = None

    # ------------------------------------------------------------------
    # Trio side

    @property
    def context_length(self) -> int:
        return int(self.config.get("max_position_embeddings") or 32768)

    @property
    def active_sequences(self) -> int:
        """Sequences submitted and not yet finished (as the Trio side sees them)."""
        return len(self._live_handles)

    def launch(self) -> None:
        """Start the engine thread, which loads the model; returns at once.

        Must be called from the Trio thread. The thread is a daemon so that a
        wedged MLX call can never keep the process alive; :meth:`stop` joins it.
        """
        if self._thread is not None:
            return
        self._trio_token = trio.lowlevel.current_trio_token()
        self._thread = threading.Thread(
            target=self._thread_main, name=f"mlxtrio-engine-{self.name}", daemon=True
        )
        self._thread.start()

    async def wait_ready(self) -> None:
        """Wait until the model is loaded. Raises :class:`EngineError` if loading
        failed. Cancelling the wait does not stop the load (use :meth:`stop`)."""
        await self._ready.wait()
        if self.state is not EngineState.READY:
            raise EngineError(f"model {self.name!r} failed to load: {self.error}")

    async def start(self) -> None:
        """:meth:`launch`, then :meth:`wait_ready`."""
        self.launch()
        await self.wait_ready()

    def lookup(self, prompt: list[int], domain: str = "") -> Match | None:
        """The longest cached prefix of ``prompt`` in isolation ``domain``, pinned
        until :meth:`release` (or until a sequence submitted with it starts).
        Synchronous, no engine work: callers know the reuse before sending headers."""
        return self.prefix_index.lookup((self.name, domain), prompt)

    def release(self, match: Match | None) -> None:
        """Unpin a match from :meth:`lookup`; idempotent."""
        self.prefix_index.release(match)

    def submit(
        self,
        prompt: list[int],
        sampling: SamplingParams,
        *,
        match: Match | None = None,
        domain: str = "",
    ) -> GenerationHandle:
        """Queue a sequence for generation; returns at once.

        ``match`` (from :meth:`lookup` with the same prompt) makes it start from a
        cached prefix; the sequence's KV is cached under ``domain`` when it ends.
        The returned handle must be used as an async context manager so that it is
        cancelled whatever way the caller leaves. Raises :class:`EngineError` if
        the engine is not serving.
        """
        if self.state is not EngineState.READY:
            raise EngineError(f"engine for {self.name!r} is {self.state.value}")
        if not prompt:
            raise EngineError("empty prompt")
        handle = GenerationHandle(
            prompt, sampling, self._request_cancel, (self.name, domain), match
        )
        self._live_handles.add(handle)
        self._idle = trio.Event() if self._idle.is_set() else self._idle
        self._commands.put(("submit", handle))
        return handle

    async def drain(self, grace: float) -> None:
        """Refuse new work, give in-flight sequences ``grace`` seconds to finish,
        then cancel the rest (their consumers see ``finish_reason="cancelled"``)."""
        if self.state is EngineState.READY:
            self.state = EngineState.STOPPING
        with trio.move_on_after(grace):
            await self._idle.wait()
        for handle in list(self._live_handles):
            handle.cancel()
        with trio.move_on_after(max(grace, 1.0)):
            await self._idle.wait()

    async def stop(self, grace: float) -> None:
        """:meth:`drain`, then join the engine thread.

        Safe to call more than once, and on an engine that failed to load.
        """
        if self._thread is None:
            return
        await self.drain(grace)
        self._commands.put(("shutdown", None))
        thread = self._thread
        with trio.move_on_after(max(grace, 1.0)):
            await trio.to_thread.run_sync(thread.join, abandon_on_cancel=True)
        if thread.is_alive():
            log.warning("engine thread for %s did not stop in time; abandoning it", self.name)
        if self.state is not EngineState.FAILED:
            self.state = EngineState.STOPPED

    def _drop_snapshots(self, entry_ids: list[int]) -> None:
        self._commands.put(("drop", entry_ids))

    def _index_snapshot(self, entry: Entry) -> None:
        """Trio side: the engine holds a new snapshot."""
        self.prefix_index.add(entry)

    def _request_cancel(self, handle: GenerationHandle) -> None:
        handle.cancel_requested_at_step = self.stats.steps
        self._commands.put(("cancel", handle))

    def _deliver_batch(self, deliveries: list[tuple[GenerationHandle, GenerationEvent]]) -> None:
        """Runs on the Trio thread, once per engine step."""
        for handle, event in deliveries:
            handle._deliver(event)
            if handle.done:
                self._live_handles.discard(handle)
        if not self._live_handles:
            self._idle.set()

    def _post(self, fn: Any, *args: Any) -> None:
        """Hand ``fn(*args)`` to the Trio loop; dropped if the loop has ended."""
        assert self._trio_token is not None
        try:
            self._trio_token.run_sync_soon(fn, *args)
        except trio.RunFinishedError:
            pass

    # ------------------------------------------------------------------
    # Engine thread

    def _thread_main(self) -> None:
        gen = None
        try:
            gen = self._load()
            self._post(self._ready.set)
            self._serve(gen)
        except BaseException as exc:  # the thread must report, never die silently
            self.error = f"{type(exc).__name__}: {exc}"
            if self.state is EngineState.LOADING:
                log.error("cannot load model %s from %s: %s", self.name, self.path, self.error)
            else:
                log.exception("engine %s failed", self.name)
            self.state = EngineState.FAILED
            self._post(self._ready.set)
            self._fail_all(self.error)
        finally:
            if gen is not None:
                gen.close()

    def _load(self) -> Any:
        from mlx_lm import load
        from mlx_lm.generate import BatchGenerator

        from .constraints import TokenTexts

        log.info("loading model %s from %s", self.name, self.path)
        started = time.perf_counter()
        model, tokenizer, config = cast(
            tuple[Any, Any, dict[str, Any]], load(self.path, return_config=True)
        )
        self.tokenizer, self.config = tokenizer, config
        if getattr(tokenizer, "has_tool_calling", False):
            # Built now rather than at the first required tool choice, which would
            # stall every running sequence while a large vocabulary is decoded.
            self._token_texts = TokenTexts.from_tokenizer(tokenizer)
            marker = tokenizer.encode(tokenizer.tool_call_start, add_special_tokens=False)
            self.tool_call_token = marker[0] if len(marker) == 1 else None
        precision = apply_compute_dtype(model, self.compute_dtype_setting)
        self.dtype = precision.dtype
        if precision.upcast_reason:
            log.info(
                "model %s computes in %s on the CPU (%s)",
                self.name,
                self.dtype,
                precision.upcast_reason,
            )
        if precision.hint:
            log.warning("%s", precision.hint)
        gen = BatchGenerator(
            model,
            max_tokens=self.default_max_tokens,
            stop_tokens=[[t] for t in tokenizer.eos_token_ids],
            completion_batch_size=self.capacity,
            prefill_batch_size=self.capacity,
            prefill_step_size=self.prefill_chunk,
        )
        self.load_seconds = time.perf_counter() - started
        self.state = EngineState.READY
        log.info(
            "model %s ready in %.2f s (%s, %d layers, context %d, %s)",
            self.name,
            self.load_seconds,
            config.get("model_type", "?"),
            config.get("num_hidden_layers", 0),
            self.context_length,
            self.dtype,
        )
        return gen

    def _serve(self, gen: Any) -> None:
        self._gen = gen
        self._live: dict[int, _Sequence] = {}
        self._by_handle: dict[GenerationHandle, _Sequence] = {}
        while True:
            if not self._apply_commands(block=not self._live):
                return
            if not self._live:
                continue
            prompt_responses, gen_responses = gen.next()
            self.stats.steps += 1
            deliveries = self._collect(prompt_responses, gen_responses)
            if deliveries:
                self._post(self._deliver_batch, deliveries)

    def _apply_commands(self, block: bool) -> bool:
        """Apply queued commands at the safepoint. False means shut down."""
        while True:
            try:
                command, arg = self._commands.get(block=block)
            except queue.Empty:
                return True
            block = False
            if command == "shutdown":
                self._fail_live("engine shut down", reason="cancelled")
                return False
            if command == "submit":
                self._insert(arg)
            elif command == "cancel":
                self._remove(arg)
            elif command == "drop":
                for entry_id in arg:
                    self._snapshots.pop(entry_id, None)

    def _insert(self, handle: GenerationHandle) -> None:
        from mlx_lm.generate import StopSequences

        from .constraints import OpeningConstraint, ReasoningBudget
        from .sampling import sampler_for

        now = time.perf_counter()
        stats = GenerationStats(prompt_tokens=len(handle.prompt))
        if handle.cancel_requested:
            if handle.match is not None:
                self._post(self.prefix_index.release, handle.match)
            self._post(self._deliver_batch, [(handle, _final("cancelled", stats))])
            return
        params = handle.sampling
        eos = [(t,) for t in self.tokenizer.eos_token_ids]
        stops = StopSequences(eos + [(t,) for t in params.stop_token_ids])
        generated: list[int] = []  # as received: the processors' view without waiting
        processors: list[Any] = []
        end_tokens: tuple[int, ...] = tuple(getattr(self.tokenizer, "think_end_tokens", None) or ())
        if params.reasoning_budget is not None and len(end_tokens) == 1:
            processors.append(ReasoningBudget(params.reasoning_budget, end_tokens[0], generated))
        for constraint in params.constraints:
            processors.append(
                OpeningConstraint(
                    constraint.openings,
                    constraint.after,
                    self._vocab(),
                    constraint.repeat,
                    tuple(self._spelling(text) for text in constraint.openings),
                    generated,
                )
            )
        cache, reused = self._cache_for(handle)
        stats.cached_tokens = reused
        (uid,) = self._gen.insert(
            [handle.prompt[reused:]],
            max_tokens=[params.max_tokens],
            caches=[cache],
            all_tokens=[handle.prompt[:reused]],
            samplers=[sampler_for(params)],
            logits_processors=[processors],
            stop_sequences=[stops],
        )
        seq = _Sequence(handle, uid, self.tokenizer.detokenizer, now, stats, generated=generated)
        self._live[uid] = seq
        self._by_handle[handle] = seq
        self.stats.submitted += 1

    @functools.lru_cache(maxsize=4096)  # noqa: B019 - one engine per model, for life
    def _spelling(self, text: str) -> tuple[int, ...]:
        """How the tokenizer spells ``text`` (tool-call openings recur per request)."""
        return tuple(self.tokenizer.encode(text, add_special_tokens=False))

    def _vocab(self) -> Any:
        """Every token's text, for constrained openings; built on first use."""
        if self._token_texts is None:
            from .constraints import TokenTexts

            self._token_texts = TokenTexts.from_tokenizer(self.tokenizer)
        return self._token_texts

    def _cache_for(self, handle: GenerationHandle) -> tuple[Any, int]:
        """A private copy of the matched snapshot trimmed to the match, or (None, 0).
        The match is unpinned once the copy exists."""
        match = handle.match
        if match is None:
            return None, 0
        snapshot = self._snapshots.get(match.entry.id)
        self._post(self.prefix_index.release, match)
        if snapshot is None:
            return None, 0
        from mlx_lm.models.cache import trim_prompt_cache

        cache = copy.deepcopy(snapshot)
        excess = len(match.entry.tokens) - match.length
        if excess > 0 and trim_prompt_cache(cache, excess) != excess:
            return None, 0
        return cache, match.length

    def _keep_snapshot(self, key: Any, cache: list[Any] | None, tokens: list[int]) -> None:
        """Hold a finished or cancelled sequence's KV and tell the index about it."""
        if not self.prefix_index.enabled or not cache or not tokens:
            return
        from mlx_lm.models.cache import can_trim_prompt_cache

        entry_id, self._next_entry = self._next_entry, self._next_entry + 1
        self._snapshots[entry_id] = cache
        nbytes = sum(c.nbytes for c in cache)
        entry = Entry(entry_id, key, list(tokens), nbytes, can_trim_prompt_cache(cache))
        self._post(self._index_snapshot, entry)

    def _remove(self, handle: GenerationHandle) -> None:
        seq = self._by_handle.pop(handle, None)
        if seq is None:
            return  # finished already, or never inserted
        kept = self._gen.remove([seq.uid], return_prompt_caches=self.prefix_index.enabled)
        if seq.uid in kept:  # keep what was prefilled: the next turn may reuse it
            cache, tokens = kept[seq.uid]
            self._keep_snapshot(handle.cache_key, cache, tokens)
        del self._live[seq.uid]
        self.stats.cancelled += 1
        if handle.cancel_requested_at_step is not None:
            latency = self.stats.steps - handle.cancel_requested_at_step
            self.stats.cancel_latency_steps.append(latency)
            del self.stats.cancel_latency_steps[:-_LATENCY_HISTORY]
        self._finish_stats(seq, time.perf_counter())
        self.stats.last_cancelled = seq.stats
        self._post(self._deliver_batch, [(handle, _final("cancelled", seq.stats))])

    def _collect(
        self, prompt_responses: list[Any], gen_responses: list[Any]
    ) -> list[tuple[GenerationHandle, GenerationEvent]]:
        now = time.perf_counter()
        for r in prompt_responses:
            seq = self._live.get(r.uid)
            if seq is None:
                continue
            if seq.prefill_started_at is None:
                seq.prefill_started_at = now
                seq.stats.queue_seconds = now - seq.submitted_at
            seq.stats.prefilled_tokens = int(r.progress[0])
            if r.end_of_prompt:
                seq.prefill_done_at = now
        self.stats.max_batch_size = max(self.stats.max_batch_size, len(gen_responses))
        deliveries = []
        for r in gen_responses:
            seq = self._live.get(r.uid)
            if seq is None:
                continue
            deliveries.append((seq.handle, self._token_event(seq, r, now)))
        return deliveries

    def _token_event(self, seq: _Sequence, r: Any, now: float) -> GenerationEvent:
        stats = seq.stats
        stats.generated_tokens += 1
        self.stats.generated_tokens += 1
        seq.generated.append(r.token)
        if seq.first_token_at is None:
            seq.first_token_at = now
            stats.time_to_first_token = now - seq.submitted_at
            self.stats.prompt_tokens += stats.prompt_tokens
        detok = seq.detokenizer
        if r.finish_reason != "stop":  # the stop token itself is never shown
            detok.add_token(r.token)
        if r.finish_reason is None:
            return GenerationEvent((r.token,), detok.last_segment)
        detok.finalize()
        del self._live[seq.uid]
        self._by_handle.pop(seq.handle, None)
        self._keep_snapshot(seq.handle.cache_key, r.prompt_cache, r.all_tokens)
        self.stats.finished += 1
        self._finish_stats(seq, now)
        return GenerationEvent((r.token,), detok.last_segment, r.finish_reason, stats)

    def _finish_stats(self, seq: _Sequence, now: float) -> None:
        stats = seq.stats
        if seq.prefill_started_at is not None and seq.prefill_done_at is not None:
            elapsed = seq.prefill_done_at - seq.prefill_started_at
            if elapsed > 0 and stats.prefilled_tokens:
                stats.prefill_tokens_per_second = stats.prefilled_tokens / elapsed
        if seq.first_token_at is not None and stats.generated_tokens > 1:
            elapsed = now - seq.first_token_at
            if elapsed > 0:
                stats.decode_tokens_per_second = (stats.generated_tokens - 1) / elapsed

    def _fail_live(self, message: str, reason: str = "error") -> None:
        live = getattr(self, "_live", {})
        deliveries = []
        for seq in live.values():
            if reason == "cancelled":
                deliveries.append((seq.handle, _final("cancelled", seq.stats)))
            else:
                deliveries.append((seq.handle, GenerationEvent(error=message)))
        live.clear()
        if deliveries:
            self._post(self._deliver_batch, deliveries)

    def _fail_all(self, message: str) -> None:
        """The engine died: fail live sequences and everything still queued."""
        self._fail_live(message)
        pending = []
        while True:
            try:
                command, arg = self._commands.get_nowait()
            except queue.Empty:
                break
            if command == "submit":
                pending.append((arg, GenerationEvent(error=message)))
        if pending:
            self._post(self._deliver_batch, pending)


def _final(reason: str, stats: GenerationStats) -> GenerationEvent:
    return GenerationEvent(finish_reason=reason, stats=stats)  # type: ignore[arg-type]


__all__ = ["Engine", "EngineError", "EngineState", "GenerationHandle"]
