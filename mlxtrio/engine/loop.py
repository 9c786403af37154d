"""The engine thread's serving loop: commands in, one ``BatchGenerator`` step at a
time, events out.

Everything here runs on the engine thread and owns the MLX state of the running
sequences. It talks to the Trio side only through an :class:`~.outbox.Outbox`
(a step's events go in one ``run_sync_soon``; a new snapshot or a released prefix
match in one each) and reads commands from a queue at the *safepoint* between
two steps.

Fault isolation, from the narrowest to the widest:

* a sequence that cannot be started (bad parameters, a failing processor set-up)
  ends with an error event at insert; nothing else notices;
* a logits processor that raises inside a step is caught by its sequence's
  :class:`~.sequence.SequenceGuard`; that sequence ends with an error after the
  step, the batch goes on; so does one whose token cannot be handled after the
  step (detokenized, or its KV kept);
* a step (or a removal) that raises fails the sequences that were in it and
  rebuilds the ``BatchGenerator`` from the loaded weights; queued sequences
  carry over;
* anything else escapes :meth:`EngineLoop.run` and kills the thread, and the
  Trio side restarts it (see :class:`~.engine.Engine`).

A loop whose model is sharded across ranks (``strict``) cannot rebuild its
batch, end one sequence or fall back to a cold prefill on its own: the other
ranks would not do the same, and their batches would part. There every one
of these failures ends the thread, and with it the world.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import Any

from .batch import drop_queued, hand_over_queue, insert, new_generator
from .cache.snapshots import KVTiers, Snapshots
from .commands import Cancel, Command, Drop, ForgetDisk, Share, Shutdown, Submit
from .handle import GenerationHandle
from .memory import release_buffers
from .model import LoadedModel
from .outbox import HandleEvent, Outbox
from .pacing import PrefillPacer
from .processors.assembly import ProcessorFactory
from .processors.sampling import normalized, sampler_for
from .schedule import Schedule
from .sequence import LiveSequence, SequenceGuard, finish_stats
from .speculation.setup import settle_counts, speculation_for
from .staging import STAGED, Join, Staged, advance_for_a_step
from .types import EngineStats, GenerationEvent, GenerationStats
from .vision import VisionPrefill, VisionTextModel

log = logging.getLogger("mlxtrio.engine")


@dataclass
class LoopSettings:
    capacity: int
    max_prefill_chunk: int
    prefill_step_seconds: float
    default_max_tokens: int
    cache_enabled: bool
    speculation: str = "off"  # auto, on, off (see .speculation.policy)


@dataclass
class EngineLoop:
    """One incarnation of the engine thread's work. ``kv`` (the prefix cache's
    KV) and ``stats`` outlive it."""

    loaded: LoadedModel
    schedule: Schedule
    outbox: Outbox
    settings: LoopSettings
    kv: KVTiers
    stats: EngineStats
    next_entry_id: Callable[[], int]
    strict: bool = False  # sharded across ranks: no local recovery
    live: dict[int, LiveSequence] = field(default_factory=dict)
    by_handle: dict[GenerationHandle, LiveSequence] = field(default_factory=dict)
    # Sequences whose images are being encoded before they join the batch
    # (see .vision), in arrival order: one unit of the first per safepoint.
    staged: dict[GenerationHandle, Staged] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.loaded.serial:  # its KV depends on the images: nothing to reuse (see .serial)
            self.settings = replace(self.settings, cache_enabled=False)
        self.processors = ProcessorFactory(self.loaded.tokenizer, self.loaded.token_texts)
        self.pacer = PrefillPacer(
            self.settings.prefill_step_seconds, self.settings.max_prefill_chunk
        )
        self.speculation = speculation_for(
            self.loaded.model,
            self.settings.speculation,
            self.stats,
            self._may_draft,
            strict=self.strict,
        )
        self.gen = self._new_generator()
        self.snapshots = Snapshots(
            self.loaded,
            self.kv,
            self.outbox,
            self.settings.cache_enabled,
            self.next_entry_id,
            strict=self.strict,
        )
        self._pace_context = 0
        self.stats.mlx_active_bytes = release_buffers()

    def run(self) -> None:
        """Serve until a ``shutdown`` command. Exceptions other than a failed
        step propagate (the thread dies and is restarted by the Trio side)."""
        try:
            while True:
                idle = not self.live and not self.staged
                commands = self.schedule.commands(idle, self._report)
                serving = self._apply(commands)
                if serving and self.staged:
                    # Before planning: a sequence that joins the batch now
                    # has its text prefill paced in this very step.
                    self._stage()
                    self._interrupt_speculation()
                chunk = self.schedule.agree(commands, self._plan() if serving else 0, self._report)
                if not serving:
                    return
                if self.live:
                    self._step(chunk)
                    if not self.live:
                        self.stats.mlx_active_bytes = release_buffers()
        finally:
            self.gen.close()

    def _report(self) -> tuple[int, int, int]:
        """This rank's state for a lock-step round (see :mod:`.schedule`)."""
        return len(self.live), self.stats.steps, len(self.kv.memory.snapshots)

    # -- commands (the safepoint) --------------------------------------------

    def _apply(self, commands: list[Command]) -> bool:
        """Apply ``commands`` in order. False means shut down."""
        for command in commands:
            if isinstance(command, Shutdown):
                self._end_all(lambda seq: GenerationEvent.final("cancelled", seq.stats))
                return False
            if isinstance(command, Submit):
                self._insert(command.handle, command.withdrawn)
            elif isinstance(command, Cancel):
                self._remove(command.handle)
            elif isinstance(command, Share):
                seq = self.by_handle.get(command.handle)
                if seq is not None:  # else it ended: its end sets kv_ready
                    seq.share_when(command.at)
            elif isinstance(command, Drop):
                for entry_id in command.entry_ids:
                    self.kv.memory.drop(entry_id)
            elif isinstance(command, ForgetDisk):
                self.kv.forget_disk(list(command.names))
        return True

    def _insert(self, handle: GenerationHandle, withdrawn: bool) -> None:
        if withdrawn:  # cancelled before it started, or failed by a dead thread
            self._release(handle)
            stats = GenerationStats(prompt_tokens=len(handle.prompt))
            self.outbox.deliver([(handle, GenerationEvent.final("cancelled", stats))])
            return
        try:
            self._start(handle)
        except Exception as exc:
            failed = self._failed(handle, exc, "could not start generation")
            self._release(handle)
            self.outbox.deliver([failed])

    def _start(self, handle: GenerationHandle) -> None:
        from mlx_lm.generate import StopSequences

        loaded, tokenizer = self.loaded, self.loaded.tokenizer
        params = normalized(handle.sampling, loaded.vocab_size)
        eos = [(t,) for t in tokenizer.eos_token_ids]
        stops = StopSequences(eos + [(t,) for t in params.stop_token_ids])
        generated: list[int] = []
        processors = self.processors.for_sequence(params, generated)
        guard = SequenceGuard(processors) if processors else None
        cache, reused = self.snapshots.cache_for(handle)
        stats = GenerationStats(prompt_tokens=len(handle.prompt), cached_tokens=reused)
        seq = LiveSequence(
            handle, STAGED, tokenizer.detokenizer, time.perf_counter(), stats, guard, generated
        )
        join = Join(params, stops, sampler_for(params), guard, reused)
        model = loaded.model
        if isinstance(model, VisionTextModel) and (handle.vision is not None or model.mrope):
            prefill = VisionPrefill.start(model, handle.prompt, handle.vision, cache, reused)
            if not prefill.done:
                self.staged[handle] = Staged(seq, join, prefill)
                self.by_handle[handle] = seq
                self.stats.submitted += 1
                return
            cache = prefill.batch_cache()
        self._join(seq, join, cache, reused)
        self.stats.submitted += 1

    def _join(self, seq: LiveSequence, join: Join, cache: Any, at: int) -> None:
        """Insert ``seq`` into the batch, its first ``at`` prompt tokens in ``cache``."""
        handle = seq.handle
        boundaries = self.snapshots.boundaries(handle, at)
        cuts = [at, *boundaries, len(handle.prompt)]
        segments = [handle.prompt[a:b] for a, b in zip(cuts, cuts[1:], strict=False)]
        # Nothing after the insert can fail: a sequence the generator holds is
        # always one the loop knows.
        uid = insert(self.gen, segments, join, cache, handle.prompt[:at], handle.vision)
        seq.uid = uid
        seq.staged = at - join.reused
        seq.boundaries = boundaries
        self.live[uid] = seq
        self.by_handle[handle] = seq

    def _stage(self) -> None:
        """One engine step's time of the first staged sequence's vision
        prefill (see .staging); it joins the batch once its last image is in."""
        handle, staged = next(iter(self.staged.items()))
        prefill = staged.prefill
        try:
            advance_for_a_step(staged, self.pacer, bool(self.live))
        except Exception as exc:
            failed = self._failed(handle, exc, "could not encode the images")
            del self.staged[handle]
            self.by_handle.pop(handle, None)
            self.outbox.deliver([failed])
            return
        if not prefill.done:
            return
        del self.staged[handle]
        try:
            self._join(staged.seq, staged.join, prefill.batch_cache(), prefill.position)
        except Exception as exc:
            failed = self._failed(handle, exc, "could not start generation after the images")
            self.by_handle.pop(handle, None)
            self.outbox.deliver([failed])

    def _unstage(self, staged: Staged) -> None:
        """End a sequence cancelled during its vision prefill; what it encoded
        is kept when no unit was half done, so a retry starts after it."""
        seq, prefill = staged.seq, staged.prefill
        if self.settings.cache_enabled and staged.keepable():
            try:
                tokens = seq.handle.prompt[: prefill.position]
                self.snapshots.keep(seq.handle.cache_key, prefill.cache, tokens)
            except Exception:
                log.exception("could not keep a cancelled sequence's encoded prefix")
        finish_stats(seq, time.perf_counter())
        self.stats.note_cancelled(seq.stats, seq.handle.cancel_requested_at_step)
        self.outbox.deliver([(seq.handle, GenerationEvent.final("cancelled", seq.stats))])

    def _release(self, handle: GenerationHandle) -> None:
        """Unpin ``handle``'s prefix match (the sequence will not use it)."""
        if handle.match is not None:
            self.outbox.release(handle.match)

    def _remove(self, handle: GenerationHandle) -> None:
        seq = self.by_handle.pop(handle, None)
        if seq is None:
            return  # finished already, or never inserted
        staged = self.staged.pop(handle, None)
        if staged is not None:
            self._unstage(staged)
            return
        try:
            kept = self.gen.remove([seq.uid], return_prompt_caches=self.settings.cache_enabled)
            if seq.uid in kept:  # keep what was prefilled: the next turn may reuse it
                cache, tokens = kept[seq.uid]
                self.snapshots.keep(handle.cache_key, cache, tokens)
        except Exception as exc:
            # The generator's state is suspect: rebuild it without this sequence.
            self.live.pop(seq.uid, None)
            self._recover(exc, dropping=seq.uid)
        self.live.pop(seq.uid, None)
        settle_counts(self.speculation, seq.uid, seq.stats, self.stats)
        finish_stats(seq, time.perf_counter())
        self.stats.note_cancelled(seq.stats, handle.cancel_requested_at_step)
        self.outbox.deliver([(handle, GenerationEvent.final("cancelled", seq.stats))])

    # -- stepping --------------------------------------------------------------

    def _step(self, chunk: int) -> None:
        """One ``BatchGenerator`` step, prefilling ``chunk`` tokens (see :meth:`_plan`)."""
        if chunk:
            self.gen.prefill_step_size = chunk
        try:
            with self.gen.stats() as timing:
                prompt_responses, gen_responses = self.gen.next()
        except Exception as exc:
            self._recover(exc)
            return
        self.stats.steps += 1
        if timing.prompt_tokens:
            self._interrupt_speculation()
        if timing.prompt_tokens and self._pace_context:
            self.pacer.observe(timing.prompt_tokens, timing.prompt_time, self._pace_context)
        deliveries = self._collect(prompt_responses, gen_responses)
        deliveries.extend(self._fail_guarded())
        if self.settings.cache_enabled:
            self.snapshots.share(self.gen, list(self.live.values()))
        if deliveries:
            self.outbox.deliver(deliveries)

    def _plan(self) -> int:
        """Size the next step's prefill chunk by time (0: nothing prefills);
        remembers the context the chunk attends to on average, for the pacer
        to learn from."""
        prefilling = [seq for seq in self.live.values() if seq.prefilling]
        if not prefilling:
            self._pace_context = 0
            return 0
        # The serial path prefills one sequence at a time (see .serial).
        rows = 1 if self.loaded.serial else min(len(prefilling), self.settings.capacity)
        context = max(seq.context for seq in prefilling)
        decoding = len(prefilling) < len(self.live)
        chunk = self.pacer.chunk(context, rows, decoding)
        self._pace_context = context + chunk // 2
        return chunk

    def _recover(self, exc: Exception, dropping: int | None = None) -> None:
        """A step (or a removal) raised: fail the sequences that were in it and
        start a fresh ``BatchGenerator``; sequences still queued in the old one
        carry over, but for ``dropping`` (a uid being removed). A strict loop
        re-raises: the other ranks could not rebuild theirs in step."""
        if self.strict:
            raise exc
        old = self.gen
        waiting = drop_queued(old, dropping)
        failed = [seq for uid, seq in self.live.items() if uid not in waiting]
        log.exception(
            "engine step failed; ending the %d sequence(s) in it and rebuilding the batch",
            len(failed),
            exc_info=exc,
        )
        self.gen = self._new_generator()
        hand_over_queue(old, self.gen)
        failure = GenerationEvent.failure(f"generation failed: {exc}")
        deliveries = [(seq.handle, failure) for seq in failed]
        for seq in failed:
            self._forget(seq)
        self.outbox.deliver(deliveries)

    def _fail_guarded(self) -> list[HandleEvent]:
        """End the sequences whose logits processors raised during the step."""
        broken = [
            (seq, seq.guard.error)
            for seq in self.live.values()
            if seq.guard is not None and seq.guard.error is not None
        ]
        if not broken:
            return []
        if self.strict:  # one rank cannot end a sequence on its own
            raise RuntimeError("a logits processor failed") from broken[0][1]
        deliveries = []
        for seq, error in broken:
            log.error("a logits processor failed; ending its sequence", exc_info=error)
            deliveries.append((seq.handle, GenerationEvent.failure(f"generation failed: {error}")))
            self._end(seq)
        return deliveries

    def _failed(self, handle: GenerationHandle, exc: Exception, what: str) -> HandleEvent:
        """One sequence's own work failed: log it, and the error event that ends
        it. A strict loop re-raises instead: the other ranks would not end it."""
        if self.strict:
            raise exc
        log.error("%s; ending its sequence", what, exc_info=exc)
        return handle, GenerationEvent.failure(f"{what}: {exc}")

    def _end(self, seq: LiveSequence) -> None:
        """Take a failed sequence out of the loop and the generator."""
        self._forget(seq)
        try:
            self.gen.remove([seq.uid])  # a no-op for one that already finished
        except Exception as exc:
            self._recover(exc, dropping=seq.uid)

    def _new_generator(self) -> Any:
        s = self.settings
        return new_generator(
            self.loaded, s.capacity, s.default_max_tokens, s.max_prefill_chunk, self.speculation
        )

    def _interrupt_speculation(self) -> None:
        """Prefill or an image's encode ran beside decoding: the switch must
        not count it in a step's time."""
        if self.speculation is not None:
            self.speculation.interrupt()

    def _may_draft(self, uid: int) -> bool:
        """Sequences no seed fixes whose processors take part (see
        .speculation.verify)."""
        seq = self.live.get(uid)
        if seq is None or seq.handle.sampling.seed is not None:
            return False
        return seq.guard is None or seq.guard.can_draft

    def _forget(self, seq: LiveSequence) -> None:
        self.live.pop(seq.uid, None)
        self.by_handle.pop(seq.handle, None)
        settle_counts(self.speculation, seq.uid, seq.stats, self.stats)

    def _end_all(self, event_for: Callable[[LiveSequence], GenerationEvent]) -> None:
        ending = [*self.live.values(), *(staged.seq for staged in self.staged.values())]
        deliveries = [(seq.handle, event_for(seq)) for seq in ending]
        self.live.clear()
        self.staged.clear()
        self.by_handle.clear()
        if deliveries:
            self.outbox.deliver(deliveries)

    # -- results ---------------------------------------------------------------

    def _collect(self, prompt_responses: list[Any], gen_responses: list[Any]) -> list[HandleEvent]:
        now = time.perf_counter()
        for r in prompt_responses:
            seq = self.live.get(r.uid)
            if seq is not None and seq.prefilled(r, now):
                self.snapshots.keep_live(self.gen, seq)
        rows = len({r.uid for r in gen_responses})  # a row may emit several tokens
        self.stats.max_batch_size = max(self.stats.max_batch_size, rows)
        deliveries = []
        for r in gen_responses:
            seq = self.live.get(r.uid)
            if seq is None:
                continue
            try:
                deliveries.append((seq.handle, self._token_event(seq, r, now)))
            except Exception as exc:  # detokenizing or caching this one failed
                deliveries.append(self._failed(seq.handle, exc, "generation failed"))
                self._end(seq)
        return deliveries

    def _token_event(self, seq: LiveSequence, r: Any, now: float) -> GenerationEvent:
        if seq.first_token_at is None:
            self.stats.prompt_tokens += seq.stats.prompt_tokens
        self.stats.generated_tokens += 1
        event = seq.take_token(r.token, r.finish_reason, now)
        if event.finish_reason is not None:
            self._forget(seq)
            self.snapshots.keep(seq.handle.cache_key, r.prompt_cache, r.all_tokens)
            self.stats.finished += 1
            finish_stats(seq, now)
        return event
