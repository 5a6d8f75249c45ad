"""What one client key can make the edge hold: a stored conversation expanded by `previous_response_id` is
bounded like the body a stateless client sends (edge.max_body_mb), before the edge reads the whole chain."""

from __future__ import annotations

import httpx
import pytest

from iop.nats.server import EmbeddedNats
from tests.fakes import fake_upstream
from tests.harness import deployment, deployment_running

KEY = "sk-review-key-0123456789"
YAML = """
edge: {{api_keys_env: IOP_TEST_KEYS, max_body_mb: 0.25}}
models: [{{alias: m, pool: [p]}}]
nodes:
  - id: n
    adapters: [{{id: up, type: openai, base_url: "{url}", api: chat}}]
    providers: [{{id: p, adapter: up, model: served-model, capacity: 1}}]
"""
AUTH = {"authorization": f"Bearer {KEY}"}


async def test_responses_chain_larger_than_max_body_is_refused_before_it_is_dispatched(
    nats_server: EmbeddedNats, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("IOP_TEST_KEYS", KEY)
    turn = "x" * 100_000  # each turn well under the 256 KiB limit; three of them are not
    async with (
        fake_upstream(api="chat") as up,
        deployment_running(deployment(YAML.format(url=up.url)), nats_server.url) as h,
        httpx.AsyncClient(base_url=h.url, timeout=30) as http,
    ):
        previous = None
        for _ in range(2):
            r = await http.post(
                "/v1/responses", json={"model": "m", "input": turn, "previous_response_id": previous}, headers=AUTH
            )
            assert r.status_code == 200, r.text
            previous = r.json()["id"]
        calls = up.total
        for _ in range(2):  # refused at once, and again (nothing was kept of the refused turn)
            r = await http.post(
                "/v1/responses", json={"model": "m", "input": turn, "previous_response_id": previous}, headers=AUTH
            )
            assert r.status_code == 400, r.text
            error = r.json()["error"]
            assert error["code"] == "conversation_too_large" and error["param"] == "previous_response_id"
            assert "edge.max_body_mb" in error["message"]
        assert up.total == calls  # nothing reached the model
        # A short turn of the same conversation still fits.
        r = await http.post(
            "/v1/responses", json={"model": "m", "input": "short", "previous_response_id": previous}, headers=AUTH
        )
        assert r.status_code == 200, r.text


async def test_responses_background_that_is_not_a_boolean_is_refused_not_run_in_the_foreground(
    nats_server: EmbeddedNats, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("IOP_TEST_KEYS", KEY)
    async with (
        fake_upstream(api="chat") as up,
        deployment_running(deployment(YAML.format(url=up.url)), nats_server.url) as h,
        httpx.AsyncClient(base_url=h.url, timeout=30) as http,
    ):
        for value in ("yes", 1, "false"):
            r = await http.post("/v1/responses", json={"model": "m", "input": "x", "background": value}, headers=AUTH)
            assert r.status_code == 400, (value, r.text)
            assert r.json()["error"]["param"] == "background"
        assert up.total == 0
