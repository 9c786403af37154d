"""The request's images, checked before anything else is done for it.

A bad image is the client's mistake: it is refused with a 400 naming its
content block before the model is resolved, so it never loads, evicts or
queues anything. The limits are settings (``image_max_bytes``,
``image_max_side``, ``image_max_pixels``, ``images_per_request``,
``fetch_image_urls``); the checks themselves are :mod:`mlxtrio.chat.images`.
"""

from __future__ import annotations

import trio

from ..chat.conversation import Conversation
from ..chat.errors import ConversationError
from ..chat.images import CheckedImage, ImageLimits, check, check_count
from ..http.errors import invalid_request
from .call import access_record, services


async def check_images(conversation: Conversation) -> list[CheckedImage]:
    """Every image of ``conversation`` decoded and checked, in order, on a
    worker thread (decoding is CPU work; a remote fetch, when allowed, is I/O).
    Raises a 400 :class:`~mlxtrio.http.errors.ApiError` naming the first bad one.

    Cancellation abandons the image in progress: its thread finishes on its own,
    bounded by the limits (and a fetch by its timeout)."""
    images = conversation.images
    if not images:
        return []
    limits = ImageLimits.from_settings(services().settings)
    try:
        check_count(images, limits)
        checked = [
            await trio.to_thread.run_sync(check, image, limits, abandon_on_cancel=True)
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
