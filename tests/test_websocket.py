"""WebSocket mode of `/v1/responses` on the uvicorn server `iop edge` runs, to a chat-only server (issue 25)."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from typing import Any

import httpx

from iop import config
from iop.edge.keys import EdgeKeys, Key
from iop.edge.ledger import RequestRecord
from iop.edge.root import Edge
from iop.edge.usage_query import follow
from iop.nats.server import EmbeddedNats
from iop.openai.compaction import COMPACTION_PROMPT
from tests.codex_upstream import Call, ScriptedChat, Turn, scripted_chat
from tests.harness import deployment, deployment_running, until
from tests.wsclient import Closed, Refused, WsClient

YAML = """
edge:
  max_body_mb: 0.05
  http: {{max_connections: 16, max_headers: 50}}
models: [{{alias: m, pool: [p]}}, {{alias: slow, pool: [s]}}]
nodes:
  - id: n
    adapters:
      - {{id: up, type: openai, base_url: "{url}", api: chat}}
      - {{id: sim, type: mock, latency_ms: 0, tokens: 400, token_interval_ms: 20}}
    providers: [{{id: p, adapter: up, model: served-model, capacity: 1}}, {{id: s, adapter: sim, capacity: 1}}]
"""
KEY = {"Authorization": "Bearer ws-key"}


@dataclass
class Served:
    url: str
    edge: Edge
    up: ScriptedChat
    results: list[RequestRecord] = field(default_factory=list)
    """The ledger's records of the requests that ended (read where operators read them)."""
    finished: asyncio.Event = field(default_factory=asyncio.Event)

    async def socket(self, headers: dict[str, str] | None = None) -> WsClient:
        return await WsClient.connect(self.url, headers={**KEY, **(headers or {})})


@asynccontextmanager
async def edge_with_sockets(nats_url: str, turns: list[Turn]) -> AsyncIterator[Served]:
    """A real edge on the server `iop edge` runs (its protocol classes, its limits), with a key, and its node."""
    keys = EdgeKeys(clients=[Key("c", b"ws-key")], admins=[])
    async with (
        scripted_chat(turns) as up,
        deployment_running(deployment(YAML.format(url=up.url)), nats_url, keys) as h,
    ):
        served = Served(h.url, h.edge, up)

        def written(records: list[RequestRecord]) -> None:
            served.results.extend(records)
            served.finished.set()

        sub = await follow(h.edge.js, None, written)
        try:
            yield served
        finally:
            await sub.unsubscribe()


def _dep(up: ScriptedChat) -> config.Deployment:
    return deployment(YAML.format(url=up.url))


def user(text: str) -> dict[str, Any]:
    return {"type": "message", "role": "user", "content": [{"type": "input_text", "text": text}]}


TOOLS = [{"type": "function", "name": "exec_command", "parameters": {"type": "object", "properties": {}}}]
ENDS = ("response.completed", "response.failed", "response.incomplete", "error")


async def test_websocket_runs_responses_in_turn_and_continues_with_only_the_new_input(
    nats_server: EmbeddedNats,
) -> None:
    turns = [Turn(calls=[Call("exec_command", {"cmd": "ls"}, "call_ws1")]), Turn(text="Two files.")]
    async with edge_with_sockets(nats_server.url, turns) as s:
        ws = await s.socket({"OpenAI-Beta": "responses_websockets=2026-02-06"})
        # Codex's warm-up first: answered at once, and the next turn continues from it.
        await ws.send_json({"type": "response.create", "model": "m", "input": [], "generate": False, "store": False})
        warm = await ws.until(*ENDS)
        assert [e["type"] for e in warm] == ["response.created", "response.in_progress", "response.completed"]
        base = {"type": "response.create", "model": "m", "tools": TOOLS, "store": False}
        first = {**base, "previous_response_id": warm[-1]["response"]["id"], "input": [user("list the files")]}
        await ws.send_json(first)
        one = await ws.until(*ENDS)
        assert one[-1]["type"] == "response.completed", one[-1]
        assert [o["type"] for o in one[-1]["response"]["output"]] == ["function_call"]
        assert all(isinstance(e.get("sequence_number"), int) for e in one)
        output = {"type": "function_call_output", "call_id": "call_ws1", "output": "README.md\nsetup.py"}
        await ws.send_json({**base, "previous_response_id": one[-1]["response"]["id"], "input": [output]})
        two = await ws.until(*ENDS)
        assert two[-1]["type"] == "response.completed", two[-1]
        assert two[-1]["response"]["output"][0]["content"][0]["text"] == "Two files."

        # An older response of this socket is gone; a new socket knows none of them.
        await ws.send_json({**base, "previous_response_id": one[-1]["response"]["id"], "input": [output]})
        old = await ws.recv_json()
        again = await s.socket()
        await again.send_json({**base, "previous_response_id": two[-1]["response"]["id"], "input": [user("and?")]})
        new = await again.recv_json()
        await ws.close()
        await again.close()
    assert len(s.up.bodies) == 2
    # The second turn reached the model whole: the user's message, the call, and its output.
    messages = s.up.bodies[1]["messages"]
    assert messages[0] == {"role": "user", "content": "list the files"}
    assert messages[1]["tool_calls"][0]["id"] == "call_ws1"
    assert messages[2] == {"role": "tool", "tool_call_id": "call_ws1", "content": "README.md\nsetup.py"}
    assert (old["type"], old["status"], old["error"]["code"]) == ("error", 400, "previous_response_not_found")
    assert (new["type"], new["status"], new["error"]["code"]) == ("error", 400, "previous_response_not_found")


async def test_websocket_refused_events_answer_error_frames_and_the_socket_stays_open(
    nats_server: EmbeddedNats,
) -> None:
    async with edge_with_sockets(nats_server.url, [Turn(text="still here")]) as s:
        ws = await s.socket()
        await ws.send_json({"type": "response.cancel"})
        wrong_type = await ws.recv_json()
        await ws.send_text("{not json")
        not_json = await ws.recv_json()
        await ws.send_json({"type": "response.create", "model": "nope", "input": "hi"})
        unknown = await ws.recv_json()
        await ws.send_json({"type": "response.create", "model": "m", "input": "hi"})
        fine = await ws.until(*ENDS)
        await ws.close()
    assert (wrong_type["type"], wrong_type["error"]["code"]) == ("error", "invalid_event")
    assert (not_json["status"], not_json["error"]["code"]) == (400, "invalid_json")
    assert (unknown["status"], unknown["error"]["param"]) == (404, "model")
    assert fine[-1]["type"] == "response.completed"
    assert fine[-1]["response"]["output"][0]["content"][0]["text"] == "still here"


async def test_websocket_handshakes_are_refused_with_http_answers(nats_server: EmbeddedNats) -> None:
    async with edge_with_sockets(nats_server.url, []) as s:
        refusals: dict[str, Refused] = {}
        for name, path, headers in [
            ("no key", "/v1/responses", {"Authorization": "Bearer wrong"}),
            ("other site", "/v1/responses", {**KEY, "Origin": "https://evil.example"}),
            ("post only", "/v1/chat/completions", KEY),
            ("no socket there", "/status", KEY),
        ]:
            try:
                await WsClient.connect(s.url, path, headers)
            except Refused as refused:
                refusals[name] = refused
        async with httpx.AsyncClient(base_url=s.url) as http:
            plain_get = await http.get("/v1/responses", headers=KEY)
    assert refusals["no key"].status == 401 and refusals["no key"].json()["error"]["code"] == "invalid_api_key"
    assert refusals["other site"].status == 403 and refusals["other site"].json()["error"]["code"] == "cross_origin"
    assert refusals["post only"].status == 405 and refusals["post only"].headers["allow"] == "POST"
    assert refusals["no socket there"].status == 404
    assert plain_get.status_code == 405 and plain_get.headers["allow"] == "POST"
    assert s.up.bodies == []


async def test_websocket_closed_mid_response_cancels_it_and_frees_the_slot(nats_server: EmbeddedNats) -> None:
    async with edge_with_sockets(nats_server.url, []) as s:
        limits = s.edge.http_limits
        ws = await s.socket()
        assert limits.open == 1
        await ws.send_json({"type": "response.create", "model": "slow", "input": "count to 400"})
        await ws.until("response.output_text.delta")
        provider = s.edge.scheduler.providers["s"]
        assert provider.in_flight == 1
        ws.writer.close()  # the client goes away mid-stream
        await until(lambda: bool(s.results), s.finished, timeout_s=10)
        await until(lambda: provider.in_flight == 0, s.edge.scheduler.changed, timeout_s=10)
        # The upgraded connection is counted until it closes, like any other.
        await until(lambda: limits.open == 0, limits.closed, timeout_s=10)
    assert (s.results[0].alias, s.results[0].error) == ("slow", "client_cancelled")


async def test_websocket_compaction_trigger_answers_one_compaction_item(nats_server: EmbeddedNats) -> None:
    async with edge_with_sockets(nats_server.url, [Turn(text="Summary of the work.")]) as s:
        ws = await s.socket()
        window = [user("list the files"), {"type": "compaction_trigger"}]
        await ws.send_json({"type": "response.create", "model": "m", "input": window, "tools": TOOLS})
        events = await ws.until(*ENDS)
        await ws.close()
    assert events[-1]["type"] == "response.completed"
    assert [o["type"] for o in events[-1]["response"]["output"]] == ["compaction"]
    assert s.up.bodies[0]["messages"][-1]["content"] == COMPACTION_PROMPT


async def test_websocket_too_many_events_ahead_close_the_socket(nats_server: EmbeddedNats) -> None:
    async with edge_with_sockets(nats_server.url, []) as s:
        ws = await s.socket()
        await ws.send_json({"type": "response.create", "model": "slow", "input": "count"})
        await ws.until("response.output_text.delta")
        for _ in range(40):
            await ws.send_json({"type": "response.create", "model": "slow", "input": "more"})
        closed = None
        try:
            while True:
                await ws.recv_json()
        except Closed as exc:
            closed = exc
        await ws.close()
        await until(lambda: bool(s.results), s.finished, timeout_s=10)
    assert closed is not None and closed.code == 1008
    assert s.results[0].error == "client_cancelled"


async def test_websocket_limits_hold_for_the_handshake_and_each_event(nats_server: EmbeddedNats) -> None:
    async with edge_with_sockets(nats_server.url, []) as s:
        crowded = {**KEY, **{f"x-h{i}": "v" for i in range(60)}}
        try:
            await WsClient.connect(s.url, headers=crowded)
            raise AssertionError("a handshake with 60 headers was accepted")
        except Refused as refused:
            too_many = refused
        ws = await s.socket()
        await ws.send_json({"type": "response.create", "model": "m", "input": "x" * 80_000})
        closed = None
        try:
            await ws.recv_json()
        except Closed as exc:
            closed = exc
        await ws.close()
        upgraded = s.edge.http_limits.upgraded
    # Too many headers: refused by the edge's HTTP protocol before any upgrade.
    assert too_many.status == 431 and upgraded == 1
    # An event larger than a request body may be (edge.max_body_mb) closes the socket: 1009, too big.
    assert closed is not None and closed.code == 1009
    assert s.up.bodies == []
