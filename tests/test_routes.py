"""Every route and transport error case: status, envelope and headers."""

from __future__ import annotations

from .conftest import MODEL, Server


async def test_health_reports_model_and_engine_state(server: Server) -> None:
    async with server.client() as client:
        r = await client.get("/health")
    assert r.status_code == 200
    body = r.json()
    assert body["status"] == "ok"
    assert body["models"][0]["id"] == MODEL
    assert body["models"][0]["state"] == "ready"
    assert body["models"][0]["dtype"] in ("bfloat16", "float32")


async def test_compute_dtype_setting_reaches_the_engine(server_factory) -> None:
    """float32 compute (what ``auto`` picks on a CPU with a fast BLAS) serves."""
    server = await server_factory(compute_dtype="float32")
    async with server.client() as client:
        health = (await client.get("/health")).json()
        r = await client.post(
            "/v1/responses", json={"model": MODEL, "input": "hi", "max_output_tokens": 8}
        )
    assert health["models"][0]["dtype"] == "float32"
    assert r.status_code == 200
    assert r.json()["usage"]["output_tokens"] >= 1


async def test_root_answers_get_and_head(server: Server) -> None:
    async with server.client() as client:
        assert (await client.get("/")).status_code == 200
        head = await client.head("/")
    assert head.status_code == 200
    assert head.content == b""


async def test_models_list_shape_with_aliases(server_factory) -> None:
    server = await server_factory(aliases={"gpt-local": MODEL, "claude-*": MODEL})
    async with server.client() as client:
        r = await client.get("/v1/models")
    assert r.status_code == 200
    body = r.json()
    assert body["object"] == "list"
    ids = [m["id"] for m in body["data"]]
    assert ids == [MODEL, "gpt-local"]  # patterns are not model names
    assert all(m["object"] == "model" and "created" in m for m in body["data"])


async def test_metrics_exposes_required_names(server: Server) -> None:
    async with server.client() as client:
        await client.get("/health")
        r = await client.get("/metrics")
    assert r.status_code == 200
    assert r.headers["content-type"].startswith("text/plain")
    text = r.text
    for name in (
        "mlxtrio_active_sequences",
        "mlxtrio_queued_requests",
        "mlxtrio_generated_tokens_total",
        "mlxtrio_prompt_tokens_total",
        "mlxtrio_requests_total",
    ):
        assert name in text, name
    assert 'mlxtrio_requests_total{method="GET",route="/health",status="200"} 1.0' in text


async def test_unknown_route_is_json_404(server: Server) -> None:
    async with server.client() as client:
        r = await client.get("/v1/nothing-here")
    assert r.status_code == 404
    assert r.json()["error"]["type"] == "not_found_error"
    assert "GET /v1/nothing-here" in r.json()["error"]["message"]


async def test_unknown_anthropic_route_uses_anthropic_envelope(server: Server) -> None:
    async with server.client() as client:
        r = await client.get("/v1/messages/nothing")
    assert r.status_code == 404
    assert r.json() == {
        "type": "error",
        "error": {
            "type": "not_found_error",
            "message": "No route matches GET /v1/messages/nothing",
        },
    }


async def test_wrong_method_is_json_405_with_allow(server: Server) -> None:
    async with server.client() as client:
        r = await client.get("/v1/responses")
    assert r.status_code == 405
    assert r.headers["allow"] == "POST"
    assert r.json()["error"]["type"] == "invalid_request_error"


async def test_invalid_json_is_400(server: Server) -> None:
    async with server.client() as client:
        r = await client.post(
            "/v1/responses", content=b"{not json", headers={"content-type": "application/json"}
        )
    assert r.status_code == 400
    error = r.json()["error"]
    assert error["type"] == "invalid_request_error"
    assert error["message"].startswith("Invalid JSON in request body")


async def test_body_over_limit_is_413(server_factory) -> None:
    server = await server_factory(max_body_bytes=1024)
    async with server.client() as client:
        r = await client.post("/v1/responses", json={"model": MODEL, "input": "x" * 4096})
    assert r.status_code == 413
    assert "too large" in r.json()["error"]["message"]


async def test_query_string_is_ignored_by_routing(server: Server) -> None:
    async with server.client() as client:
        r = await client.post(
            "/v1/responses?beta=true", json={"model": MODEL, "input": "hi", "max_output_tokens": 2}
        )
    assert r.status_code == 200
    assert r.json()["object"] == "response"


async def test_cors_preflight_when_every_origin_is_allowed(server_factory) -> None:
    server = await server_factory(cors_origins="*")
    async with server.client() as client:
        r = await client.options(
            "/v1/responses",
            headers={"Origin": "http://example.test", "Access-Control-Request-Method": "POST"},
        )
        plain = await client.get("/health")
    assert r.status_code == 204
    assert r.headers["access-control-allow-origin"] == "http://example.test"
    assert "POST" in r.headers["access-control-allow-methods"]
    assert "x-api-key" in r.headers["access-control-allow-headers"]
    assert "access-control-allow-origin" not in plain.headers  # no Origin, no CORS


async def test_api_key_checks(server_factory) -> None:
    server = await server_factory(api_key="sekret")
    body = {"model": MODEL, "input": "hi", "max_output_tokens": 1}
    async with server.client() as client:
        missing = await client.post("/v1/responses", json=body)
        wrong = await client.post(
            "/v1/responses", json=body, headers={"Authorization": "Bearer nope"}
        )
        bearer = await client.post(
            "/v1/responses", json=body, headers={"Authorization": "Bearer sekret"}
        )
        x_key = await client.post("/v1/responses", json=body, headers={"x-api-key": "sekret"})
        # x-api-key is checked first: a wrong one fails even with a right bearer.
        both = await client.post(
            "/v1/responses",
            json=body,
            headers={"x-api-key": "nope", "Authorization": "Bearer sekret"},
        )
        anthropic = await client.post("/v1/messages?beta=true", json={})
        health = await client.get("/health")
        head = await client.head("/")
        models = await client.get("/v1/models")
    assert missing.status_code == 401
    assert missing.json()["error"]["type"] == "authentication_error"
    assert wrong.status_code == 401
    assert bearer.status_code == 200
    assert x_key.status_code == 200
    assert both.status_code == 401
    assert anthropic.status_code == 401
    assert anthropic.json()["type"] == "error"
    assert anthropic.json()["error"]["type"] == "authentication_error"
    assert health.status_code == 200
    assert head.status_code == 200
    assert models.status_code == 401


async def test_several_api_keys_each_work(server_factory) -> None:
    server = await server_factory(api_key="one,two")
    body = {"model": MODEL, "input": "hi", "max_output_tokens": 1}
    async with server.client() as client:
        statuses = [
            (await client.post("/v1/responses", json=body, headers={"x-api-key": key})).status_code
            for key in ("one", "two", "one,two", "three")
        ]
    assert statuses == [200, 200, 401, 401]


async def test_validation_errors_have_param(server: Server) -> None:
    cases = [
        ([1, 2], 400, "body"),
        ({"input": "hi"}, 400, "model"),
        ({"model": MODEL}, 400, "input"),
        ({"model": MODEL, "input": 5}, 400, "input"),
        ({"model": MODEL, "input": "hi", "max_output_tokens": 0}, 400, "max_output_tokens"),
        ({"model": MODEL, "input": "hi", "max_output_tokens": True}, 400, "max_output_tokens"),
        (
            {"model": MODEL, "input": "hi", "max_output_tokens": 2147483648},
            400,
            "max_output_tokens",
        ),
        (
            {"model": MODEL, "input": "hi", "metadata": {"retention_seconds": 5}},
            400,
            "metadata.retention_seconds",
        ),
        ({"model": MODEL, "input": "hi", "temperature": 9}, 400, "temperature"),
        ({"model": MODEL, "input": [{"type": "bogus"}]}, 400, "input.0.type"),
        ({"model": MODEL, "input": [{"role": "wizard", "content": "x"}]}, 400, "input.0.role"),
    ]
    async with server.client() as client:
        for body, status, param in cases:
            r = await client.post("/v1/responses", json=body)
            assert r.status_code == status, (body, r.text)
            error = r.json()["error"]
            assert error["type"] == "invalid_request_error", body
            assert error["param"] == param, (body, error)
            assert error["message"], body


async def test_unknown_model_is_404_naming_available_models(server: Server) -> None:
    async with server.client() as client:
        r = await client.post("/v1/responses", json={"model": "nope", "input": "hi"})
    assert r.status_code == 404
    error = r.json()["error"]
    assert error["type"] == "not_found_error"
    assert MODEL in error["message"]


async def test_alias_pattern_resolves_to_served_model(server_factory) -> None:
    server = await server_factory(aliases={"claude-*": MODEL})
    async with server.client() as client:
        r = await client.post(
            "/v1/responses",
            json={"model": "claude-haiku-4-5", "input": "hi", "max_output_tokens": 2},
        )
    assert r.status_code == 200
    assert r.json()["model"] == "claude-haiku-4-5"  # echoed verbatim


async def test_no_stack_trace_on_garbage(server: Server) -> None:
    async with server.client() as client:
        for content in (b"\xff\xfe", b"null", b'"str"', b"[]"):
            r = await client.post(
                "/v1/responses", content=content, headers={"Content-Type": "application/json"}
            )
            assert r.status_code == 400, content
            assert "Traceback" not in r.text
