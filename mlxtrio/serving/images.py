"""The request's images, checked before anything else is done for it.

A bad image is the client's mistake: it is refused with a 400 naming its
content block before the model is resolved, so it never loads, evicts or
queues anything. The limits are settings (``image_max_bytes``,
``image_max_side``, ``image_max_pixels``, ``images_per_request``,
``fetch_image_urls``); the checks themselves are :mod:`mlxtrio.chat.images`.

Agents resend a conversation's images with every turn (Claude Code's
screenshots stay in its history), so an image that passed is remembered by the
digest of what the request carried and is not decoded again.
"""

from __future__ import annotations

import hashlib
import threading
from collections import OrderedDict

import trio

from ..chat.conversation import Conversation
from ..chat.errors import ConversationError
from ..chat.images import CheckedImage, ImageInput, ImageLimits, check, check_count
from ..http.errors import invalid_request
from .call import access_record, services

# Decoding is CPU work (and memory: up to image_max_pixels x 4 bytes each):
# at most this many images are decoded at once, whatever the number of requests.
DECODERS = 2
REMEMBERED = 256  # images that passed, by the digest of their payload


class _Passed:
    """Images that passed their checks, least recently used first (shared by
    the decoding threads, hence the lock)."""

    def __init__(self, size: int) -> None:
        self._size = size
        self._items: OrderedDict[tuple[str, ImageLimits], CheckedImage] = OrderedDict()
        self._lock = threading.Lock()

    def get(self, key: tuple[str, ImageLimits]) -> CheckedImage | None:
        with self._lock:
            found = self._items.get(key)
            if found is not None:
                self._items.move_to_end(key)
            return found

    def put(self, key: tuple[str, ImageLimits], image: CheckedImage) -> None:
        with self._lock:
            self._items[key] = image
            while len(self._items) > self._size:
                self._items.popitem(last=False)


_decoders: trio.lowlevel.RunVar[trio.CapacityLimiter] = trio.lowlevel.RunVar("image_decoders")
_passed = _Passed(REMEMBERED)


def _decoder_limiter() -> trio.CapacityLimiter:
    """This Trio run's limiter (a limiter belongs to one run)."""
    try:
        return _decoders.get()
    except LookupError:
        limiter = trio.CapacityLimiter(DECODERS)
        _decoders.set(limiter)
        return limiter


def _check_once(image: ImageInput, limits: ImageLimits) -> CheckedImage:
    """:func:`check`, or what it said last time for the same payload (a remote
    URL is fetched again: what it names may have changed)."""
    if image.source == "url":
        return check(image, limits)
    key = (hashlib.sha256(image.data.encode()).hexdigest(), limits)
    found = _passed.get(key)
    if found is None:
        found = check(image, limits)
        _passed.put(key, found)
    return found


async def check_images(conversation: Conversation) -> list[CheckedImage]:
    """Every image of ``conversation`` decoded and checked, in order, on a
    worker thread (decoding is CPU work; a remote fetch, when allowed, is I/O),
    at most :data:`DECODERS` at once across the server. Raises a 400
    :class:`~mlxtrio.http.errors.ApiError` naming the first bad one.

    Cancellation abandons the image in progress: its thread finishes on its own,
    bounded by the limits (and a fetch by its deadline)."""
    images = conversation.images
    if not images:
        return []
    limits = ImageLimits.from_settings(services().settings)
    try:
        check_count(images, limits)
        checked = [
            await trio.to_thread.run_sync(
                _check_once, image, limits, abandon_on_cancel=True, limiter=_decoder_limiter()
            )
            for image in images
        ]
    except ConversationError as exc:
        raise invalid_request(exc.message, exc.param) from None
    return checked


def note_placeholders(conversation: Conversation) -> None:
    """Say in the access line that a model reading text only saw the
    conversation's images as placeholders."""
    if conversation.images:
        access_record().images = f"{len(conversation.images)}:placeholder"
