"""The edge's cache of stored turns (iop/responses/cache.py): a chain this edge wrote or read expands
without reading the store, and the cache never serves what the store no longer holds, nor another
owner's. Two edges are two connections to one real nats-server, each with its own store and cache."""

from __future__ import annotations

import gc
import json
import time
from collections.abc import AsyncIterator
from typing import Any

import pytest
from nats.aio.client import Client as NATS

from iop import edgeconf
from iop.nats import connection
from iop.nats.server import EmbeddedNats
from iop.responses.cache import Entry, TurnCache, key
from iop.responses.expand import PreviousResponseNotFound, Responses
from iop.responses.records import Stored
from iop.responses.store import ResponseStore, owner_of
from tests.fakes import fake_upstream
from tests.harness import deployment, eventually, running_edge, running_node
from tests.test_lru import LAZY_DICTS
from tests.test_responses_chain_reads import OTHER, OWNER, chain_of, direct_gets
from tests.test_responses_ownership import YAML as OWNED_DEPLOYMENT


@pytest.fixture
async def ncs(nats_server: EmbeddedNats) -> AsyncIterator[tuple[NATS, NATS]]:
    a = await connection.connect(nats_server.url, "edge-a")
    b = await connection.connect(nats_server.url, "edge-b")
    try:
        yield a, b
    finally:
        await a.close()
        await b.close()


async def edge(nc: NATS, **settings: Any) -> Responses:
    return Responses(await ResponseStore.open(nc, edgeconf.ResponsesSettings(**settings)))


def body(previous: str) -> dict[str, Any]:
    return {"model": "m", "previous_response_id": previous, "input": "go"}


def contents(outcome: Any) -> list[Any]:
    return [i["content"] for i in json.loads(outcome.encoded())["input"]]


async def test_a_chain_this_edge_wrote_expands_without_a_store_read_and_only_for_its_owner(
    ncs: tuple[NATS, NATS],
) -> None:
    a, b = ncs
    on_a, on_b = await edge(a), await edge(b)
    ids = await chain_of(on_a, 30)
    whole = [c for t in range(30) for c in (f"u{t}", f"a{t}")] + ["go"]
    gets, turn = await direct_gets(a, on_a, body(ids[-1]), OWNER)
    assert gets == 0 and contents(turn) == whole and turn.chain == ids
    # Another owner on the same edge hits nothing: a miss, read from the store, is not found.
    gets, other = await direct_gets(a, on_a, body(ids[-1]), OTHER)
    assert isinstance(other, PreviousResponseNotFound) and gets == 1
    assert on_a.store is not None and await on_a.store.response(OTHER, ids[3]) is None
    # Another edge reads the chain once (two direct gets), then has it too.
    gets, turn = await direct_gets(b, on_b, body(ids[-1]), OWNER)
    assert gets == 2 and contents(turn) == whole
    gets, turn = await direct_gets(b, on_b, body(ids[-1]), OWNER)
    assert gets == 0 and contents(turn) == whole


async def test_a_turn_deleted_on_one_edge_is_refused_at_once_on_another_that_had_it(ncs: tuple[NATS, NATS]) -> None:
    a, b = ncs
    on_a, on_b = await edge(a), await edge(b)
    assert on_a.store is not None and on_b.store is not None
    ids = await chain_of(on_a, 8)
    await on_b.expand(body(ids[-1]), OWNER)  # B has read the chain: it is in B's cache
    assert (await direct_gets(b, on_b, body(ids[-1]), OWNER))[0] == 0
    assert await on_a.store.delete(OWNER, ids[3])
    # No wait: the deletion was announced before A answered, and B's hit waits for what is announced.
    _, refused = await direct_gets(b, on_b, body(ids[-1]), OWNER)
    assert isinstance(refused, PreviousResponseNotFound) and ids[3] in str(refused)
    assert await on_b.store.response(OWNER, ids[3]) is None
    # And the other way round; the deleting edge itself forgets before it answers.
    assert on_a.store.fresh is not None and key(OWNER, ids[6]) in on_a.store.fresh.cache.entries  # A wrote it
    assert await on_b.store.delete(OWNER, ids[6])
    for responses in (on_a, on_b):
        with pytest.raises(PreviousResponseNotFound, match=ids[6]):
            await responses.expand(body(ids[6]), OWNER)
    assert await on_a.store.response(OWNER, ids[6]) is None


async def test_an_edge_that_reconnects_serves_nothing_it_held(nats_server: EmbeddedNats) -> None:
    a = await connection.connect(nats_server.url, "edge-a")
    try:
        on_a = await edge(a)
        assert on_a.store is not None
        ids = await chain_of(on_a, 6)
        # A deletion this edge does not hear of (as one announced while its connection was down):
        # the cache still has the turn...
        await on_a.store.kv.purge(f"r.{OWNER}.{ids[2]}")
        assert (await direct_gets(a, on_a, body(ids[-1]), OWNER))[0] == 0
        await nats_server.stop()
        await nats_server.start()

        async def back() -> bool:
            return a.is_connected and a.stats["reconnects"] == 1

        await eventually(back, timeout_s=20)
        # ...until the connection is back: then it has nothing, and reads the store.
        gets, refused = await direct_gets(a, on_a, body(ids[-1]), OWNER)
        assert isinstance(refused, PreviousResponseNotFound) and ids[2] in str(refused) and gets > 0
        assert on_a.store.fresh is not None
        assert {k.split(".", 1)[1] for k in on_a.store.fresh.cache.entries} == {*ids} - {ids[2]}  # as read again
    finally:
        await a.close()


async def test_an_expired_turn_is_not_served_from_the_cache(ncs: tuple[NATS, NATS]) -> None:
    a, _ = ncs
    on_a = await edge(a, max_age=1.0)
    uncached = ResponseStore(
        (await ResponseStore.open(a, edgeconf.ResponsesSettings(max_age=1.0))).kv, a.max_payload, a
    )
    ids = await chain_of(on_a, 4)
    assert (await direct_gets(a, on_a, body(ids[-1]), OWNER))[0] == 0

    async def aged_out() -> bool:
        return await uncached.response(OWNER, ids[0]) is None

    await eventually(aged_out, timeout_s=20)
    with pytest.raises(PreviousResponseNotFound):
        await on_a.expand(body(ids[-1]), OWNER)


async def test_the_cache_stays_within_its_bound_and_the_chain_whole(ncs: tuple[NATS, NATS]) -> None:
    a, _ = ncs
    on_a = await edge(a, cache_mb=1)
    assert on_a.store is not None and on_a.store.fresh is not None
    cache = on_a.store.fresh.cache
    ids = await chain_of(on_a, 12)
    for n in range(12, 40):  # 28 more turns of ~60 KB each: 1.7 MB of JSON
        turn = await on_a.expand({"model": "m", "previous_response_id": ids[-1], "input": f"u{n}"}, OWNER)
        answer = {"id": f"resp_{n}", "output": [{"type": "message", "id": f"msg_{n}", "content": "y" * 60_000}]}
        await on_a.keep(OWNER, turn, answer)
        ids.append(f"resp_{n}")
        assert cache.bytes <= 1 << 20
    assert cache.bytes == sum(e.size for e in cache.entries.values()) > (1 << 20) - 70_000
    assert key(OWNER, ids[-1]) in cache.entries and len(cache.entries) < 40  # the least recently used went
    gets, turn = await direct_gets(a, on_a, body(ids[-1]), OWNER)
    assert gets == 1 and len(json.loads(turn.encoded())["input"]) == 2 * 40 + 1  # the evicted turns read in one batch
    assert cache.bytes <= 1 << 20


async def test_background_and_unfinished_records_are_never_cached(ncs: tuple[NATS, NATS]) -> None:
    a, _ = ncs
    on_a = await edge(a)
    store = on_a.store
    assert store is not None and store.fresh is not None
    await store.keep(OWNER, Stored({"id": "resp_bg", "background": True, "status": "completed"}, []), [])
    await store.keep(OWNER, Stored({"id": "resp_q", "status": "queued"}, []), [])
    await store.keep(OWNER, Stored({"id": "resp_done", "status": "completed"}, []), [])
    assert set(store.fresh.cache.entries) == {key(OWNER, "resp_done")}
    assert [s.response["id"] if s else None for s in await store.responses(OWNER, ["resp_bg", "resp_q"])] == [
        "resp_bg",
        "resp_q",
    ]
    assert set(store.fresh.cache.entries) == {key(OWNER, "resp_done")}


def test_a_read_that_raced_a_deletion_or_a_reconnect_keeps_nothing() -> None:
    cache = TurnCache(1 << 20, 60.0)
    owner = owner_of(b"sk-a")
    entry = Entry(Stored({"id": "resp_1"}, []), 10, 1e18, 1)
    before = cache.ticket(0)
    cache.forget(owner, "resp_1")  # announced while the read was on its way
    cache.put(owner, "resp_1", entry, before, 0)
    assert not cache.entries
    cache.put(owner, "resp_2", entry, before, 1)  # the connection came back meanwhile
    assert not cache.entries
    cache.put(owner, "resp_2", entry, cache.ticket(1), 1)
    assert cache.get(owner, "resp_2") is entry.stored and cache.get(OTHER, "resp_2") is None
    cache.first_seq = 2  # NATS dropped the oldest messages (the bucket's bytes)
    assert cache.get(owner, "resp_2") is None and cache.bytes == 0
    old = Entry(entry.stored, 10, time.time() - 61.0, 5)  # written 61 s ago, kept 60
    cache.put(owner, "resp_3", old, cache.ticket(1), 1)
    assert key(owner, "resp_3") in cache.entries and cache.get(owner, "resp_3") is None and cache.bytes == 0


async def test_the_turns_an_edge_keeps_add_nothing_to_a_full_collection(ncs: tuple[NATS, NATS]) -> None:
    # A cache of many small turns is tens of thousands of entries: were they tracked, every full
    # collection of the edge would walk them while its requests wait.
    responses = await edge(ncs[0])
    assert responses.store is not None and responses.store.fresh is not None
    for n in range(50):
        t = await responses.expand({"model": "m", "input": f"turn {n}"}, OWNER)
        item = {"type": "message", "id": f"msg_gc{n}", "role": "assistant", "content": []}
        await responses.keep(OWNER, t, {"id": f"resp_gc{n}", "output": [item]})
    cache = responses.store.fresh.cache
    entries, indexed = cache.entries.values(), cache.indexed.values()
    assert len(entries) == 50 and len(indexed) == 50
    gc.collect()  # a tuple of strings (the maps' order) is left untracked by the collection that sees it
    assert not any(gc.is_tracked(e) for e in [*entries, *indexed])
    if LAZY_DICTS:  # nor, where CPython leaves such dicts untracked, the maps that hold them (iop/lru.py)
        held = [v for lru in (cache.entries, cache.indexed) for v in vars(lru).values() if isinstance(v, dict | tuple)]
        assert len(held) == 6 and not any(gc.is_tracked(v) for v in held)


def test_a_hit_keeps_a_turn_and_an_item_longest() -> None:
    """A turn read and an item found indexed become the most recently used: the bound takes others first."""
    cache = TurnCache(4096, 60.0)  # 2 item index entries: 4096 * INDEXED_PER_MIB >> 20
    ticket = cache.ticket(0)
    turns = [Entry(Stored({"id": f"resp_{n}"}, []), 1500, 1e18, 1) for n in range(3)]
    cache.put(OWNER, "resp_0", turns[0], ticket, 0)
    cache.put(OWNER, "resp_1", turns[1], ticket, 0)
    assert cache.get(OWNER, "resp_0") is turns[0].stored  # read: resp_1 is now the least recently used
    cache.put(OWNER, "resp_2", turns[2], ticket, 0)  # 4,500 bytes: one has to go
    assert [cache.get(OWNER, f"resp_{n}") is not None for n in range(3)] == [True, False, True]
    cache.note_indexed(OWNER, "msg_a", 1, 5, 1e18, ticket, 0)
    cache.note_indexed(OWNER, "msg_b", 2, 6, 1e18, ticket, 0)
    assert cache.indexed_still(OWNER, "msg_a", 1, 0.0)  # found: msg_b is now the least recently used
    cache.note_indexed(OWNER, "msg_c", 3, 7, 1e18, ticket, 0)
    found = [cache.indexed_still(OWNER, i, d, 0.0) for i, d in (("msg_a", 1), ("msg_b", 2), ("msg_c", 3))]
    assert found == [True, False, True]
    assert not cache.indexed_still(OWNER, "msg_a", 9, 0.0)  # changed since: not skipped, and forgotten
    assert len(cache.indexed) == 1 and not cache.indexed_still(OWNER, "msg_a", 1, 0.0)


async def test_over_http_a_delete_on_one_edge_breaks_the_chain_on_another_at_once(
    nats_server: EmbeddedNats, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("IOP_TEST_KEYS", "a:sk-cache-a-0123456789, b:sk-cache-b-0123456789")
    a_key = {"authorization": "Bearer sk-cache-a-0123456789"}
    b_key = {"authorization": "Bearer sk-cache-b-0123456789"}
    async with fake_upstream() as up:
        dep = deployment(OWNED_DEPLOYMENT.format(url=up.url))
        async with (
            running_node(dep, "n", nats_server.url),
            running_edge(dep, nats_server.url) as one,
            running_edge(dep, nats_server.url) as other,
            one.http() as on_one,
            other.http() as on_other,
        ):
            ids: list[str] = []
            for text in ("first", "second", "third"):
                ask: dict[str, Any] = {"model": "m", "input": text}
                if ids:
                    ask["previous_response_id"] = ids[-1]
                r = await on_one.post("/v1/responses", json=ask, headers=a_key)
                assert r.status_code == 200, r.text
                ids.append(r.json()["id"])
            then = {"model": "m", "input": "fourth", "previous_response_id": ids[-1]}
            assert (await on_other.post("/v1/responses", json=then, headers=a_key)).status_code == 200  # read there
            r = await on_one.post("/v1/responses", json=then, headers=b_key)  # another key, on the edge that wrote it
            assert r.status_code == 400 and r.json()["error"]["code"] == "previous_response_not_found"
            # The middle turn: its messages are not the bucket's first, so only the announcement tells.
            assert (await on_one.delete(f"/v1/responses/{ids[1]}", headers=a_key)).status_code == 200
            r = await on_other.post("/v1/responses", json=then, headers=a_key)
            assert r.status_code == 400 and r.json()["error"]["code"] == "previous_response_not_found", r.text
            assert ids[1] in r.json()["error"]["message"]
            assert (await on_other.get(f"/v1/responses/{ids[1]}", headers=a_key)).status_code == 404
            assert (await on_other.get(f"/v1/responses/{ids[0]}", headers=a_key)).status_code == 200


def test_a_read_that_raced_a_deletion_no_longer_remembered_keeps_nothing() -> None:
    """Past the deletions the cache remembers, a read older than the oldest remembered keeps
    nothing, however many owners deleted (each owner's latest deletion is remembered too)."""
    cache = TurnCache(1 << 20, 60.0)
    entry = Entry(Stored({"id": "resp_k"}, []), 10, 1e18, 1)
    cache.forget("o-first", "resp_0")  # one owner's deletion, long ago
    before = cache.ticket(0)  # a read begins
    cache.forget("o-k", "resp_k")  # and its turn is deleted while it is on its way
    for n in range(4094):  # then thousands of deletions by other owners, two each
        cache.forget(f"o-{n}", "resp_a")
        cache.forget(f"o-{n}", "resp_b")
    cache.forget("o-last", "resp_c")  # one owner too many: the first owner's is no longer remembered
    cache.put("o-k", "resp_k", entry, before, 0)
    assert cache.get("o-k", "resp_k") is None
