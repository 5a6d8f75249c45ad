"""The item index of stored responses (`i.<owner>.<item id>`): a client that resends its whole
history with every stored turn has each item written once, not once per turn, and an item the
store lost (a deletion took it) or that changed is written again. Two edges are two connections to
one real nats-server, each with its own store and cache."""

from __future__ import annotations

from typing import Any

import pytest
from nats.aio.client import Client as NATS
from nats.js.errors import KeyNotFoundError

from iop.responses import cache
from iop.responses.expand import Responses
from tests.test_responses_cache import edge
from tests.test_responses_cache import ncs as ncs  # the fixture: two edges' connections
from tests.test_responses_chain_reads import OWNER


def call(n: int, arguments: str = "{}") -> dict[str, Any]:
    return {"type": "function_call", "id": f"fc_{n}", "call_id": f"call_{n}", "name": "read", "arguments": arguments}


def result(n: int) -> dict[str, Any]:
    return {"type": "function_call_output", "call_id": f"call_{n}", "output": f"file {n}"}


async def turn(responses: Responses, n: int, history: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Turn `n` of a session that resends its history (store unset: kept); the history after it."""
    sent = [*history, {"type": "message", "role": "user", "content": f"u{n}"}]
    t = await responses.expand({"model": "m", "input": sent}, OWNER)
    await responses.keep(OWNER, t, {"id": f"resp_{n}", "output": [call(n)]})
    return [*sent, call(n), result(n)]


class Writes:
    """Which item keys were written since the last look: those whose revision (the stream
    sequence of the key's last write, acked before `keep` returned) moved."""

    def __init__(self, responses: Responses, ids: list[str]) -> None:
        assert responses.store is not None
        self.kv = responses.store.kv
        self.ids = ids
        self.seen: dict[str, int] = {}

    async def since(self) -> list[str]:
        moved = []
        for i in self.ids:
            try:
                revision = int((await self.kv.get(f"i.{OWNER}.{i}")).revision)
            except KeyNotFoundError:
                continue
            if self.seen.get(i) != revision:
                moved.append(i)
                self.seen[i] = revision
        return moved


async def test_a_history_sent_again_has_only_its_new_items_written(ncs: tuple[NATS, NATS]) -> None:
    a, b = ncs
    on_a = await edge(a)
    assert on_a.store is not None
    writes = Writes(on_a, [f"fc_{n}" for n in range(10)])
    history: list[dict[str, Any]] = []
    history = await turn(on_a, 0, history)
    assert await writes.since() == ["fc_0"]
    for n in range(1, 6):
        history = await turn(on_a, n, history)
        # fc_0..fc_{n-1} come back in the input, as they were written: only the answer's is new.
        assert await writes.since() == [f"fc_{n}"]
    for n in range(6):
        assert await on_a.store.item(OWNER, f"fc_{n}") == call(n)
    # An item sent again changed is written again, and reads as sent.
    changed = [call(2, '{"path":"b"}') if i.get("id") == "fc_2" else i for i in history]
    history = await turn(on_a, 6, changed)
    assert await writes.since() == ["fc_2", "fc_6"]
    assert await on_a.store.item(OWNER, "fc_2") == call(2, '{"path":"b"}')
    # Another edge has written none of them: it writes them all once, then no more.
    on_b = await edge(b)
    history = await turn(on_b, 7, history)
    assert await writes.since() == [f"fc_{n}" for n in range(8)]
    await turn(on_b, 8, history)
    assert await writes.since() == ["fc_8"]


async def test_an_item_a_deletion_took_is_written_again_when_it_is_sent_again(ncs: tuple[NATS, NATS]) -> None:
    a, b = ncs
    on_a, on_b = await edge(a), await edge(b)
    assert on_a.store is not None and on_b.store is not None
    history = await turn(on_a, 0, [])
    history = await turn(on_a, 1, history)
    # Deleting turn 0 on another edge deletes its items (fc_0 among them), and says so to A.
    assert await on_b.store.delete(OWNER, "resp_0")
    assert await on_a.store.item(OWNER, "fc_0") is None
    await turn(on_a, 2, history)
    assert await on_a.store.item(OWNER, "fc_0") == call(0)
    assert await on_a.store.item(OWNER, "fc_1") == call(1)


async def test_a_turn_that_resends_its_history_needs_no_round_trip_of_its_own(
    ncs: tuple[NATS, NATS], monkeypatch: pytest.MonkeyPatch
) -> None:
    # Whether the items it skips are still stored is known once every deletion announced before
    # the turn was heard: the record's own ack says so (`Freshness.passed`), no PING of its own.
    monkeypatch.setattr(cache, "_INFO_EVERY_S", 600.0)  # the bucket's first sequence, read once
    a, b = ncs
    on_a, on_b = await edge(a), await edge(b)
    assert on_a.store is not None and on_a.store.fresh is not None and on_b.store is not None
    trips = 0
    round_trip = on_a.store.fresh._round_trip

    async def counted(began: float) -> bool:
        nonlocal trips
        trips += 1
        return await round_trip(began)

    monkeypatch.setattr(on_a.store.fresh, "_round_trip", counted)
    history = await turn(on_a, 0, [])
    for n in range(1, 5):
        history = await turn(on_a, n, history)
    assert trips == 1  # the first turn with items to skip read the bucket's first sequence
    # A deletion announced by another edge after the turn chose what to skip, before its writes,
    # is heard before their ack: the owner's remembered items go with it and are written again,
    # still without a round trip of their own.
    writes = Writes(on_a, ["fc_0", "fc_1"])
    await writes.since()
    put_all = on_a.store._put_all

    async def deleted_meanwhile(*args: Any, **kwargs: Any) -> list[int]:
        monkeypatch.setattr(on_a.store, "_put_all", put_all)
        assert on_b.store is not None and await on_b.store.delete(OWNER, "resp_0")
        return await put_all(*args, **kwargs)

    monkeypatch.setattr(on_a.store, "_put_all", deleted_meanwhile)
    await turn(on_a, 5, history)
    assert await writes.since() == ["fc_0", "fc_1"]
    assert await on_a.store.item(OWNER, "fc_0") == call(0)
    assert trips == 1
