"""`POST /v1/responses/compact` over upstreams that serve Responses themselves: passed through as it
came (its stored state expanded by the edge), and their own compaction items accepted back; over a
pool with a chat-only member the edge compacts itself (issue 25)."""

from __future__ import annotations

from typing import Any

from iop.nats.server import EmbeddedNats
from tests.fakes import fake_upstream
from tests.harness import deployment, deployment_running

YAML = """
models: [{{alias: native, pool: [p-resp]}}, {{alias: chat, pool: [p-chat]}}, {{alias: mixed, pool: [p-chat, p-resp]}}]
nodes:
  - id: n
    adapters:
      - {{id: chat, type: openai, base_url: "{chat}", api: chat}}
      - {{id: resp, type: openai, base_url: "{resp}", api: responses}}
    providers:
      - {{id: p-chat, adapter: chat, model: chat-model, capacity: 2}}
      - {{id: p-resp, adapter: resp, model: resp-model, capacity: 2}}
"""


def user(text: str) -> dict[str, Any]:
    return {"type": "message", "role": "user", "content": [{"type": "input_text", "text": text}]}


async def test_compact_native_passes_through_to_responses_upstreams_and_not_to_mixed_pools(
    nats_server: EmbeddedNats,
) -> None:
    async with (
        fake_upstream(api="chat") as chat,
        fake_upstream(api="responses") as resp,
        deployment_running(deployment(YAML.format(chat=chat.url, resp=resp.url)), nats_server.url) as h,
        h.http() as http,
    ):
        first = await http.post("/v1/responses", json={"model": "native", "input": "the long start"})
        assert first.status_code == 200, first.text
        window = {"model": "native", "input": [user("more")], "previous_response_id": first.json()["id"]}
        compacted = await http.post("/v1/responses/compact", json=window)
        assert compacted.status_code == 200, compacted.text
        item = compacted.json()["output"][0]
        # The upstream's own item comes back to a Responses pool untouched; a chat pool cannot read it.
        back = await http.post("/v1/responses", json={"model": "native", "input": [item, user("go on")]})
        refused = await http.post("/v1/responses", json={"model": "chat", "input": [item, user("go on")]})
        mixed = await http.post("/v1/responses/compact", json={"model": "mixed", "input": [user("hello")]})
    assert compacted.json()["object"] == "response.compaction"
    assert item == {"type": "compaction", "id": "cmp_upstream", "encrypted_content": "upstream-sealed"}
    assert resp.by_path["/v1/responses/compact"] == 1
    sent = resp.bodies[1]
    assert sent["model"] == "resp-model"
    # The edge expanded the stored chain: the upstream keeps nothing and gets no id to look up.
    assert "previous_response_id" not in sent and "store" not in sent
    texts = [i["content"] if isinstance(i["content"], str) else i["content"][0]["text"] for i in sent["input"]]
    assert texts == ["the long start", resp.text(), "more"]
    assert back.status_code == 200, back.text
    assert resp.bodies[2]["input"][0] == item
    assert refused.status_code == 400 and refused.json()["error"]["code"] == "invalid_encrypted_content"
    # A pool with a chat-only member: the edge compacted (one iop item, summarised by a member).
    assert mixed.status_code == 200, mixed.text
    assert mixed.json()["output"][-1]["encrypted_content"].startswith("iop2.")
    assert resp.by_path["/v1/responses/compact"] == 1
