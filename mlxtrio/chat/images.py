"""Images in a request: what the APIs carried, and the checks that make a bad
image the client's mistake (a 400 naming its content block), never the server's.

Converters (``api/*/convert.py``) record each image as an :class:`ImageInput`
without looking inside it: the base64 text or the URL, the media type the client
claimed, and the request field it stood in. :func:`check` then decodes it under
:class:`ImageLimits` — bytes, dimensions, total pixels (decompression bombs),
a format the server reads — and returns a :class:`CheckedImage` carrying the
content hash that names it. The media type a client claims is not held
against it: clients label screenshots loosely (``data:image/jpeg`` on a PNG,
``image/jpg``), the bytes say what the image is. Decoding is CPU work: callers run
:func:`check` on a worker thread. Fetching a remote URL is opt-in
(``fetch_image_urls``; :mod:`mlxtrio.serving.images` fetches); by default a
server must not fetch what a prompt names.
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import io
import re
import secrets
from dataclasses import dataclass, field
from typing import Any, Literal

from .errors import ConversationError

# The media types every API documents for images, as Pillow names their formats.
MEDIA_TYPES = {
    "image/png": "PNG",
    "image/jpeg": "JPEG",
    "image/gif": "GIF",
    "image/webp": "WEBP",
}
# Pillow's name for a phone camera's multi-picture JPEG (HDR gain maps): a JPEG.
PILLOW_ALIASES = {"MPO": "image/jpeg"}
# Media type spellings clients send for the same formats.
MEDIA_TYPE_ALIASES = {"image/jpg": "image/jpeg", "image/pjpeg": "image/jpeg"}


@dataclass(frozen=True)
class ImageInput:
    """One image as the request carried it. ``data`` is the base64 payload
    (``source == "base64"``) or the URL (``source == "url"``); ``param`` is the
    request field it stood in (``messages.0.content.2``), named in errors."""

    source: Literal["base64", "url"]
    data: str
    param: str
    media_type: str | None = None  # as claimed; None when the client did not say
    detail: str | None = None  # Responses / Chat Completions "low" | "high" | "auto"
    # Names this image where it stands in a message's text (see image_marker):
    # random, so a marker stored with an earlier turn never names a new image.
    key: str = field(default_factory=lambda: secrets.token_hex(8), compare=False)


# Where an image stands in a message's text: private-use characters around its
# key. Rendering writes each as the model's image markup when the model sees
# it, else as IMAGE_PLACEHOLDER (see mlxtrio.chat.prompt).
IMAGE_MARKER = re.compile("\ue000image ([0-9a-f]+)\ue001")


def image_marker(image: ImageInput) -> str:
    """The text that stands for ``image`` in its message."""
    return f"\ue000image {image.key}\ue001"


@dataclass(frozen=True)
class CheckedImage:
    """An image that decoded within the limits. ``digest`` (SHA-256 of its
    bytes) names its content: the same file sent again hashes the same."""

    input: ImageInput
    media_type: str
    width: int
    height: int
    digest: str
    size: int  # bytes
    # A remote image's bytes as fetched (a URL may name other bytes next time).
    fetched: bytes | None = field(default=None, repr=False, compare=False)

    def open(self) -> Any:
        """The image's pixels (a Pillow image, loaded): for a model that sees.
        Blocking: run it on a worker thread. It decoded once already, within
        the limits, so it decodes again."""
        from PIL import Image

        data = self.fetched
        if data is None:
            data = _bytes_of(self.input, ImageLimits(max_bytes=self.size + 3))
        with Image.open(io.BytesIO(data)) as picture:
            picture.load()
            return picture.copy() if picture.mode == "RGB" else picture.convert("RGB")


@dataclass(frozen=True)
class ImageLimits:
    max_bytes: int = 5 << 20
    max_side: int = 8000  # pixels, either dimension
    max_pixels: int = 32 << 20  # width x height
    max_count: int = 100  # per request
    fetch_urls: bool = False

    @classmethod
    def from_settings(cls, settings: Any) -> ImageLimits:
        return cls(
            settings.image_max_bytes,
            settings.image_max_side,
            settings.image_max_pixels,
            settings.images_per_request,
            settings.fetch_image_urls,
        )


def image_error(message: str, param: str) -> ConversationError:
    """A refusal of one image; the message starts with where it stood, since
    not every API's error envelope has a ``param``."""
    return ConversationError(f"{param}: {message}", param)


def from_data_url(url: str, param: str, detail: str | None = None) -> ImageInput:
    """An image given as a URL: a ``data:<mime>;base64,<payload>`` URL, or a
    remote ``http(s)`` one (fetched only when the server allows it). Anything
    else is a :class:`ConversationError` naming ``param``."""
    if url[:5].lower() == "data:":
        header, comma, payload = url[5:].partition(",")
        # data:[<media type>][;name=value...];base64 - the claimed type is not
        # held against the bytes (see the module docstring).
        if not comma or header.split(";")[-1].strip().lower() != "base64":
            raise image_error(
                "an image data URL must be base64: data:<media type>;base64,<data>", param
            )
        return ImageInput("base64", payload, param, None, detail)
    if url.startswith(("http://", "https://")):
        return ImageInput("url", url, param, None, detail)
    raise image_error(
        "an image URL must be a base64 data URL (data:<media type>;base64,<data>) or an "
        f"http(s) URL (got {url[:40]!r})",
        param,
    )


def check(image: ImageInput, limits: ImageLimits, fetched: bytes | None = None) -> CheckedImage:
    """``image`` decoded and checked (``fetched``: a remote image's bytes, from
    :func:`fetch`); a :class:`ConversationError` naming its field when it is
    not an image this server takes. Blocking (base64, Pillow's decode): run it
    on a worker thread."""
    check_claim(image)
    data = fetched if fetched is not None else _bytes_of(image, limits)
    if not data:
        raise image_error("the image is empty", image.param)
    if len(data) > limits.max_bytes:
        raise _too_big(image, len(data), limits)
    media_type, width, height = _decode(data, image, limits)
    digest = hashlib.sha256(data).hexdigest()
    return CheckedImage(
        image,
        media_type,
        width,
        height,
        digest,
        len(data),
        fetched if image.source == "url" else None,
    )


def check_claim(image: ImageInput) -> None:
    """The media type a client claims must name an image format the server
    reads (its spelling is forgiven; whether the bytes agree is not checked)."""
    claimed = image.media_type
    if claimed is None:
        return
    normal = claimed.strip().lower()
    if MEDIA_TYPE_ALIASES.get(normal, normal) not in MEDIA_TYPES:
        raise image_error(
            f"unsupported image media type {claimed!r}: send one of {', '.join(MEDIA_TYPES)}",
            image.param,
        )


def check_count(images: list[ImageInput], limits: ImageLimits) -> None:
    """A request with more images than the limit allows is refused, naming
    the first one past it."""
    if len(images) > limits.max_count:
        raise image_error(
            f"too many images: {len(images)} in one request (the limit is "
            f"{limits.max_count}, setting images_per_request)",
            images[limits.max_count].param,
        )


def _bytes_of(image: ImageInput, limits: ImageLimits) -> bytes:
    if image.source == "url":  # not fetched (serving.images fetches, when allowed)
        raise refuse_remote(image)
    text = "".join(image.data.split())  # base64 wrapped in lines is still base64
    # Refuse by length before decoding: 4 base64 characters carry 3 bytes.
    if len(text) // 4 * 3 > limits.max_bytes + 3:
        raise _too_big(image, len(text) // 4 * 3, limits)
    # The URL-safe alphabet and missing padding are accepted (clients send both).
    text = text.replace("-", "+").replace("_", "/")
    try:
        return base64.b64decode(text + "=" * (-len(text) % 4), validate=True)
    except (binascii.Error, ValueError):
        raise image_error("the image's data is not valid base64", image.param) from None


def refuse_remote(image: ImageInput) -> ConversationError:
    """Why a remote image URL is not fetched (``fetch_image_urls`` is off)."""
    return image_error(
        "remote image URLs are not fetched by this server (a server must not fetch what "
        "a prompt names): inline the image as base64 (a data URL), or start the server "
        "with fetch_image_urls on",
        image.param,
    )


def _decode(data: bytes, image: ImageInput, limits: ImageLimits) -> tuple[str, int, int]:
    """(media type, width, height), after decoding every pixel: a file whose
    header is fine but whose data is not must fail here, not in the model."""
    from PIL import Image, UnidentifiedImageError

    try:
        # Only the four formats are parsed at all (MPO is Pillow's JPEG variant).
        formats = [*MEDIA_TYPES.values(), *PILLOW_ALIASES]
        with Image.open(io.BytesIO(data), formats=formats) as picture:
            fmt = picture.format or ""
            width, height = picture.size
            media_type = PILLOW_ALIASES.get(fmt) or next(
                (m for m, f in MEDIA_TYPES.items() if f == fmt), None
            )
            if media_type is None:
                raise image_error(
                    f"unsupported image format {fmt or 'unknown'}: send one of "
                    f"{', '.join(MEDIA_TYPES)}",
                    image.param,
                )
            # Checked from the header alone, before a single pixel is decoded:
            # a small file that would decode to gigabytes never gets that far.
            _check_dimensions(width, height, image, limits)
            picture.load()
    except ConversationError:
        raise
    except UnidentifiedImageError:
        raise image_error(
            "the image could not be decoded (not a PNG, JPEG, GIF or WebP image)", image.param
        ) from None
    except Image.DecompressionBombError:
        # Pillow's own ceiling, for an image_max_pixels set above it.
        raise image_error(
            "the image decodes to too many pixels (setting image_max_pixels)", image.param
        ) from None
    except Exception as exc:  # noqa: BLE001 - whatever a decoder raises, it is the image's fault
        raise image_error(f"the image could not be decoded ({exc})", image.param) from None
    return media_type, width, height


def _check_dimensions(width: int, height: int, image: ImageInput, limits: ImageLimits) -> None:
    if width < 1 or height < 1:
        raise image_error(f"the image has no pixels ({width}x{height})", image.param)
    if max(width, height) > limits.max_side:
        raise image_error(
            f"the image is {width}x{height} pixels: at most {limits.max_side} on a side "
            "(setting image_max_side)",
            image.param,
        )
    if width * height > limits.max_pixels:
        raise image_error(
            f"the image is {width}x{height} = {width * height} pixels: at most "
            f"{limits.max_pixels} (setting image_max_pixels)",
            image.param,
        )


def _too_big(image: ImageInput, size: int, limits: ImageLimits) -> ConversationError:
    return image_error(
        f"the image is {size} bytes: at most {limits.max_bytes} (setting image_max_bytes)",
        image.param,
    )
