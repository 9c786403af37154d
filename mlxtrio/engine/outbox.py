"""The engine thread's way back to the Trio thread.

The serving loop (:mod:`.loop`) runs on the engine thread and never touches a
Trio object: what it has to tell the Trio side goes through an :class:`Outbox`,
each call one ``TrioToken.run_sync_soon`` (a step's events in one call; a new
prefix-cache snapshot, a released match, a shared KV each in one).
:class:`TrioOutbox` is the engine's; a follower rank has its own, which keeps
nothing (see :mod:`.distributed.follower`).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Protocol

from .cache.prefix_index import PrefixIndex
from .handle import GenerationHandle, LiveHandles
from .types import Entry, GenerationEvent, Match

HandleEvent = tuple[GenerationHandle, GenerationEvent]


class Outbox(Protocol):
    """What the loop hands to the Trio thread (each call is one ``run_sync_soon``)."""

    def deliver(self, deliveries: list[HandleEvent]) -> None: ...
    def snapshot(self, entry: Entry) -> None: ...
    def release(self, match: Match) -> None: ...
    def shared(self, handle: GenerationHandle) -> None: ...


class TrioOutbox:
    """An :class:`Outbox` that posts each call to the Trio loop with ``post``
    (which drops it once that loop has ended): events to the live handles,
    snapshots and released matches to the prefix index."""

    def __init__(self, post: Callable[..., None], handles: LiveHandles, index: PrefixIndex) -> None:
        self._post, self._handles, self._index = post, handles, index

    def deliver(self, deliveries: list[HandleEvent]) -> None:
        self._post(self._handles.deliver, deliveries)

    def snapshot(self, entry: Entry) -> None:
        self._post(self._index.add, entry)

    def release(self, match: Match) -> None:
        self._post(self._index.release, match)

    def shared(self, handle: GenerationHandle) -> None:
        self._post(handle.kv_ready.set)


__all__ = ["HandleEvent", "Outbox", "TrioOutbox"]
