"""Events waiting on a WebSocket behind the running response hold memory like bodies being received:
they count against edge.queue.max_waiting_mb, and past it the socket closes (1013, try again later)."""

from __future__ import annotations

from iop.edge.keys import EdgeKeys, Key
from iop.nats.server import EmbeddedNats
from tests.harness import deployment, deployment_running
from tests.wsclient import Closed, WsClient

YAML = """
edge: {queue: {max_waiting_mb: 1}}
models: [{alias: slow, pool: [s]}]
nodes:
  - id: n
    adapters: [{id: sim, type: mock, latency_ms: 0, tokens: 400, token_interval_ms: 20}]
    providers: [{id: s, adapter: sim, capacity: 1}]
"""
KEY = {"Authorization": "Bearer ws-key"}


async def test_websocket_events_waiting_ahead_count_against_max_waiting_mb(nats_server: EmbeddedNats) -> None:
    keys = EdgeKeys(clients=[Key("c", b"ws-key")], admins=[])
    async with deployment_running(deployment(YAML), nats_server.url, keys) as h:
        ws = await WsClient.connect(h.url, headers=KEY)
        await ws.send_json({"type": "response.create", "model": "slow", "input": "count"})
        await ws.until("response.output_text.delta")
        big = "x" * 300_000  # each far under max_body_mb; four of them over the 1 MiB budget
        for _ in range(4):
            await ws.send_json({"type": "response.create", "model": "slow", "input": big})
        closed = None
        try:
            while True:
                event = await ws.recv_json()
                assert event["type"] != "response.completed", "the socket held 1.2 MB past max_waiting_mb"
        except Closed as exc:
            closed = exc
        await ws.close()
        assert closed.code == 1013 and "max_waiting_mb" in closed.reason
        assert h.edge.bodies.bytes == 0  # what the socket held is given back
