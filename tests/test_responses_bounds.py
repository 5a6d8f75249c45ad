"""What a Responses client may hold, and whose state is whose, on two edges of one NATS with one
chat-only node: the per-key bounds of sockets and background responses, compaction items bound
to the key that made them, warm-ups and compaction answers kept like any response, and background
responses followed, resumed and cancelled from the edge that did not start them (issue 25)."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

import httpx
import pytest
import pytest_asyncio

from iop.edge.keys import EdgeKeys, Key
from iop.nats.server import EmbeddedNats
from iop.openai.compaction import COMPACTION_PROMPT, SUMMARY_PREFIX
from iop.responses import live
from tests.fakes import FakeUpstream, fake_upstream
from tests.harness import EdgeHandle, deployment, running_edge, running_node, sse_events, until
from tests.wsclient import Refused, WsClient

pytestmark = pytest.mark.asyncio(loop_scope="module")

KEY_A = "sk-bounds-a-0123456789"
KEY_B = "sk-bounds-b-0123456789"
YAML = """
edge: {{responses: {{max_sockets_per_key: 2, max_background_per_key: 1}}}}
models: [{{alias: m, pool: [p]}}]
nodes:
  - id: n
    adapters: [{{id: up, type: openai, base_url: "{url}", api: chat}}]
    providers: [{{id: p, adapter: up, model: served-model, capacity: 4}}]
"""


@dataclass
class Two:
    a: EdgeHandle
    b: EdgeHandle
    up: FakeUpstream
    gate: asyncio.Event
    """Set: the upstream answers at once; cleared by a test that needs a request to stay running."""


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def two(tmp_path_factory: pytest.TempPathFactory) -> AsyncIterator[Two]:
    server = EmbeddedNats("127.0.0.1:0", tmp_path_factory.mktemp("nats"))
    await server.start()
    gate = asyncio.Event()
    gate.set()
    keys = EdgeKeys(clients=[Key("a", KEY_A.encode()), Key("b", KEY_B.encode())], admins=[])
    try:
        async with fake_upstream(api="chat", gate=gate) as up:
            dep = deployment(YAML.format(url=up.url))
            async with (
                running_node(dep, "n", server.url),
                running_edge(dep, server.url, keys) as a,
                running_edge(dep, server.url, keys) as b,
            ):
                await a.edge.registry.wait_connected(["n"], timeout_s=10)
                await b.edge.registry.wait_connected(["n"], timeout_s=10)
                yield Two(a, b, up, gate)
    finally:
        await server.stop()


@pytest_asyncio.fixture(loop_scope="module")
async def fresh(two: Two) -> AsyncIterator[Two]:
    """`two` with the upstream's record cleared, and after the test its gate open and no background work left."""
    two.up.bodies.clear()
    try:
        yield two
    finally:
        two.gate.set()
        for h in (two.a, two.b):  # every background response ended: the next test has the whole bound
            await _no_background(h)


async def _no_background(h: EdgeHandle) -> None:
    background = h.edge.responses.caps.background
    await until(lambda: background.total() == 0, background.changed)


def auth(key: str) -> dict[str, str]:
    return {"authorization": f"Bearer {key}"}


def user(text: str) -> dict[str, Any]:
    return {"type": "message", "role": "user", "content": [{"type": "input_text", "text": text}]}


async def create(http: httpx.AsyncClient, key: str = KEY_A, **body: Any) -> httpx.Response:
    return await http.post("/v1/responses", json={"model": "m", **body}, headers=auth(key))


def metric(text: str, name: str) -> float:
    return next(float(line.rsplit(" ", 1)[1]) for line in text.splitlines() if line.startswith(name))


async def test_responses_bounds_sockets_per_key_are_refused_with_429_past_the_bound(fresh: Two) -> None:
    a = fresh.a
    first = await WsClient.connect(a.url, headers=auth(KEY_A))
    second = await WsClient.connect(a.url, headers=auth(KEY_A))
    with pytest.raises(Refused) as refused:
        await WsClient.connect(a.url, headers=auth(KEY_A))
    other_key = await WsClient.connect(a.url, headers=auth(KEY_B))  # a bound of each key, not of the edge
    other_edge = await WsClient.connect(fresh.b.url, headers=auth(KEY_A))  # and of each edge
    await first.send_json({"type": "response.create", "model": "m", "input": "hi"})
    assert (await first.until("response.completed"))[-1]["response"]["status"] == "completed"
    await first.close()
    caps = a.edge.responses.caps.sockets
    await until(lambda: caps.total() == 2, caps.changed)
    again = await WsClient.connect(a.url, headers=auth(KEY_A))  # a closed socket gives its place back
    for ws in (second, other_key, other_edge, again):
        await ws.close()
    assert refused.value.status == 429
    error = refused.value.json()["error"]
    assert (error["type"], error["code"]) == ("rate_limit_error", "too_many_websockets")
    assert "edge.responses.max_sockets_per_key" in error["message"]
    async with a.http() as http:
        metrics = (await http.get("/metrics", headers=auth(KEY_A))).text
    assert metric(metrics, 'iop_responses_refused_total{limit="websockets"}') >= 1


async def test_responses_bounds_background_per_key_is_429_until_one_ends(fresh: Two) -> None:
    fresh.gate.clear()  # the first background response stays running
    async with fresh.a.http() as http:
        queued = await create(http, input="hi", background=True)
        assert queued.status_code == 200, queued.text
        over = await create(http, input="more", background=True)
        other_key = await create(http, KEY_B, input="mine", background=True)
        assert other_key.status_code == 200, other_key.text
        work = fresh.a.edge.responses.running[queued.json()["id"]]
        fresh.gate.set()
        await asyncio.wait_for(work, timeout=10)
        again = await create(http, input="more", background=True)
        metrics = (await http.get("/metrics", headers=auth(KEY_A))).text
    assert over.status_code == 429
    assert over.json()["error"]["code"] == "too_many_background_responses"
    assert again.status_code == 200, again.text
    assert metric(metrics, 'iop_responses_refused_total{limit="background_responses"}') >= 1


async def test_responses_bounds_compaction_item_of_another_key_is_refused(fresh: Two) -> None:
    async with fresh.a.http() as http:
        made = await create(http, input=[user("list the files"), {"type": "compaction_trigger"}])
        assert made.status_code == 200, made.text
        item = made.json()["output"][0]
        replayed = await create(http, KEY_B, input=[item, user("go on")])
        own = await create(http, input=[item, user("go on")])
    assert replayed.status_code == 400
    error = replayed.json()["error"]
    assert (error["code"], error["param"]) == ("invalid_encrypted_content", "input[0].encrypted_content")
    assert own.status_code == 200, own.text
    assert fresh.up.bodies[-1]["messages"][0]["content"].startswith(SUMMARY_PREFIX)


async def test_responses_bounds_warmup_is_kept_and_continued_like_any_response(fresh: Two) -> None:
    async with fresh.a.http() as http:
        warm = await create(http, input=[user("first")], generate=False)
        assert warm.status_code == 200, warm.text
        assert fresh.up.bodies == []  # no generation
        warmed = warm.json()
        assert warmed["store"] is True
        unkept = await create(http, input="x", generate=False, store=False)
    async with fresh.b.http() as http:  # kept where every edge reads
        got = await http.get(f"/v1/responses/{warmed['id']}", headers=auth(KEY_A))
        other = await http.get(f"/v1/responses/{warmed['id']}", headers=auth(KEY_B))
        gone = await http.get(f"/v1/responses/{unkept.json()['id']}", headers=auth(KEY_A))
        follow = await create(http, input=[user("second")], previous_response_id=warmed["id"])
    assert got.status_code == 200 and got.json() == warmed
    assert (other.status_code, gone.status_code) == (404, 404)
    assert follow.status_code == 200, follow.text
    assert [m["content"] for m in fresh.up.bodies[0]["messages"]] == ["first", "second"]


async def test_responses_bounds_compaction_answer_is_kept_and_continues_from_the_summary(fresh: Two) -> None:
    async with fresh.a.http() as http:
        first = await create(http, input="the long start")
        trigger = [user("more"), {"type": "compaction_trigger"}]
        compacted = await create(http, input=trigger, previous_response_id=first.json()["id"])
        assert compacted.status_code == 200, compacted.text
        made = compacted.json()
        got = await http.get(f"/v1/responses/{made['id']}", headers=auth(KEY_A))
        follow = await create(http, input="next", previous_response_id=made["id"])
        assert follow.status_code == 200, follow.text
    assert got.json() == made and made["store"] is True
    assert [o["type"] for o in made["output"]] == ["compaction"]
    summarised = fresh.up.bodies[1]["messages"]
    assert summarised[0]["content"] == "the long start" and summarised[-1]["content"] == COMPACTION_PROMPT
    # The turn after the compaction reads its summary and the new input, not the window it replaced.
    after = fresh.up.bodies[2]["messages"]
    assert [m["role"] for m in after] == ["user", "user"]
    assert after[0]["content"] == SUMMARY_PREFIX + fresh.up.text() and after[1]["content"] == "next"


async def test_responses_background_started_on_one_edge_is_followed_live_from_another(fresh: Two) -> None:
    fresh.up.token_interval_s = 0.3  # the answer takes about a second: long enough to follow it
    try:
        async with fresh.a.http() as on_a, fresh.b.http() as on_b:
            queued = (await create(on_a, input="hi", background=True)).json()
            path = f"/v1/responses/{queued['id']}"
            followed: list[dict[str, Any]] = []
            running_at_first_delta: bool | None = None
            async with on_b.stream("GET", path + "?stream=true", headers=auth(KEY_A)) as stream:
                async for line in stream.aiter_lines():
                    if not line.startswith("data: "):
                        continue
                    followed.append(json.loads(line[6:]))
                    if followed[-1]["type"] == "response.output_text.delta" and running_at_first_delta is None:
                        running_at_first_delta = queued["id"] in fresh.a.edge.responses.running
            resumed = sse_events((await on_b.get(path + "?stream=true&starting_after=2", headers=auth(KEY_A))).text)
            polled = (await on_b.get(path, headers=auth(KEY_A))).json()
    finally:
        fresh.up.token_interval_s = 0.0
    assert running_at_first_delta is True  # heard on B while A still ran it
    assert [e["sequence_number"] for e in followed] == list(range(len(followed)))
    assert followed[0]["type"] == "response.created" and followed[-1]["type"] == "response.completed"
    deltas = "".join(e["delta"] for e in followed if e["type"] == "response.output_text.delta")
    assert deltas.strip() == fresh.up.text(), [(e["type"], e.get("delta"), e.get("text")) for e in followed][4:]
    # Resumed after the end: the very events (and numbers) the live stream had.
    assert resumed == followed[3:]
    assert polled == followed[-1]["response"] and polled["status"] == "completed"


async def test_responses_background_cancelled_from_another_edge_stops_its_work(fresh: Two) -> None:
    fresh.gate.clear()
    async with fresh.a.http() as on_a, fresh.b.http() as on_b:
        queued = (await create(on_a, input="hi", background=True)).json()
        await fresh.up.wait_for(lambda u: u.in_flight == 1)
        work = fresh.a.edge.responses.running[queued["id"]]
        path = f"/v1/responses/{queued['id']}"
        follower = asyncio.create_task(on_b.get(path + "?stream=true", headers=auth(KEY_A)))
        cancelled = await on_b.post(path + "/cancel", headers=auth(KEY_A))
        await asyncio.wait_for(work, timeout=10)  # stopped on A while the upstream still held it
        assert not fresh.gate.is_set()
        # A follower on B ends with it (not after its quiet time: it heard the end).
        ended = sse_events((await asyncio.wait_for(follower, timeout=live.QUIET_S / 2)).text)
        polled = (await on_a.get(path, headers=auth(KEY_A))).json()
    assert cancelled.status_code == 200 and cancelled.json()["status"] == "cancelled"
    assert polled["status"] == "cancelled"
    assert all(e["type"] not in ("response.completed", "response.output_text.delta") for e in ended[:-1])
    assert not ended or ended[-1]["response"]["status"] in ("cancelled", "in_progress")


async def test_responses_websocket_continues_a_compaction_from_its_summary(fresh: Two) -> None:
    ws = await WsClient.connect(fresh.a.url, headers=auth(KEY_A))
    window = [user("the long start"), {"type": "compaction_trigger"}]
    await ws.send_json({"type": "response.create", "model": "m", "input": window, "store": False})
    compacted = (await ws.until("response.completed"))[-1]["response"]
    await ws.send_json(
        {"type": "response.create", "model": "m", "input": "next", "previous_response_id": compacted["id"]}
    )
    ended = (await ws.until("response.completed", "error"))[-1]
    await ws.close()
    assert ended["type"] == "response.completed", ended
    # The socket's last response is the compaction: the model reads its summary, not the window and trigger.
    after = fresh.up.bodies[-1]["messages"]
    assert [m["content"] for m in after] == [SUMMARY_PREFIX + fresh.up.text(), "next"]


async def test_responses_bounds_compaction_item_named_by_reference_is_opened(fresh: Two) -> None:
    async with fresh.a.http() as http:
        made = await create(http, input=[user("the long start"), {"type": "compaction_trigger"}])
        item_id = made.json()["output"][0]["id"]
        follow = await create(http, input=[{"type": "item_reference", "id": item_id}, user("next")])
        other = await create(http, KEY_B, input=[{"type": "item_reference", "id": item_id}, user("next")])
    assert follow.status_code == 200, follow.text
    assert [m["content"] for m in fresh.up.bodies[-1]["messages"]] == [SUMMARY_PREFIX + fresh.up.text(), "next"]
    assert other.status_code == 404  # another key's item is not there at all
