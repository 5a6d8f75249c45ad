"""Another client key reaches none of a key's stored responses, by any path: read, stream, input_items,
cancel, delete, continue (previous_response_id, item_reference), over HTTP or a WebSocket."""

from __future__ import annotations

import httpx
import pytest

from iop.nats.server import EmbeddedNats
from tests.fakes import fake_upstream
from tests.harness import deployment, deployment_running
from tests.wsclient import WsClient

KEY_A = "sk-owner-a-0123456789"
KEY_B = "sk-owner-b-0123456789"
YAML = """
edge: {{api_keys_env: IOP_TEST_KEYS}}
models: [{{alias: m, pool: [p]}}]
nodes:
  - id: n
    adapters: [{{id: up, type: openai, base_url: "{url}", api: chat}}]
    providers: [{{id: p, adapter: up, model: served-model, capacity: 2}}]
"""


def auth(key: str) -> dict[str, str]:
    return {"authorization": f"Bearer {key}"}


async def test_responses_another_key_reaches_nothing_over_http_or_a_websocket(
    nats_server: EmbeddedNats, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("IOP_TEST_KEYS", f"a:{KEY_A}, b:{KEY_B}")
    async with (
        fake_upstream(api="chat") as up,
        deployment_running(deployment(YAML.format(url=up.url)), nats_server.url) as h,
        httpx.AsyncClient(base_url=h.url, timeout=30) as http,
    ):
        first = (await http.post("/v1/responses", json={"model": "m", "input": "a's"}, headers=auth(KEY_A))).json()
        rid, item = first["id"], first["output"][0]["id"]
        for method, path in [
            ("GET", f"/v1/responses/{rid}"),
            ("GET", f"/v1/responses/{rid}?stream=true"),
            ("GET", f"/v1/responses/{rid}/input_items"),
            ("POST", f"/v1/responses/{rid}/cancel"),
            ("DELETE", f"/v1/responses/{rid}"),
        ]:
            r = await http.request(method, path, headers=auth(KEY_B))
            assert r.status_code == 404 and r.json()["error"]["code"] == "not_found", (method, path, r.text)
        calls = up.total
        r = await http.post(
            "/v1/responses", json={"model": "m", "input": "x", "previous_response_id": rid}, headers=auth(KEY_B)
        )
        assert r.status_code == 400 and r.json()["error"]["code"] == "previous_response_not_found"
        ref = [{"type": "item_reference", "id": item}]
        r = await http.post("/v1/responses", json={"model": "m", "input": ref}, headers=auth(KEY_B))
        assert r.status_code == 404 and r.json()["error"]["code"] == "item_not_found"
        ws = await WsClient.connect(h.url, headers=auth(KEY_B))
        try:
            await ws.send_json({"type": "response.create", "model": "m", "input": "x", "previous_response_id": rid})
            event = await ws.recv_json()
            assert event["type"] == "error" and event["error"]["code"] == "previous_response_not_found"
            await ws.send_json({"type": "response.create", "model": "m", "input": ref})
            event = await ws.recv_json()
            assert event["type"] == "error" and event["error"]["code"] == "item_not_found"
        finally:
            await ws.close()
        assert up.total == calls  # nothing of b's reached the model
        # a's response is whole after all of that.
        r = await http.get(f"/v1/responses/{rid}", headers=auth(KEY_A))
        assert r.status_code == 200 and r.json()["output"] == first["output"]
