"""Images in requests: a bad image is the client's mistake (a 400 naming its
content block, on every API, before anything reaches the engine); a good one
reaches a text-only model as its placeholder, and the access line says so.

The checks are unit-tested on real encoded images (Pillow), then driven through
the real server with the official SDKs."""

from __future__ import annotations

import base64
import http.server
import io
import logging
import struct
import threading
import zlib
from collections.abc import Iterator
from typing import Any

import anthropic
import openai
import pytest
import trio
from PIL import Image

from mlxtrio.chat.conversation import IMAGE_PLACEHOLDER
from mlxtrio.chat.errors import ConversationError
from mlxtrio.chat.images import ImageInput, ImageLimits, check, check_count, from_data_url

from .conftest import MODEL, Server, ServerFactory, wait_until


def encode(fmt: str = "PNG", size: tuple[int, int] = (16, 12), color: Any = (200, 30, 30)) -> bytes:
    buffer = io.BytesIO()
    Image.new("RGB", size, color).save(buffer, fmt)
    return buffer.getvalue()


def b64(data: bytes) -> str:
    return base64.b64encode(data).decode()


def data_url(data: bytes, media_type: str = "image/png") -> str:
    return f"data:{media_type};base64,{b64(data)}"


def refused(image: ImageInput, limits: ImageLimits | None = None) -> str:
    with pytest.raises(ConversationError) as caught:
        check(image, limits or ImageLimits())
    assert caught.value.param == image.param
    assert caught.value.message.startswith(image.param + ": ")
    return caught.value.message


# -- the checks ------------------------------------------------------------------


@pytest.mark.parametrize(
    "fmt, media_type",
    [("PNG", "image/png"), ("JPEG", "image/jpeg"), ("GIF", "image/gif"), ("WEBP", "image/webp")],
)
def test_each_documented_format_is_taken(fmt: str, media_type: str) -> None:
    data = encode(fmt)
    checked = check(ImageInput("base64", b64(data), "m.0", media_type), ImageLimits())
    assert (checked.media_type, checked.width, checked.height) == (media_type, 16, 12)
    assert checked.size == len(data)
    # Undeclared (a data URL without a type): the bytes say what it is.
    assert check(from_data_url(f"data:;base64,{b64(data)}", "m.0"), ImageLimits()).media_type == (
        media_type
    )


def test_the_digest_names_the_pixels() -> None:
    def digest(color: Any) -> str:
        return check(ImageInput("base64", b64(encode(color=color)), "p"), ImageLimits()).digest

    assert digest((1, 2, 3)) == digest((1, 2, 3))
    assert digest((1, 2, 3)) != digest((1, 2, 4))


def png_header(width: int, height: int) -> bytes:
    """A PNG that claims ``width`` x ``height`` pixels and holds almost none:
    what a decompression bomb looks like from its header."""

    def chunk(kind: bytes, data: bytes) -> bytes:
        body = kind + data
        return struct.pack(">I", len(data)) + body + struct.pack(">I", zlib.crc32(body))

    header = struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0)
    return (
        b"\x89PNG\r\n\x1a\n"
        + chunk(b"IHDR", header)
        + chunk(b"IDAT", zlib.compress(b"\0" * 64))
        + chunk(b"IEND", b"")
    )


def test_bad_images_are_refused_naming_their_block() -> None:
    png = encode()
    assert "not valid base64" in refused(ImageInput("base64", "%%%not base64", "p"))
    assert "could not be decoded" in refused(ImageInput("base64", b64(b"hello, not an image"), "p"))
    truncated = png[: len(png) // 2]
    assert "could not be decoded" in refused(ImageInput("base64", b64(truncated), "p"))
    assert "is empty" in refused(ImageInput("base64", "", "p"))
    assert "unsupported image media type" in refused(
        ImageInput("base64", b64(png), "p", "image/bmp")
    )
    buffer = io.BytesIO()
    Image.new("RGB", (4, 4)).save(buffer, "BMP")
    assert "could not be decoded" in refused(ImageInput("base64", b64(buffer.getvalue()), "p"))


def test_what_clients_really_send_is_taken() -> None:
    """Loose labels and encodings: the bytes say what the image is."""
    png = encode()
    limits = ImageLimits()
    # A PNG labelled JPEG (the usual snippet), and Anthropic-style spellings.
    assert check(from_data_url(data_url(png, "image/jpeg"), "p"), limits).media_type == "image/png"
    for label in ("image/jpeg", "image/jpg", "IMAGE/PNG"):
        assert check(ImageInput("base64", b64(png), "p", label), limits).media_type == "image/png"
    # Data URL parameters, and BASE64 in capitals.
    for url in (
        f"data:image/png;name=shot.png;base64,{b64(png)}",
        f"DATA:image/png;BASE64,{b64(png)}",
    ):
        assert check(from_data_url(url, "p"), limits).width == 16
    # Base64 wrapped in lines, URL-safe, unpadded.
    wrapped = "\n".join(b64(png)[i : i + 76] for i in range(0, len(b64(png)), 76))
    urlsafe = base64.urlsafe_b64encode(png).decode().rstrip("=")
    for text in (wrapped, urlsafe):
        assert (
            check(ImageInput("base64", text, "p"), limits).digest
            == check(ImageInput("base64", b64(png), "p"), limits).digest
        )
    # A phone camera's JPEG (Pillow reads it as MPO).
    buffer = io.BytesIO()
    picture = Image.new("RGB", (8, 8), (1, 2, 3))
    picture.save(buffer, "MPO", save_all=True, append_images=[picture])
    mpo = check(ImageInput("base64", b64(buffer.getvalue()), "p", "image/jpeg"), limits)
    assert mpo.media_type == "image/jpeg"


def test_limits_are_settings_and_bombs_never_decode() -> None:
    big = encode(size=(300, 200))
    small_limits = ImageLimits(max_bytes=100)
    assert "image_max_bytes" in refused(ImageInput("base64", b64(big), "p"), small_limits)
    assert "image_max_side" in refused(
        ImageInput("base64", b64(big), "p"), ImageLimits(max_side=256)
    )
    assert "image_max_pixels" in refused(
        ImageInput("base64", b64(big), "p"), ImageLimits(max_pixels=300 * 200 - 1)
    )
    # Bombs: headers claiming millions of pixels in a hundred bytes are
    # refused from the header, by the server's own limits.
    assert "image_max_side" in refused(ImageInput("base64", b64(png_header(9000, 100)), "p"))
    # Past Pillow's own ceiling (2 x 89 M pixels) it refuses first.
    assert "too many pixels" in refused(ImageInput("base64", b64(png_header(20000, 20000)), "p"))
    assert "image_max_pixels" in refused(ImageInput("base64", b64(png_header(7000, 7000)), "p"))
    images = [ImageInput("base64", b64(big), f"p.{i}") for i in range(3)]
    check_count(images, ImageLimits(max_count=3))
    with pytest.raises(ConversationError, match="images_per_request") as caught:
        check_count(images, ImageLimits(max_count=2))
    assert caught.value.param == "p.2"


def test_urls() -> None:
    assert from_data_url("https://example.com/a.png", "p").source == "url"
    with pytest.raises(ConversationError, match="base64"):
        from_data_url("data:image/png,rawbytes", "p")
    with pytest.raises(ConversationError, match="http"):
        from_data_url("file:///etc/passwd", "p")
    remote = from_data_url("http://127.0.0.1:9/a.png", "p")
    assert "not fetched by this server" in refused(remote)


# -- through the server -------------------------------------------------------------

PNG = encode()


def anthropic_image(data: bytes = PNG, media_type: str = "image/png") -> dict[str, Any]:
    return {
        "type": "image",
        "source": {"type": "base64", "media_type": media_type, "data": b64(data)},
    }


def access_lines(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.name == "mlxtrio.access"]


async def ask_messages(server: Server, content: list[dict[str, Any]]) -> Any:
    return await server.anthropic().messages.create(
        model=MODEL, max_tokens=8, messages=[{"role": "user", "content": content}]
    )


async def ask_responses(server: Server, url: str, detail: str = "auto") -> Any:
    return await server.openai().responses.create(
        model=MODEL,
        max_output_tokens=8,
        input=[
            {
                "role": "user",
                "content": [
                    {"type": "input_text", "text": "What is this?"},
                    {"type": "input_image", "image_url": url, "detail": detail},
                ],
            }
        ],
    )


async def ask_chat(server: Server, url: str) -> Any:
    return await server.openai().chat.completions.create(
        model=MODEL,
        max_tokens=8,
        messages=[
            {
                "role": "user",
                "content": [
                    {"type": "text", "text": "What is this?"},
                    {"type": "image_url", "image_url": {"url": url}},
                ],
            }
        ],
    )


async def test_a_good_image_reaches_a_text_model_as_its_placeholder(
    server: Server, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, "mlxtrio.access")
    content = [{"type": "text", "text": "What is this?"}, anthropic_image()]
    message = await ask_messages(server, content)
    assert message.stop_reason in ("end_turn", "max_tokens")
    count = await server.anthropic().messages.count_tokens(
        model=MODEL, messages=[{"role": "user", "content": content}]
    )
    placeholder_only = await server.anthropic().messages.count_tokens(
        model=MODEL,
        messages=[{"role": "user", "content": "What is this?" + IMAGE_PLACEHOLDER}],
    )
    assert count.input_tokens == placeholder_only.input_tokens == message.usage.input_tokens
    response = await ask_responses(server, data_url(PNG))
    assert response.status in ("completed", "incomplete")
    completion = await ask_chat(server, data_url(encode("JPEG"), "image/jpeg"))
    assert completion.choices[0].finish_reason in ("stop", "length")
    paths = ("/v1/messages", "/v1/responses", "/v1/chat/completions")
    # A call's line is written once its response has gone out.
    await wait_until(lambda: len(access_lines(caplog)) == 5, what="the access lines")
    for path in paths:
        (line,) = [x for x in access_lines(caplog) if x.startswith(f"POST {path} 200")]
        assert "images=1:placeholder" in line


async def test_an_image_in_a_claude_code_tool_result(server: Server) -> None:
    def conversation(image: dict[str, Any]) -> list[dict[str, Any]]:
        return [
            {"role": "user", "content": "Look at shot.png"},
            {
                "role": "assistant",
                "content": [
                    {
                        "type": "tool_use",
                        "id": "toolu_1",
                        "name": "Read",
                        "input": {"file_path": "shot.png"},
                    },
                ],
            },
            {
                "role": "user",
                "content": [
                    {
                        "type": "tool_result",
                        "tool_use_id": "toolu_1",
                        "content": [{"type": "text", "text": "Read image"}, image],
                    }
                ],
            },
        ]

    tools = [{"name": "Read", "description": "Read a file", "input_schema": {"type": "object"}}]
    client = server.anthropic()
    ok = await client.messages.create(
        model=MODEL, max_tokens=8, tools=tools, messages=conversation(anthropic_image())
    )
    assert ok.usage.input_tokens > 0
    with pytest.raises(anthropic.BadRequestError) as caught:
        await client.messages.create(
            model=MODEL,
            max_tokens=8,
            tools=tools,
            messages=conversation(anthropic_image(b"not a png")),
        )
    assert caught.value.body["error"]["message"].startswith("messages.2.content.0.content.1: ")


BAD = {
    "undecodable": (b"GIF89a but no more", "image/gif", "could not be decoded"),
    "truncated": (PNG[: len(PNG) // 2], "image/png", "could not be decoded"),
    "too big": (encode(size=(900, 10)), "image/png", "image_max_side"),
}


@pytest.mark.parametrize("case", sorted(BAD))
async def test_a_bad_image_is_a_400_on_every_api_and_reaches_no_engine(
    server_factory: ServerFactory, case: str
) -> None:
    server = await server_factory(image_max_side=512)
    data, media_type, words = BAD[case]
    before = server.engine.stats.submitted
    with pytest.raises(anthropic.BadRequestError) as messages:
        await ask_messages(
            server, [anthropic_image(data, media_type), {"type": "text", "text": "x"}]
        )
    assert messages.value.body["error"]["message"].startswith("messages.0.content.0: ")
    with pytest.raises(anthropic.BadRequestError):
        await server.anthropic().messages.count_tokens(
            model=MODEL, messages=[{"role": "user", "content": [anthropic_image(data, media_type)]}]
        )
    with pytest.raises(openai.BadRequestError) as responses:
        await ask_responses(server, data_url(data, media_type))
    assert responses.value.body["param"] == "input.0.content.1.image_url"
    with pytest.raises(openai.BadRequestError) as chat:
        await ask_chat(server, data_url(data, media_type))
    assert chat.value.body["param"] == "messages.0.content.1.image_url.url"
    for caught in (messages, responses, chat):
        assert words in str(caught.value)
    assert server.engine.stats.submitted == before


async def test_too_many_images(server_factory: ServerFactory) -> None:
    server = await server_factory(images_per_request=2)
    with pytest.raises(anthropic.BadRequestError, match="images_per_request"):
        await ask_messages(server, [anthropic_image()] * 3)
    await ask_messages(server, [anthropic_image()] * 2)


@pytest.fixture
def image_host() -> Iterator[str]:
    """A local HTTP server holding PNGs, and redirects to one of them and to a
    file (the only remote images a test can reach)."""

    class Handler(http.server.BaseHTTPRequestHandler):
        def do_GET(self) -> None:  # noqa: N802 (the stdlib's name)
            redirects = {"/moved.png": "/shot.png", "/to-file.png": "file:///etc/passwd"}
            if self.path in redirects:
                self.send_response(302)
                self.send_header("Location", redirects[self.path])
                self.end_headers()
                return
            body = {"/shot.png": PNG, "/big.png": encode(size=(400, 400), color=(1, 2, 3))}
            found = body.get(self.path)
            self.send_response(200 if found else 404)
            self.send_header("Content-Type", "image/png")
            self.end_headers()
            self.wfile.write(found or b"")

        def log_message(self, *args: Any) -> None:
            pass

    host = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    thread = threading.Thread(target=host.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{host.server_address[1]}"
    finally:
        host.shutdown()
        host.server_close()


async def test_remote_urls_are_fetched_only_when_allowed(
    server_factory: ServerFactory, image_host: str
) -> None:
    refusing = await server_factory()
    with pytest.raises(openai.BadRequestError, match="not fetched by this server"):
        await ask_responses(refusing, f"{image_host}/shot.png")
    fetching = await server_factory(fetch_image_urls=True)
    completion = await ask_chat(fetching, f"{image_host}/shot.png")
    assert completion.choices[0].finish_reason in ("stop", "length")
    with pytest.raises(openai.BadRequestError, match="could not fetch the image"):
        await ask_chat(fetching, f"{image_host}/missing.png")


async def test_an_image_resent_next_turn_is_not_decoded_again(
    server: Server, monkeypatch: pytest.MonkeyPatch
) -> None:
    from mlxtrio.serving import images

    decoded: list[str] = []

    def counting(image: ImageInput, limits: ImageLimits) -> Any:
        decoded.append(image.param)
        return check(image, limits)

    monkeypatch.setattr(images, "check", counting)
    screenshot = anthropic_image(encode(color=(9, 9, 9)))
    await ask_messages(server, [screenshot, {"type": "text", "text": "first"}])
    await ask_messages(server, [screenshot, {"type": "text", "text": "again"}])
    assert decoded == ["messages.0.content.0"]
    await ask_messages(server, [anthropic_image(encode(color=(9, 9, 8)))])
    assert len(decoded) == 2


async def test_a_vision_checkpoint_is_said_to_be_served_as_text(
    server_factory: ServerFactory,
    scripted_model_path: str,
    tmp_path: Any,
    caplog: pytest.LogCaptureFixture,
) -> None:
    """mlx-lm loads a VLM checkpoint's language model alone: the log says the
    model will not see, and its images reach it as placeholders."""
    import json
    import shutil

    vlm = tmp_path / "looks-like-a-vlm"
    shutil.copytree(scripted_model_path, vlm)
    config = json.loads((vlm / "config.json").read_text())
    (vlm / "config.json").write_text(json.dumps({**config, "vision_config": {"depth": 2}}))
    caplog.set_level(logging.INFO, "mlxtrio")
    server = await server_factory(model=str(vlm))
    (warning,) = [r for r in caplog.records if "vision-language model" in r.getMessage()]
    assert warning.levelname == "WARNING" and "served as text only" in warning.getMessage()
    answer = await server.anthropic().messages.create(
        model="looks-like-a-vlm",
        max_tokens=4,
        messages=[{"role": "user", "content": [anthropic_image(), {"type": "text", "text": "Hi"}]}],
    )
    assert answer.usage.input_tokens > 0


async def test_what_is_remembered_of_an_image_is_its_facts_not_its_claims(server: Server) -> None:
    """A payload that passed once is not decoded again, but each request's own
    claim is still checked: the same bytes labelled as a PDF are refused."""
    png = encode(color=(4, 5, 6))
    await ask_messages(server, [anthropic_image(png)])
    with pytest.raises(anthropic.BadRequestError, match="unsupported image media type"):
        await ask_messages(server, [anthropic_image(png, "application/pdf")])


@pytest.fixture
def silent_host() -> Iterator[str]:
    """An HTTP server that sends its headers and then nothing, for ever."""
    import socket

    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen()
    stop = threading.Event()

    def serve() -> None:
        connection, _ = listener.accept()
        connection.recv(4096)
        connection.sendall(b"HTTP/1.1 200 OK\r\nContent-Length: 100000\r\n\r\nxx")
        stop.wait(30)
        connection.close()

    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{listener.getsockname()[1]}/slow.png"
    finally:
        stop.set()
        listener.close()


async def test_a_fetch_that_stalls_ends_at_its_deadline(
    server_factory: ServerFactory, silent_host: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    from mlxtrio.serving import images

    monkeypatch.setattr(images, "FETCH_SECONDS", 1.0)
    server = await server_factory(fetch_image_urls=True)
    with trio.fail_after(10):
        with pytest.raises(openai.BadRequestError, match="within 1 s"):
            await ask_chat(server, silent_host)


async def test_a_fetch_follows_http_redirects_only_and_stops_at_the_byte_limit(
    server_factory: ServerFactory, image_host: str
) -> None:
    server = await server_factory(fetch_image_urls=True, image_max_bytes=300)
    completion = await ask_chat(server, f"{image_host}/moved.png")
    assert completion.choices[0].finish_reason in ("stop", "length")
    with pytest.raises(openai.BadRequestError, match="could not fetch the image"):
        await ask_chat(server, f"{image_host}/to-file.png")
    with pytest.raises(openai.BadRequestError, match="image_max_bytes"):
        await ask_chat(server, f"{image_host}/big.png")
