"""The transport guards: what a web page, a confused client or a hostile body can
and cannot make the server do (browser origins, DNS rebinding, content types,
bodies that break parsers), and the access log that shows what happened."""

from __future__ import annotations

import json
import logging

import pytest

from .conftest import SCRIPTED, RawConnection, Server, wait_until

HI = {"model": SCRIPTED, "input": "hi", "max_output_tokens": 4}
MESSAGE = {
    "model": SCRIPTED,
    "max_tokens": 4,
    "messages": [{"role": "user", "content": "hi"}],
}


async def test_no_cors_headers_and_foreign_origins_refused_by_default(scripted: Server) -> None:
    async with scripted.client() as client:
        plain = await client.post("/v1/responses", json=HI)
        page = await client.post(
            "/v1/responses", json=HI, headers={"Origin": "https://evil.example"}
        )
        preflight = await client.options(
            "/v1/messages",
            headers={
                "Origin": "https://evil.example",
                "Access-Control-Request-Method": "POST",
            },
        )
    assert plain.status_code == 200
    assert not any(h.lower().startswith("access-control-") for h in plain.headers)
    assert page.status_code == 403
    assert page.json()["error"]["type"] == "permission_error"
    assert "MLXTRIO_CORS_ORIGINS" in page.json()["error"]["message"]
    assert not any(h.lower().startswith("access-control-") for h in page.headers)
    assert preflight.status_code == 403
    assert preflight.json()["type"] == "error"  # the Anthropic envelope on /v1/messages
    assert scripted.engine.stats.submitted == 1  # the page's request never ran


async def test_configured_origins_get_cors(server_factory, scripted_model_path) -> None:
    server = await server_factory(
        model=scripted_model_path, model_name=SCRIPTED, cors_origins="http://localhost:*"
    )
    origin = "http://localhost:5173"
    async with server.client() as client:
        preflight = await client.options(
            "/v1/responses",
            headers={"Origin": origin, "Access-Control-Request-Method": "POST"},
        )
        r = await client.post("/v1/responses", json=HI, headers={"Origin": origin})
        other = await client.post(
            "/v1/responses", json=HI, headers={"Origin": "http://example.com"}
        )
    assert preflight.status_code == 204
    assert preflight.headers["access-control-allow-origin"] == origin
    assert "POST" in preflight.headers["access-control-allow-methods"]
    assert r.status_code == 200 and r.headers["access-control-allow-origin"] == origin
    assert "x-cached-tokens" in r.headers["access-control-expose-headers"].lower()
    assert other.status_code == 403


@pytest.mark.parametrize(
    ("host", "allowed"),
    [
        ("127.0.0.1", True),
        ("localhost:8000", True),
        ("[::1]:8000", True),
        ("app.localhost", True),
        ("127.1.2.3", True),
        ("evil.example", False),
        ("evil.example:8000", False),
        ("192.168.1.5", False),
    ],
)
async def test_dns_rebinding_guard_on_loopback(scripted: Server, host: str, allowed: bool) -> None:
    conn = await RawConnection.open(scripted)
    try:
        await conn.stream.send_all(
            f"GET /v1/models HTTP/1.1\r\nHost: {host}\r\nConnection: close\r\n\r\n".encode()
        )
        raw = await conn.read_until(b"\r\n\r\n")
    finally:
        await conn.close()
    status = int(raw.split(b" ", 2)[1])
    assert status == (200 if allowed else 403), raw[:300]


async def test_allowed_hosts_setting_admits_a_proxy_name(
    server_factory, scripted_model_path
) -> None:
    server = await server_factory(
        model=scripted_model_path, model_name=SCRIPTED, allowed_hosts="llm.internal"
    )
    async with server.client() as client:
        ok = await client.get("/v1/models", headers={"Host": "llm.internal:443"})
        refused = await client.get("/v1/models", headers={"Host": "other.internal"})
    assert ok.status_code == 200 and refused.status_code == 403


@pytest.mark.parametrize("path", ["/v1/responses", "/v1/messages", "/v1/messages/count_tokens"])
@pytest.mark.parametrize(
    "content_type", ["text/plain", "application/x-www-form-urlencoded", "multipart/form-data", None]
)
async def test_only_json_bodies_are_read(scripted: Server, path: str, content_type) -> None:
    body = json.dumps(MESSAGE if "messages" in path else HI).encode()
    headers = {} if content_type is None else {"Content-Type": content_type}
    async with scripted.client() as client:
        r = await client.post(path, content=body, headers=headers)
    assert r.status_code == 415, r.text
    assert "application/json" in r.text
    assert scripted.engine.stats.submitted == 0


async def test_json_content_type_variants_are_read(scripted: Server) -> None:
    async with scripted.client() as client:
        for content_type in ("application/json; charset=utf-8", "application/vnd.api+json"):
            r = await client.post(
                "/v1/responses", content=json.dumps(HI), headers={"Content-Type": content_type}
            )
            assert r.status_code == 200, (content_type, r.text)


NASTY_BODIES = {
    "deep nesting": "[" * 5000 + "]" * 5000,
    "deep object": '{"a":' * 3000 + "1" + "}" * 3000,
    "huge integer": '{"model": "scripted", "input": "hi", "max_output_tokens": ' + "9" * 5000 + "}",
    "lone surrogate": '{"model": "scripted", "input": "hi", "user": "\\ud800"}',
    "lone low surrogate": '{"model": "scripted", "input": "\\udc00x"}',
    "NaN": '{"model": "scripted", "input": "hi", "temperature": NaN}',
    "Infinity": '{"model": "scripted", "input": "hi", "temperature": Infinity}',
    "invalid utf-8": b'{"model": "scripted", "input": "\xff\xfe"}',
    "truncated": '{"model": "scripted", "input": ',
    "not an object": "[1, 2, 3]",
    "empty": "",
}


@pytest.mark.parametrize("name", sorted(NASTY_BODIES))
@pytest.mark.parametrize("path", ["/v1/responses", "/v1/messages"])
async def test_bodies_that_break_parsers_are_400s(scripted: Server, name: str, path: str) -> None:
    body = NASTY_BODIES[name]
    async with scripted.client() as client:
        r = await client.post(
            path,
            content=body if isinstance(body, bytes) else body.encode(),
            headers={"Content-Type": "application/json"},
        )
        health = await client.get("/health")
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["type"] == "invalid_request_error"
    assert "Traceback" not in r.text
    assert health.status_code == 200


async def test_odd_paths_are_json_errors_not_redirects(scripted: Server) -> None:
    async with scripted.client() as client:
        double = await client.post("/v1//responses", json=HI)
        # Only /v1/responses speaks WebSocket (tests/test_responses_socket.py).
        websocket = await client.get(
            "/v1/messages",
            headers={
                "Connection": "Upgrade",
                "Upgrade": "websocket",
                "Sec-WebSocket-Version": "13",
                "Sec-WebSocket-Key": "dGhlIHNhbXBsZSBub25jZQ==",
            },
        )
    assert double.status_code == 404 and double.json()["error"]["type"] == "not_found_error"
    assert 400 <= websocket.status_code < 500, websocket.text


async def test_one_access_log_line_per_request(
    scripted: Server, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger="mlxtrio.access")
    async with scripted.client() as client:
        await client.post("/v1/responses", json=HI)
        async with client.stream("POST", "/v1/messages", json={**MESSAGE, "stream": True}) as r:
            await r.aread()
        await client.post("/v1/responses", json={"model": SCRIPTED})

    def lines() -> list[str]:  # each is written once its response is over
        return [r.getMessage() for r in caplog.records if r.name == "mlxtrio.access"]

    await wait_until(lambda: len(lines()) >= 3, what="three access lines")
    logged = lines()
    assert len(logged) == 3, logged
    assert logged[0].startswith("POST /v1/responses 200 model=scripted")
    for field in ("prompt=", "cached=0", "generated=", "ttft=", "duration=", "finish=stop"):
        assert field in logged[0], logged[0]
    assert logged[1].startswith("POST /v1/messages 200 model=scripted stream=yes")
    assert "finish=stop" in logged[1]
    assert logged[2].startswith("POST /v1/responses 400")


async def test_count_tokens_of_a_huge_body_is_refused_without_tokenizing(
    server_factory, scripted_model_path
) -> None:
    server = await server_factory(
        model=scripted_model_path, model_name=SCRIPTED, max_body_bytes=20_000_000
    )
    text = "word " * 2_000_000  # 10 MB: tokenizing it took 14 s of CPU
    body = {**MESSAGE, "messages": [{"role": "user", "content": text}]}
    async with server.client() as client:
        counted = await client.post("/v1/messages/count_tokens", json=body)
        created = await client.post("/v1/messages", json=body)
        responses = await client.post("/v1/responses", json={**HI, "input": text})
    for r in (counted, created):
        assert r.status_code == 400, r.text
        assert r.json()["error"]["message"].startswith("prompt is too long: ")
    assert responses.status_code == 400
    assert responses.json()["error"]["code"] == "context_length_exceeded"


async def test_a_configured_context_length_bounds_prompts(
    server_factory, scripted_model_path
) -> None:
    """CONTEXT_LENGTH below the model's: over it, each client gets the error
    it compacts on (Anthropic's wording, OpenAI's code)."""
    server = await server_factory(model=scripted_model_path, model_name=SCRIPTED, context_length=64)
    assert server.engine.context_length == 64
    long = "word " * 100
    async with server.client() as client:
        ok = await client.post("/v1/responses", json=HI)
        messages = await client.post(
            "/v1/messages",
            json={**MESSAGE, "messages": [{"role": "user", "content": long}]},
        )
        responses = await client.post("/v1/responses", json={**HI, "input": long})
    assert ok.status_code == 200, ok.text
    error = messages.json()["error"]
    assert messages.status_code == 400 and error["type"] == "invalid_request_error"
    assert (
        error["message"].startswith("prompt is too long: ") and "> 64 maximum" in error["message"]
    )
    assert responses.status_code == 400
    assert responses.json()["error"]["code"] == "context_length_exceeded"
