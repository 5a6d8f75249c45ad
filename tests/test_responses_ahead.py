"""A kept turn's large input is written to the store while its answer is made, under an id the edge
gives the answer; the record reads back whole, and an answer that is never kept leaves nothing."""

from __future__ import annotations

import asyncio
from typing import Any

import msgspec
import pytest

from iop import edgeconf
from iop.edge.ledger import RequestRecord
from iop.edge.usage_query import follow
from iop.errors import Unavailable
from iop.nats import connection
from iop.nats.server import EmbeddedNats
from iop.responses import records
from iop.responses.keys import bucket_keys
from iop.responses.records import Stored
from iop.responses.store import BUCKET, ResponseStore, owner_of
from tests.fakes import fake_upstream
from tests.harness import deployment, deployment_running, eventually, sse_events, until
from tests.test_responses_store import KEY_A, KEY_B, auth, one_provider
from tests.test_responses_store import keys as keys  # the fixture: the edge's key variables

# A history of 1.6 MB: past the size whose input is written ahead (AHEAD_BYTES).
HISTORY = [
    {"type": "function_call_output", "call_id": f"c{n}", "output": f"{n} " + "source line\\n\u00e9 " * 4000}
    for n in range(24)
]
AUTH = auth(KEY_A)


async def _parts(nc: Any) -> list[str]:
    """The record parts in the bucket (keys `r.<owner>.<id>.<n>`), deleted ones left out."""
    found, _ = await bucket_keys(nc, BUCKET, "r.*.*.*", 100, 5.0)
    return found


async def test_responses_ahead_input_is_stored_before_the_answer_and_read_back_whole(
    nats_server: EmbeddedNats,
) -> None:
    gate = asyncio.Event()
    async with (
        fake_upstream(api="responses", gate=gate) as up,
        deployment_running(deployment(one_provider(up.url, "responses")), nats_server.url) as h,
        h.http() as http,
    ):
        body = {"model": "m", "input": [*HISTORY, {"type": "message", "role": "user", "content": "go on"}]}
        answer = asyncio.create_task(http.post("/v1/responses", json=body, headers=AUTH, timeout=30))
        await up.wait_for(lambda u: u.in_flight == 1)
        # The model has not answered yet, and the input is already in the store, in parts.
        await eventually(lambda: _has_parts(h.edge.nc, 1))
        gate.set()
        made = (await answer).json()
        rid = made["id"]
        assert rid.startswith("resp_") and not rid.startswith("resp_fake"), rid  # the edge's, not the upstream's
        # Read through the edge (its cache joins the two halves) and from NATS alone (another edge).
        listed = await http.get(f"/v1/responses/{rid}/input_items?order=asc&limit=100", headers=AUTH)
        assert [i.get("output") for i in listed.json()["data"]][:24] == [i["output"] for i in HISTORY]
        assert (await http.get(f"/v1/responses/{rid}", headers=AUTH)).json() == made
        # Its parts are no response of anyone's, and the record is its owner's alone.
        for path in (f"/v1/responses/{rid}.1", f"/v1/responses/{rid}.1/input_items"):
            assert (await http.get(path, headers=AUTH)).status_code == 404, path
        assert (await http.get(f"/v1/responses/{rid}", headers=auth(KEY_B))).status_code == 404
        assert (await http.delete(f"/v1/responses/{rid}.1", headers=AUTH)).status_code == 404
        assert (await http.delete(f"/v1/responses/{rid}", headers=auth(KEY_B))).status_code == 404
        assert (await http.get(f"/v1/responses/{rid}", headers=AUTH)).json() == made  # nothing was removed
        nc = await connection.connect(nats_server.url, "test-reader", wait_s=5)
        try:
            store = await ResponseStore.open(nc, edgeconf.ResponsesSettings(cache_mb=0))
            stored = await store.response(owner_of(KEY_A.encode()), rid)
            assert stored is not None and stored.input == body["input"] and stored.response == made
            # A second turn, the same upstream: an answer of its own.
            again = await http.post("/v1/responses", json=body, headers=AUTH, timeout=30)
            assert again.json()["id"] != rid
            # Deleted, every part goes with it.
            assert (await http.delete(f"/v1/responses/{rid}", headers=AUTH)).status_code == 200
            assert not [k for k in await _parts(nc) if f".{rid}." in k]
        finally:
            await nc.close()


async def _has_parts(nc: Any, n: int) -> bool:
    return len(await _parts(nc)) >= n


async def test_responses_ahead_parts_of_an_answer_never_kept_are_removed(nats_server: EmbeddedNats) -> None:
    gate = asyncio.Event()
    async with (
        fake_upstream(api="responses", gate=gate) as up,
        deployment_running(deployment(one_provider(up.url, "responses")), nats_server.url) as h,
        h.http() as http,
    ):
        body = {"model": "m", "input": HISTORY, "stream": True}
        answer = asyncio.create_task(http.post("/v1/responses", json=body, headers=AUTH, timeout=30))
        await up.wait_for(lambda u: u.in_flight == 1)
        await eventually(lambda: _has_parts(h.edge.nc, 1))
        up.fail_status = 500  # the model fails: there is no answer to keep
        gate.set()
        failed = await answer
        assert failed.status_code >= 400 or "error" in failed.text
        await eventually(lambda: _no_parts(h.edge.nc))


async def _no_parts(nc: Any) -> bool:
    return not await _parts(nc)


@pytest.mark.parametrize("max_value", [2048, 1 << 20])
async def test_responses_ahead_a_record_written_in_two_reads_as_one(nats_server: EmbeddedNats, max_value: int) -> None:
    nc = await connection.connect(nats_server.url, "test-store", wait_s=5)
    try:
        store = await ResponseStore.open(nc, edgeconf.ResponsesSettings(cache_mb=0))
        store.max_value = max_value  # 2 KiB: several parts ahead and after
        items = [{"type": "message", "role": "user", "content": "x" * 5000, "id": "msg_a"}]
        ahead = await store.write_ahead("o", "resp_a", records.ahead(msgspec.json.encode(items)))
        response = {"id": "resp_a", "object": "response", "output": [{"type": "message", "id": "msg_o"}]}
        assert await store.keep("o", Stored(response, [], None, [], 7), [], ahead=ahead)
        got = await store.response("o", "resp_a")
        assert got is not None and got.input == items and got.response == response and got.size == 7
        assert await store.delete("o", "resp_a")
        assert await store.response("o", "resp_a") is None
        assert not await _parts(nc)
    finally:
        await nc.close()


@pytest.mark.parametrize("api", ["responses", "chat"])
async def test_responses_ahead_a_kept_answer_has_one_id_of_the_edges_in_every_event(
    nats_server: EmbeddedNats, api: str
) -> None:
    async with (
        fake_upstream(api=api) as up,
        deployment_running(deployment(one_provider(up.url, api)), nats_server.url) as h,
        h.http() as http,
    ):
        ids = set()
        for _ in range(2):
            r = await http.post("/v1/responses", json={"model": "m", "input": "hi", "stream": True}, headers=AUTH)
            lifecycle = [e["response"]["id"] for e in sse_events(r.text) if "response" in e]
            assert len(lifecycle) >= 2 and len(set(lifecycle)) == 1, lifecycle  # created ... completed
            ids.add(lifecycle[0])
            got = await http.get(f"/v1/responses/{lifecycle[0]}", headers=AUTH)
            assert got.status_code == 200 and got.json()["id"] == lifecycle[0]
        assert len(ids) == 2 and not any(i.startswith("resp_fake") for i in ids), ids
        whole = (await http.post("/v1/responses", json={"model": "m", "input": "hi"}, headers=AUTH)).json()
        assert whole["id"] not in ids and not whole["id"].startswith("resp_fake")
        # Not kept: the upstream's answer as it is.
        passed = await http.post("/v1/responses", json={"model": "m", "input": "hi", "store": False}, headers=AUTH)
        assert api == "chat" or passed.json()["id"].startswith("resp_fake")  # (a chat answer translated: the node's)
        assert (await http.get(f"/v1/responses/{passed.json()['id']}", headers=AUTH)).status_code == 404


async def test_responses_ahead_a_write_ahead_that_failed_leaves_the_answer_kept_whole(
    nats_server: EmbeddedNats,
) -> None:
    async with (
        fake_upstream(api="responses") as up,
        deployment_running(deployment(one_provider(up.url, "responses")), nats_server.url) as h,
        h.http() as http,
    ):
        store = h.edge.responses.store
        assert store is not None
        failed: list[str] = []

        async def unreachable(owner: str, response_id: str, pieces: list[Any]) -> Any:
            failed.append(response_id)
            raise Unavailable("NATS is not reachable")  # as the store's guard turns a lost server into

        store.write_ahead = unreachable  # type: ignore[method-assign]
        body = {"model": "m", "input": HISTORY}
        made = await http.post("/v1/responses", json=body, headers=AUTH, timeout=30)
        assert made.status_code == 200 and failed == [made.json()["id"]]
        listed = await http.get(f"/v1/responses/{made.json()['id']}/input_items?order=asc&limit=100", headers=AUTH)
        assert [i.get("output") for i in listed.json()["data"]] == [i["output"] for i in HISTORY]


async def test_responses_ahead_a_client_that_leaves_while_its_answer_is_kept_leaves_it_kept(
    nats_server: EmbeddedNats,
) -> None:
    async with (
        fake_upstream(api="responses") as up,
        deployment_running(deployment(one_provider(up.url, "responses")), nats_server.url) as h,
        h.http() as http,
    ):
        ended: list[RequestRecord] = []
        finished = asyncio.Event()

        def written(records: list[RequestRecord]) -> None:
            ended.extend(records)
            finished.set()

        sub = await follow(h.edge.js, None, written)
        store = h.edge.responses.store
        assert store is not None
        keep, entered, release = store.keep, asyncio.Event(), asyncio.Event()

        async def held(*args: Any, **kwargs: Any) -> bool:
            entered.set()
            await release.wait()
            return await keep(*args, **kwargs)

        store.keep = held  # type: ignore[method-assign]
        body = {"model": "m", "input": HISTORY, "stream": True}
        ids: list[str] = []

        async def client() -> None:
            async with http.stream("POST", "/v1/responses", json=body, headers=AUTH, timeout=30) as r:
                async for line in r.aiter_lines():
                    if line.startswith("data: ") and '"response.created"' in line:
                        ids.append(msgspec.json.decode(line[6:])["response"]["id"])

        task = asyncio.create_task(client())
        await asyncio.wait_for(entered.wait(), 10)  # the answer is whole; its record is on its way
        task.cancel()  # and the client leaves
        await asyncio.gather(task, return_exceptions=True)
        await until(lambda: bool(ended), finished, timeout_s=10)  # the edge ended the request
        assert ended[0].error == "client_cancelled" and ids
        release.set()
        got = await eventually_status(http, f"/v1/responses/{ids[0]}/input_items", 200)
        assert got.json()["data"]
        await sub.unsubscribe()


async def eventually_status(http: Any, path: str, status: int) -> Any:
    found: list[Any] = []

    async def check() -> bool:
        found[:] = [await http.get(path, headers=AUTH)]
        return bool(found[0].status_code == status)

    await eventually(check)
    return found[0]
