"""A `previous_response_id` chain is read in one direct get, whatever its length, and stays as strict
as one read a turn: another owner's id, a deleted or a missing earlier turn break it."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from typing import Any

import pytest
from nats.aio.client import Client as NATS

from iop import edgeconf
from iop.nats import connection
from iop.nats.server import EmbeddedNats
from iop.responses.expand import PreviousResponseNotFound, Responses
from iop.responses.records import Stored
from iop.responses.store import ResponseStore, owner_of

OWNER, OTHER = owner_of(b"sk-a"), owner_of(b"sk-b")


@pytest.fixture
async def nc(nats_server: EmbeddedNats) -> AsyncIterator[NATS]:
    conn = await connection.connect(nats_server.url, "test-chain")
    try:
        yield conn
    finally:
        await conn.close()


async def chain_of(responses: Responses, turns: int, big: int = 0) -> list[str]:
    """Ids of `turns` kept responses, each the next's previous; turn 3 holds `big` bytes of output."""
    ids: list[str] = []
    for t in range(turns):
        body: dict[str, Any] = {"model": "m", "input": [{"type": "message", "role": "user", "content": f"u{t}"}]}
        if ids:
            body["previous_response_id"] = ids[-1]
        turn = await responses.expand(body, OWNER)
        text = "x" * big if t == 3 and big else f"a{t}"
        answer = {
            "id": f"resp_{t}",
            "output": [{"type": "message", "id": f"msg_{t}", "role": "assistant", "content": text}],
        }
        await responses.keep(OWNER, turn, answer)
        ids.append(f"resp_{t}")
    return ids


async def direct_gets(nc: NATS, responses: Responses, body: dict[str, Any], owner: str) -> tuple[int, Any]:
    """How many direct gets the expansion of `body` asks the server for, and its outcome."""
    seen: list[str] = []

    async def note(msg: Any) -> None:
        seen.append(msg.subject)

    sub = await nc.subscribe("$JS.API.DIRECT.GET.>", cb=note)
    await nc.flush()
    try:
        outcome: Any = await responses.expand(body, owner)
    except PreviousResponseNotFound as exc:
        outcome = exc
    await nc.flush()
    await sub.unsubscribe()
    return len(seen), outcome


async def test_a_thirty_turn_chain_is_read_in_two_direct_gets(nc: NATS) -> None:
    # An edge without the cache of stored turns (tests/test_responses_cache.py reads with it).
    responses = Responses(await ResponseStore.open(nc, edgeconf.ResponsesSettings(cache_mb=0)))
    ids = await chain_of(responses, 30)
    gets, turn = await direct_gets(nc, responses, {"model": "m", "previous_response_id": ids[-1], "input": "go"}, OWNER)
    assert gets == 2  # the previous response, then every earlier one at once (one a turn: 30)
    contents = [i["content"] for i in json.loads(turn.encoded())["input"]]
    assert contents == [c for t in range(30) for c in (f"u{t}", f"a{t}")] + ["go"]
    assert turn.chain == ids


async def test_a_turn_kept_in_parts_is_whole_in_the_chain(nc: NATS) -> None:
    opened = await ResponseStore.open(nc, edgeconf.ResponsesSettings())
    responses = Responses(ResponseStore(opened.kv, 8192, nc))
    ids = await chain_of(responses, 6, big=20_000)
    turn = await responses.expand({"model": "m", "previous_response_id": ids[-1], "input": "go"}, OWNER)
    assert [i["content"] for i in json.loads(turn.encoded())["input"]][7] == "x" * 20_000
    await opened.kv.purge(f"r.{OWNER}.resp_3.2")  # a part aged out: that turn is gone, the chain broken
    with pytest.raises(PreviousResponseNotFound, match="resp_3"):
        await responses.expand({"model": "m", "previous_response_id": ids[-1], "input": "go"}, OWNER)


async def test_a_deleted_missing_or_anothers_earlier_turn_breaks_the_chain(nc: NATS) -> None:
    store = await ResponseStore.open(nc, edgeconf.ResponsesSettings())
    responses = Responses(store)
    ids = await chain_of(responses, 8)
    body = {"model": "m", "previous_response_id": ids[-1], "input": "go"}
    _, other = await direct_gets(nc, responses, body, OTHER)
    assert isinstance(other, PreviousResponseNotFound)  # another owner sees none of it
    assert await store.delete(OWNER, ids[2])
    _, deleted = await direct_gets(nc, responses, body, OWNER)
    assert isinstance(deleted, PreviousResponseNotFound) and ids[2] in str(deleted)
    await store.kv.delete(f"r.{OWNER}.{ids[5]}")  # a delete marker rather than a purge: gone too
    last = await store.response(OWNER, ids[-1])
    assert last is not None
    # A record naming an earlier turn never kept (or aged out) and one of another owner only.
    await store.keep(OTHER, Stored({"id": "resp_theirs"}, []), [])
    forged = Stored({"id": "resp_forged", "output": []}, [], ids[1], [ids[0], "resp_theirs", "resp_never"])
    await store.keep(OWNER, forged, [])
    for gone in ("resp_theirs", "resp_never"):
        with pytest.raises(PreviousResponseNotFound, match=gone):
            await responses.expand({"model": "m", "previous_response_id": "resp_forged", "input": "go"}, OWNER)
        forged.chain.remove(gone)
        await store.keep(OWNER, forged, [])
    turn = await responses.expand({"model": "m", "previous_response_id": "resp_forged", "input": "go"}, OWNER)
    assert [i["content"] for i in json.loads(turn.encoded())["input"]] == ["u0", "a0", "go"]


async def test_a_store_without_its_connection_reads_a_chain_one_turn_at_a_time(nc: NATS) -> None:
    opened = await ResponseStore.open(nc, edgeconf.ResponsesSettings())
    responses = Responses(ResponseStore(opened.kv, nc.max_payload))
    ids = await chain_of(responses, 5)
    gets, turn = await direct_gets(nc, responses, {"model": "m", "previous_response_id": ids[-1], "input": "go"}, OWNER)
    assert gets == 5 and len(json.loads(turn.encoded())["input"]) == 11
    assert await asyncio.wait_for(opened.responses(OWNER, [*ids, "no.such"]), 5) == [
        *(await asyncio.gather(*(opened.response(OWNER, i) for i in ids))),
        None,
    ]
