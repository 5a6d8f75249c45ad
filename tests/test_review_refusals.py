"""Refusals made before any endpoint runs (the Host and Origin checks, a bad x-request-id) answer in the
shape of the API called: Anthropic's on `/v1/messages*`, OpenAI's elsewhere."""

from __future__ import annotations

import httpx
import pytest

from iop.nats.server import EmbeddedNats
from tests.fakes import fake_upstream
from tests.harness import deployment, deployment_running

KEY = "sk-review-key-0123456789"
YAML = """
edge: {{api_keys_env: IOP_TEST_KEYS}}
models: [{{alias: m, pool: [p]}}]
nodes:
  - id: n
    adapters: [{{id: up, type: openai, base_url: "{url}", api: chat}}]
    providers: [{{id: p, adapter: up, model: served-model, capacity: 1}}]
"""
MESSAGE = {"model": "m", "max_tokens": 8, "messages": [{"role": "user", "content": "hi"}]}
REFUSALS = [
    ({"origin": "http://evil.test"}, 403, "permission_error"),
    ({"host": "evil.test"}, 403, "permission_error"),
    ({"x-request-id": "not an id!"}, 400, "invalid_request_error"),
]


async def test_refusals_before_the_endpoint_are_anthropic_errors_on_messages_paths(
    nats_server: EmbeddedNats, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("IOP_TEST_KEYS", KEY)
    async with (
        fake_upstream(api="chat") as up,
        deployment_running(deployment(YAML.format(url=up.url)), nats_server.url) as h,
        httpx.AsyncClient(base_url=h.url) as http,
    ):
        for headers, status, kind in REFUSALS:
            for path in ("/v1/messages", "/v1/messages?beta=true", "/v1/messages/count_tokens"):
                r = await http.post(path, json=MESSAGE, headers={"x-api-key": KEY, **headers})
                assert r.status_code == status, (path, headers, r.text)
                body = r.json()
                assert body["type"] == "error" and body["error"]["type"] == kind, (path, headers, body)
                assert body["error"]["message"] and body["request_id"] == r.headers["x-request-id"]
            # Everywhere else the same refusal is OpenAI's.
            r = await http.post("/v1/chat/completions", json=MESSAGE, headers={"x-api-key": KEY, **headers})
            assert r.status_code == status and "type" not in r.json() and r.json()["error"]["message"], r.text
        assert up.total == 0
