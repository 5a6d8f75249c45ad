"""Stored responses: `store: true` keeps a response in JetStream, `previous_response_id` and
`item_reference` are expanded by the edge for any upstream, `/v1/responses/{id}` reads, replays,
lists and deletes, and only the client key that stored a response ever reaches it."""

from __future__ import annotations

import asyncio
import json
from typing import Any

import httpx
import pytest

from iop.nats import connection
from iop.nats.server import EmbeddedNats
from iop.responses.records import Stored
from iop.responses.store import ResponseStore
from tests.fakes import fake_upstream
from tests.harness import deployment, deployment_running, running_edge, running_node, sse_events

KEY_A = "sk-client-a-0123456789"
KEY_B = "sk-client-b-0123456789"
ADMIN = "sk-admin-0123456789"


def one_provider(url: str, api: str, edge: str = "") -> str:
    return f"""
edge: {{api_keys_env: IOP_TEST_KEYS, admin_keys_env: IOP_TEST_ADMIN_KEYS{edge}}}
models: [{{alias: m, pool: [p]}}]
nodes:
  - id: n
    adapters: [{{id: up, type: openai, base_url: "{url}", api: {api}}}]
    providers: [{{id: p, adapter: up, model: served-model, capacity: 2}}]
"""


MIXED = """
edge: {{api_keys_env: IOP_TEST_KEYS, admin_keys_env: IOP_TEST_ADMIN_KEYS}}
models: [{{alias: chat, pool: [p-chat]}}, {{alias: resp, pool: [p-resp]}}, {{alias: m, pool: [p-chat, p-resp]}}]
nodes:
  - id: n
    adapters:
      - {{id: chat, type: openai, base_url: "{chat}", api: chat}}
      - {{id: resp, type: openai, base_url: "{resp}", api: responses}}
    providers:
      - {{id: p-chat, adapter: chat, model: served-model, capacity: 1}}
      - {{id: p-resp, adapter: resp, model: served-model, capacity: 1}}
"""


@pytest.fixture(autouse=True)
def keys(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("IOP_TEST_KEYS", f"a:{KEY_A}, b:{KEY_B}")
    monkeypatch.setenv("IOP_TEST_ADMIN_KEYS", f"ops:{ADMIN}")


def auth(key: str) -> dict[str, str]:
    return {"authorization": f"Bearer {key}"}


async def create(http: httpx.AsyncClient, key: str = KEY_A, **body: Any) -> httpx.Response:
    return await http.post("/v1/responses", json={"model": "m", **body}, headers=auth(key))


def chat_messages(body: dict[str, Any]) -> list[tuple[str, str]]:
    return [(m["role"], m.get("content") or "") for m in body["messages"]]


async def test_responses_store_previous_response_id_carries_the_chain_to_a_chat_only_upstream(
    nats_server: EmbeddedNats,
) -> None:
    async with (
        fake_upstream(api="chat") as up,
        deployment_running(deployment(one_provider(up.url, "chat")), nats_server.url) as h,
        h.http() as http,
    ):
        first = (await create(http, input="hi", instructions="first rules")).json()
        assert first["store"] is True and first["previous_response_id"] is None
        second = await create(http, input="more", instructions="second rules", previous_response_id=first["id"])
        assert second.status_code == 200, second.text
        assert second.json()["previous_response_id"] == first["id"]
        last = [{"role": "user", "content": "last"}]
        third = await create(http, input=last, previous_response_id=second.json()["id"])
        assert third.status_code == 200, third.text
    # The whole chain reached the model; only the request's own instructions (none on the third).
    assert chat_messages(up.bodies[1]) == [
        ("system", "second rules"),
        ("user", "hi"),
        ("assistant", "w0 w1 w2"),
        ("user", "more"),
    ]
    assert chat_messages(up.bodies[2]) == [
        ("user", "hi"),
        ("assistant", "w0 w1 w2"),
        ("user", "more"),
        ("assistant", "w0 w1 w2"),
        ("user", "last"),
    ]


async def test_responses_store_streamed_answer_is_kept_and_echoes_its_state(nats_server: EmbeddedNats) -> None:
    async with (
        fake_upstream(api="chat") as up,
        deployment_running(deployment(one_provider(up.url, "chat")), nats_server.url) as h,
        h.http() as http,
    ):
        r = await create(http, input="hi", stream=True)
        events = sse_events(r.text)
        lifecycle = [e["response"] for e in events if "response" in e]
        assert all(resp["store"] is True for resp in lifecycle)
        final = lifecycle[-1]
        follow = await create(http, input="more", stream=True, previous_response_id=final["id"])
        echoed = [e["response"] for e in sse_events(follow.text) if "response" in e]
        assert {resp["previous_response_id"] for resp in echoed} == {final["id"]}
        got = await http.get(f"/v1/responses/{final['id']}", headers=auth(KEY_A))
        assert got.status_code == 200 and got.json() == final
    assert chat_messages(up.bodies[1])[-2:] == [("assistant", "w0 w1 w2"), ("user", "more")]


async def test_responses_store_item_reference_and_previous_id_over_a_responses_native_upstream(
    nats_server: EmbeddedNats,
) -> None:
    async with (
        fake_upstream(api="responses") as up,
        deployment_running(deployment(one_provider(up.url, "responses")), nats_server.url) as h,
        h.http() as http,
    ):
        first = (await create(http, input="hi")).json()
        message = first["output"][0]
        reference = {"type": "item_reference", "id": message["id"]}
        r = await create(http, input=[{"role": "user", "content": "hi"}, reference])
        assert r.status_code == 200, r.text
        r = await create(http, input="more", previous_response_id=first["id"], stream=True)
        assert r.status_code == 200 and "response.completed" in r.text
    # The upstream was asked statelessly: no previous id, nothing for it to keep, the items in full.
    assert up.bodies[1]["input"] == [{"role": "user", "content": "hi"}, message]
    assert "previous_response_id" not in up.bodies[2] and up.bodies[2]["store"] is False
    assert up.bodies[2]["input"][1:] == [message, {"type": "message", "role": "user", "content": "more"}]


async def test_responses_store_the_provider_may_change_between_turns(nats_server: EmbeddedNats) -> None:
    async with fake_upstream(api="chat") as chat, fake_upstream(api="responses") as resp:
        dep = deployment(MIXED.format(chat=chat.url, resp=resp.url))
        async with deployment_running(dep, nats_server.url) as h, h.http() as http:
            previous = None
            # Turns alternate between a chat-only and a Responses provider (and then a mixed pool).
            for n, model in enumerate(["chat", "resp", "chat", "resp", "m", "m"]):
                r = await http.post(
                    "/v1/responses",
                    json={"model": model, "input": f"turn {n}", "previous_response_id": previous},
                    headers=auth(KEY_A),
                )
                assert r.status_code == 200, r.text
                previous = r.json()["id"]
    assert chat.total >= 2 and resp.total >= 2
    for body in chat.bodies:
        users = [m["content"] for m in body["messages"] if m["role"] == "user"]
        assistants = [m["content"] for m in body["messages"] if m["role"] == "assistant"]
        assert users == [f"turn {n}" for n in range(len(users))] and len(assistants) == len(users) - 1
    for body in resp.bodies:
        users = [i["content"] for i in body["input"] if i.get("role") == "user"]
        assert users == [f"turn {n}" for n in range(len(users))]


async def test_responses_store_another_key_finds_nothing(nats_server: EmbeddedNats) -> None:
    async with (
        fake_upstream(api="chat") as up,
        deployment_running(deployment(one_provider(up.url, "chat")), nats_server.url) as h,
        h.http() as http,
    ):
        mine = (await create(http, input="secret")).json()
        item = mine["output"][0]["id"]
        path = f"/v1/responses/{mine['id']}"
        for request in (
            http.get(path, headers=auth(KEY_B)),
            http.get(path + "?stream=true", headers=auth(KEY_B)),
            http.get(path + "/input_items", headers=auth(KEY_B)),
            http.delete(path, headers=auth(KEY_B)),
            http.post(path + "/cancel", headers=auth(KEY_B)),
        ):
            r = await request
            assert r.status_code == 404, r.text
            assert r.json()["error"]["code"] == "not_found"
        r = await create(http, KEY_B, input="x", previous_response_id=mine["id"])
        assert r.status_code == 400 and r.json()["error"]["code"] == "previous_response_not_found"
        r = await create(http, KEY_B, input=[{"type": "item_reference", "id": item}])
        assert r.status_code == 404 and r.json()["error"]["param"] == "input[0]"
        assert (await http.get(path)).status_code == 401  # no key at all: not even told it is unknown
        assert (await http.get(path, headers=auth(KEY_A))).status_code == 200  # still there, still mine
    assert len(up.bodies) == 1


async def test_responses_store_read_replay_list_and_delete(nats_server: EmbeddedNats) -> None:
    async with (
        fake_upstream(api="chat") as up,
        deployment_running(deployment(one_provider(up.url, "chat")), nats_server.url) as h,
        h.http() as http,
    ):
        inputs = [{"role": "user", "content": f"q{n}"} for n in range(3)]
        made = (await create(http, input=inputs)).json()
        path = f"/v1/responses/{made['id']}"
        events = sse_events((await http.get(path + "?stream=true", headers=auth(KEY_A))).text)
        assert [e["sequence_number"] for e in events] == list(range(len(events)))
        assert events[-1]["type"] == "response.completed" and events[-1]["response"] == made
        delta = "".join(e["delta"] for e in events if e["type"] == "response.output_text.delta")
        assert delta == "w0 w1 w2"
        later = sse_events((await http.get(path + "?stream=true&starting_after=3", headers=auth(KEY_A))).text)
        assert later == events[4:]
        listed = (await http.get(path + "/input_items?order=asc&limit=2", headers=auth(KEY_A))).json()
        assert [i["content"] for i in listed["data"]] == ["q0", "q1"] and listed["has_more"] is True
        rest = await http.get(path + f"/input_items?order=asc&after={listed['last_id']}", headers=auth(KEY_A))
        assert [i["content"] for i in rest.json()["data"]] == ["q2"] and rest.json()["has_more"] is False
        r = await http.post(path + "/cancel", headers=auth(KEY_A))
        assert r.status_code == 400 and r.json()["error"]["param"] == "response_id"
        r = await http.delete(path, headers=auth(KEY_A))
        assert r.json() == {"id": made["id"], "object": "response", "deleted": True}
        assert (await http.get(path, headers=auth(KEY_A))).status_code == 404
        item = made["output"][0]["id"]
        r = await create(http, input=[{"type": "item_reference", "id": item}])
        assert r.status_code == 404  # its items went with it


async def test_responses_store_an_admin_key_may_read_and_delete_any(nats_server: EmbeddedNats) -> None:
    async with (
        fake_upstream(api="chat") as up,
        deployment_running(deployment(one_provider(up.url, "chat")), nats_server.url) as h,
        h.http() as http,
    ):
        made = (await create(http, input="hi")).json()
        other = (await create(http, KEY_B, input="hi")).json()
        path = f"/v1/responses/{made['id']}"
        listed = (await http.get("/admin/responses", headers=auth(ADMIN))).json()
        assert {r["id"] for r in listed["data"]} == {made["id"], other["id"]} and listed["has_more"] is False
        owner = next(r["owner"] for r in listed["data"] if r["id"] == made["id"])
        assert KEY_A not in owner  # an id of the key, never the key
        mine = (await http.get(f"/admin/responses?owner={owner}&limit=1", headers=auth(ADMIN))).json()
        assert [r["id"] for r in mine["data"]] == [made["id"]]
        assert (await http.get("/admin/responses", headers=auth(KEY_A))).status_code == 403
        assert (await http.get(path, headers=auth(ADMIN))).json()["id"] == made["id"]
        assert (await http.delete(path, headers=auth(ADMIN))).json()["deleted"] is True
        assert (await http.get(path, headers=auth(KEY_A))).status_code == 404
        assert (await http.get(path, headers=auth(ADMIN))).status_code == 404


async def test_responses_store_survives_an_edge_restart_and_serves_every_edge(nats_server: EmbeddedNats) -> None:
    async with fake_upstream(api="chat") as up:
        dep = deployment(one_provider(up.url, "chat"))
        async with running_node(dep, "n", nats_server.url):
            async with running_edge(dep, nats_server.url) as first, first.http() as http:
                await first.edge.registry.wait_connected(["n"], timeout_s=10)
                made = (await create(http, input="hi")).json()
            # The first edge is gone; a new one (and any other) reads and continues the chain.
            async with running_edge(dep, nats_server.url) as second, second.http() as http:
                await second.edge.registry.wait_connected(["n"], timeout_s=10)
                got = await http.get(f"/v1/responses/{made['id']}", headers=auth(KEY_A))
                assert got.json() == made
                r = await create(http, input="more", previous_response_id=made["id"])
                assert r.status_code == 200, r.text
    assert chat_messages(up.bodies[1]) == [("user", "hi"), ("assistant", "w0 w1 w2"), ("user", "more")]


async def test_responses_store_off_accepts_store_and_keeps_nothing(nats_server: EmbeddedNats) -> None:
    async with (
        fake_upstream(api="chat") as up,
        deployment_running(
            deployment(one_provider(up.url, "chat", ", responses: {enabled: false}")), nats_server.url
        ) as h,
        h.http() as http,
    ):
        made = await create(http, input="hi", store=True)
        assert made.status_code == 200 and made.json()["store"] is False
        assert (await http.get(f"/v1/responses/{made.json()['id']}", headers=auth(KEY_A))).status_code == 404
        r = await create(http, input="more", previous_response_id=made.json()["id"])
        assert r.status_code == 400 and r.json()["error"]["code"] == "previous_response_not_found"
        js = h.edge.nc.jetstream()
        with pytest.raises(Exception, match="not found"):
            await js.stream_info("KV_iop_responses")


async def test_responses_store_keeps_a_response_larger_than_one_nats_message(nats_server: EmbeddedNats) -> None:
    nc = await connection.connect(nats_server.url, "test-store", wait_s=5)
    try:
        from iop import edgeconf

        store = await ResponseStore.open(nc, edgeconf.ResponsesSettings())
        store.max_value = 2048  # parts of 2 KiB, as a 1 MiB max_payload would cut a 200K-token prompt
        items = [{"type": "message", "role": "user", "content": "x" * 5000, "id": "msg_big"}]
        response = {"id": "resp_big", "object": "response", "output": []}
        assert await store.keep("o", Stored(response, items), items)
        got = await store.response("o", "resp_big")
        assert got is not None and got.input == items
        assert await store.item("o", "msg_big") == items[0]
        assert await store.response("other", "resp_big") is None
        assert await store.delete("o", "resp_big")
        assert await store.response("o", "resp_big") is None and await store.item("o", "msg_big") is None
    finally:
        await nc.close()


async def test_responses_store_an_upstream_status_of_any_shape_is_kept_and_read(nats_server: EmbeddedNats) -> None:
    """The response object is the upstream's: a status that is no string is kept, read and expanded."""
    nc = await connection.connect(nats_server.url, "test-store", wait_s=5)
    try:
        from iop import edgeconf
        from iop.responses.expand import Responses

        store = await ResponseStore.open(nc, edgeconf.ResponsesSettings())
        output = [{"type": "message", "role": "assistant", "content": "a"}]
        response = {"id": "resp_odd", "object": "response", "status": ["completed"], "output": output}
        assert await store.keep("o", Stored(response, [{"type": "message", "role": "user", "content": "q"}]), [])
        other = await ResponseStore.open(nc, edgeconf.ResponsesSettings())  # its cache empty: read and kept
        assert (await other.items("o", ["resp_odd"]))[0] is not None
        got = await other.response("o", "resp_odd")
        assert got is not None and got.response["status"] == ["completed"]
        turn = await Responses(other).expand({"model": "m", "previous_response_id": "resp_odd", "input": "go"}, "o")
        assert [i["content"] for i in json.loads(turn.encoded())["input"]] == ["q", "a", "go"]
    finally:
        await nc.close()


@pytest.mark.parametrize("bad", ["../x", "resp.a", "r*", "", "x" * 200])
async def test_responses_store_ids_that_are_not_one_key_token_are_unknown(nats_server: EmbeddedNats, bad: str) -> None:
    nc = await connection.connect(nats_server.url, "test-store", wait_s=5)
    try:
        from iop import edgeconf

        store = await ResponseStore.open(nc, edgeconf.ResponsesSettings())
        await store.keep("o", Stored({"id": "resp_1", "object": "response", "output": []}, []), [])
        assert await store.response("o", bad) is None and await store.item("o", bad) is None
        assert await store.owners_of(bad) == []
        assert await store.owners_of("resp_1") == ["o"]
    finally:
        await nc.close()


async def test_responses_store_background_answers_queued_then_keeps_the_answer(nats_server: EmbeddedNats) -> None:
    gate = asyncio.Event()
    async with (
        fake_upstream(api="chat", gate=gate) as up,
        deployment_running(deployment(one_provider(up.url, "chat")), nats_server.url) as h,
        h.http() as http,
    ):
        r = await create(http, input="hi", background=True)
        assert r.status_code == 200, r.text
        queued = r.json()
        assert (queued["status"], queued["background"], queued["store"]) == ("queued", True, True)
        await up.wait_for(lambda u: u.in_flight == 1)  # it runs while nobody waits
        path = f"/v1/responses/{queued['id']}"
        assert (await http.get(path, headers=auth(KEY_A))).json()["status"] == "queued"
        replay = asyncio.create_task(http.get(path + "?stream=true", headers=auth(KEY_A)))
        gate.set()
        events = sse_events((await replay).text)  # waited for the end, then replayed it
        final = events[-1]["response"]
        assert events[-1]["type"] == "response.completed" and final["id"] == queued["id"]
        assert final["background"] is True and final["output"][0]["content"][0]["text"] == "w0 w1 w2"
        assert (await http.get(path, headers=auth(KEY_A))).json() == final
        r = await create(http, input="more", previous_response_id=queued["id"])
        assert r.status_code == 200, r.text
        # Cancelling a finished one answers it as it is.
        assert (await http.post(path + "/cancel", headers=auth(KEY_A))).json()["status"] == "completed"
    assert chat_messages(up.bodies[1]) == [("user", "hi"), ("assistant", "w0 w1 w2"), ("user", "more")]


async def test_responses_store_background_cancel_stops_the_work_and_keeps_it_cancelled(
    nats_server: EmbeddedNats,
) -> None:
    gate = asyncio.Event()
    async with (
        fake_upstream(api="chat", gate=gate) as up,
        deployment_running(deployment(one_provider(up.url, "chat")), nats_server.url) as h,
        h.http() as http,
    ):
        queued = (await create(http, input="hi", background=True)).json()
        await up.wait_for(lambda u: u.in_flight == 1)
        path = f"/v1/responses/{queued['id']}"
        cancelled = await http.post(path + "/cancel", headers=auth(KEY_B))
        assert cancelled.status_code == 404  # not another key's to cancel
        work = h.edge.responses.running[queued["id"]]
        cancelled = await http.post(path + "/cancel", headers=auth(KEY_A))
        assert cancelled.json()["status"] == "cancelled"
        # The work ended while the upstream still held the request: it was cut, not waited for.
        await asyncio.wait_for(work, timeout=10)
        assert not gate.is_set() and queued["id"] not in h.edge.responses.running
        gate.set()
        assert (await http.get(path, headers=auth(KEY_A))).json()["status"] == "cancelled"


async def test_responses_store_background_must_be_stored(nats_server: EmbeddedNats) -> None:
    async with fake_upstream(api="chat") as up:
        cases: list[tuple[str, dict[str, Any]]] = [("", {"store": False}), (", responses: {enabled: false}", {})]
        for extra, body in cases:
            dep = deployment(one_provider(up.url, "chat", extra))
            async with deployment_running(dep, nats_server.url) as h, h.http() as http:
                r = await create(http, input="hi", background=True, **body)
                assert r.status_code == 400 and r.json()["error"]["param"] == "background"
    assert up.total == 0


async def test_responses_store_a_deleted_earlier_turn_breaks_the_chain(nats_server: EmbeddedNats) -> None:
    async with (
        fake_upstream(api="chat") as up,
        deployment_running(deployment(one_provider(up.url, "chat")), nats_server.url) as h,
        h.http() as http,
    ):
        ids: list[str] = []
        for n in range(3):
            r = await create(http, input=f"turn {n}", previous_response_id=ids[-1] if ids else None)
            ids.append(r.json()["id"])
        assert (await create(http, input="go on", previous_response_id=ids[-1])).status_code == 200
        await http.delete(f"/v1/responses/{ids[0]}", headers=auth(KEY_A))
        r = await create(http, input="go on", previous_response_id=ids[-1])
        assert r.status_code == 400 and r.json()["error"]["code"] == "previous_response_not_found"
        assert ids[0] in r.json()["error"]["message"]  # which turn is missing
    users = [m["content"] for m in up.bodies[3]["messages"] if m["role"] == "user"]
    assert users == ["turn 0", "turn 1", "turn 2", "go on"]


async def test_responses_store_unreachable_is_503_never_a_traceback(nats_server: EmbeddedNats) -> None:
    from iop import edgeconf
    from iop.errors import Unavailable

    nc = await connection.connect(nats_server.url, "test-store", wait_s=5)
    store = await ResponseStore.open(nc, edgeconf.ResponsesSettings())
    await nc.close()
    for call in (store.response("o", "resp_1"), store.item("o", "msg_1"), store.listing(10)):
        with pytest.raises(Unavailable) as refused:
            await call
        assert (refused.value.status, refused.value.code) == (503, "response_store_unavailable")


async def test_responses_store_listing_and_lookup_find_a_response_the_moment_it_is_kept(
    nats_server: EmbeddedNats,
) -> None:
    """An administrator's listing and lookup read every key there is, one just written included.

    (A read that stops at nats-py's watch marker for "nothing pending" left out, a few times in a
    hundred, a key whose message was already on its way.)"""
    nc = await connection.connect(nats_server.url, "test-store", wait_s=5)
    try:
        from iop import edgeconf

        store = await ResponseStore.open(nc, edgeconf.ResponsesSettings())
        missed = []
        for n in range(150):
            rid = f"resp_race{n}"
            await store.keep("o", Stored({"id": rid, "object": "response", "output": []}, []), [])
            found, more = await store.listing(1000, "o")
            if ("o", rid) not in found or more:
                missed.append(("listing", n))
            if await store.owners_of(rid) != ["o"]:
                missed.append(("owners_of", n))
        assert missed == []
    finally:
        await nc.close()


async def test_responses_store_listing_pages_past_deleted_keys_and_says_when_there_are_more(
    nats_server: EmbeddedNats,
) -> None:
    nc = await connection.connect(nats_server.url, "test-store", wait_s=5)
    try:
        from iop import edgeconf

        store = await ResponseStore.open(nc, edgeconf.ResponsesSettings())
        for n in range(6):
            await store.keep(
                "a" if n % 2 else "b", Stored({"id": f"resp_p{n}", "object": "response", "output": []}, []), []
            )
        assert await store.delete("b", "resp_p0") and await store.delete("a", "resp_p5")
        everything, more = await store.listing(10)
        assert (
            sorted(everything) == [("a", "resp_p1"), ("a", "resp_p3"), ("b", "resp_p2"), ("b", "resp_p4")] and not more
        )
        assert (await store.listing(4))[1] is False  # four there, four asked: no more, the deleted ones not counted
        first, more = await store.listing(3)
        assert len(first) == 3 and set(first) < set(everything) and more
        assert await store.listing(10, "a") == ([("a", "resp_p1"), ("a", "resp_p3")], False)
        assert await store.owners_of("resp_p0") == [] and await store.owners_of("resp_p4") == ["b"]
    finally:
        await nc.close()


async def test_responses_store_a_full_bucket_drops_its_oldest_turns_not_the_new_one(nats_server: EmbeddedNats) -> None:
    from nats.js import api as js_api

    from iop import edgeconf

    nc = await connection.connect(nats_server.url, "test-store", wait_s=5)
    try:
        js = nc.jetstream()
        # A bucket as an earlier iop made it (nats-py's own: a full bucket refuses every write).
        await js.create_key_value(
            js_api.KeyValueConfig(bucket="iop_responses", history=1, max_bytes=1 << 20, direct=True)
        )
        store = await ResponseStore.open(nc, edgeconf.ResponsesSettings(max_bytes=1 << 20, cache_mb=0))
        items = [{"type": "message", "role": "user", "content": "x" * 200_000}]
        for n in range(12):  # 2.4 MB into a bucket of 1 MiB
            response = {"id": f"resp_{n}", "object": "response", "output": []}
            assert await store.keep("o", Stored(response, items), [])
        assert await store.response("o", "resp_11") is not None
        assert await store.response("o", "resp_0") is None
        assert (await js.stream_info("KV_iop_responses")).config.discard == js_api.DiscardPolicy.OLD
    finally:
        await js.delete_key_value("iop_responses")
        await nc.close()
