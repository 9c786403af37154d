"""The request's images, checked before anything else is done for it.

A bad image is the client's mistake: it is refused with a 400 naming its
content block before the model is resolved, so it never loads, evicts or
queues anything. The limits are settings (``image_max_bytes``,
``image_max_side``, ``image_max_pixels``, ``images_per_request``,
``fetch_image_urls``); the checks themselves are :mod:`mlxtrio.chat.images`.

Agents resend a conversation's images with every turn (Claude Code's
screenshots stay in its history), so what was learnt of an image that passed
is remembered by the digest of its payload and it is not decoded again.
"""

from __future__ import annotations

import hashlib
import threading
from collections import OrderedDict
from dataclasses import dataclass

import httpx
import trio

from ..chat.conversation import Conversation
from ..chat.errors import ConversationError
from ..chat.images import (
    CheckedImage,
    ImageInput,
    ImageLimits,
    check,
    check_claim,
    check_count,
    image_error,
    refuse_remote,
)
from ..engine.engine import Engine
from ..http.errors import invalid_request
from .call import access_record, services

# Decoding is CPU work (and memory: up to image_max_pixels x 4 bytes each):
# at most this many images are decoded at once, whatever the number of requests.
DECODERS = 2
REMEMBERED = 256  # images that passed, by the digest of their payload
FETCH_SECONDS = 10.0  # for the whole of one remote image, when fetching is allowed
MAX_REDIRECTS = 5


@dataclass(frozen=True)
class _Facts:
    """What a check learnt of an image: small, whatever the image's size."""

    media_type: str
    width: int
    height: int
    digest: str
    size: int

    def of(self, image: ImageInput) -> CheckedImage:
        return CheckedImage(image, self.media_type, self.width, self.height, self.digest, self.size)


class _Passed:
    """Images that passed their checks, least recently used first (shared by
    the decoding threads, hence the lock)."""

    def __init__(self, size: int) -> None:
        self._size = size
        self._items: OrderedDict[tuple[str, ImageLimits], _Facts] = OrderedDict()
        self._lock = threading.Lock()

    def get(self, key: tuple[str, ImageLimits]) -> _Facts | None:
        with self._lock:
            found = self._items.get(key)
            if found is not None:
                self._items.move_to_end(key)
            return found

    def put(self, key: tuple[str, ImageLimits], facts: _Facts) -> None:
        with self._lock:
            self._items[key] = facts
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
    """:func:`check`, or what it learnt last time of the same payload (the
    claimed media type is checked each time: it is this request's)."""
    check_claim(image)
    key = (hashlib.sha256(image.data.encode()).hexdigest(), limits)
    facts = _passed.get(key)
    if facts is None:
        checked = check(image, limits)
        facts = _Facts(
            checked.media_type, checked.width, checked.height, checked.digest, checked.size
        )
        _passed.put(key, facts)
    return facts.of(image)


async def _fetch(image: ImageInput, limits: ImageLimits) -> bytes:
    """A remote image's bytes, when the server allows fetching: within
    :data:`FETCH_SECONDS` in all, at most ``limits.max_bytes`` + 1 of them,
    redirects to http(s) URLs only (httpx refuses other schemes). Cancelling
    the caller abandons the fetch and closes its connection."""
    if not limits.fetch_urls:
        raise refuse_remote(image)
    chunks: list[bytes] = []
    size = 0
    try:
        with trio.fail_after(FETCH_SECONDS):
            async with httpx.AsyncClient(follow_redirects=True, max_redirects=MAX_REDIRECTS) as web:
                async with web.stream("GET", image.data) as response:
                    if response.status_code != 200:
                        raise image_error(
                            f"could not fetch the image (HTTP {response.status_code})", image.param
                        )
                    async for chunk in response.aiter_bytes():
                        chunks.append(chunk)
                        size += len(chunk)
                        if size > limits.max_bytes:
                            break
    except trio.TooSlowError:
        raise image_error(
            f"could not fetch the image within {FETCH_SECONDS:g} s", image.param
        ) from None
    except httpx.HTTPError as exc:
        raise image_error(f"could not fetch the image: {exc}", image.param) from None
    return b"".join(chunks)


async def _check_one(image: ImageInput, limits: ImageLimits) -> CheckedImage:
    if image.source == "url":
        # Fetched on the Trio thread (I/O, under its deadline), then decoded
        # like any other; a URL is fetched each time: what it names may change.
        data = await _fetch(image, limits)
        return await trio.to_thread.run_sync(
            check, image, limits, data, abandon_on_cancel=True, limiter=_decoder_limiter()
        )
    return await trio.to_thread.run_sync(
        _check_once, image, limits, abandon_on_cancel=True, limiter=_decoder_limiter()
    )


async def check_images(conversation: Conversation) -> list[CheckedImage]:
    """Every image of ``conversation`` decoded and checked, in order, on a
    worker thread, at most :data:`DECODERS` at once across the server (a
    remote one fetched first, when allowed). Raises a 400
    :class:`~mlxtrio.http.errors.ApiError` naming the first bad one.

    Cancellation abandons the image in progress: its thread finishes on its own,
    bounded by the limits; a fetch stops at once."""
    images = conversation.images
    if not images:
        return []
    limits = ImageLimits.from_settings(services().settings)
    try:
        check_count(images, limits)
        return [await _check_one(image, limits) for image in images]
    except ConversationError as exc:
        raise invalid_request(exc.message, exc.param) from None


def note_images(engine: Engine, conversation: Conversation) -> None:
    """Say in the access line how many images the request carried, and when
    the model reads text only, that it saw them as placeholders."""
    if conversation.images:
        seen = engine.loaded is not None and engine.loaded.images is not None
        count = len(conversation.images)
        access_record().images = str(count) if seen else f"{count}:placeholder"
