"""Replies lost on the way between node and edge (a NATS connection cut) come again; nothing runs twice."""

from __future__ import annotations

import asyncio

import httpx

from iop import wire
from iop.edge.reorder import Reorder
from iop.nats import connection
from iop.nats.server import EmbeddedNats
from iop.node import replay
from iop.node.replay import ReplayStore
from iop.node.runtime import NodeRuntime
from tests.fakes import FakeUpstream, fake_upstream
from tests.harness import (
    EdgeHandle,
    NatsCut,
    deployment,
    eventually,
    one_provider_yaml,
    running_edge,
    running_node,
    sse_events,
    until,
)


async def answer_lost_while_the_edge_is_cut_off(
    h: EdgeHandle, node: NodeRuntime, up: FakeUpstream, cut: NatsCut, gate: asyncio.Event, http: httpx.AsyncClient
) -> httpx.Response:
    """Start a streamed request, cut the edge off NATS, let the node answer into the void, reconnect.

    The node's Started reaches the edge; every chunk and the Done are published (and flushed to
    the server) while nobody subscribes for them, so NATS drops them all.
    """
    body = {"model": "m", "stream": True, "messages": [{"role": "user", "content": "once"}]}
    sent = asyncio.create_task(http.post("/v1/chat/completions", json=body))
    await up.wait_for(lambda u: u.in_flight == 1)
    relay = h.edge.relay

    async def started() -> bool:
        return any(ch.started for ch in relay.channels.values())

    async def cut_off() -> bool:
        return not h.edge.nc.is_connected

    await eventually(started)
    cut.cut()
    await eventually(cut_off)
    gate.set()
    await until(lambda: not node.requests(), node.changed)
    assert node.nc is not None
    await connection.flush(node.nc, 5)  # the server has processed (and dropped) every reply
    cut.heal()
    return await asyncio.wait_for(sent, 30)


async def test_replies_lost_while_the_edge_reconnects_are_sent_again_and_the_request_runs_once(
    nats_server: EmbeddedNats,
) -> None:
    gate = asyncio.Event()
    async with fake_upstream(gate=gate, tokens=20) as up, NatsCut(nats_server) as cut:
        dep = deployment(one_provider_yaml(up.url))
        await nats_server.authorize(dep.nodes)
        async with (
            running_edge(dep, cut.url) as h,
            # With its own NATS user: least privilege lets it hear a Resend and answer it.
            running_node(dep, "n", nats_server.address, nats_server.node_access("n")) as node,
            h.http() as http,
        ):
            # The node's probes of a request it runs must not find the edge gone meanwhile.
            node.probe_interval_s = 60
            await h.edge.registry.wait_connected(["n"], timeout_s=10)
            r = await answer_lost_while_the_edge_is_cut_off(h, node, up, cut, gate, http)
            relay = h.edge.relay
            assert r.status_code == 200, r.text
            text = "".join(
                e["choices"][0]["delta"].get("content") or "" for e in sse_events(r.text) if e.get("choices")
            )
            assert text == up.text()
            assert up.total == 1
            assert relay.recovery.resends >= 1 and relay.recovery.resends_unknown == 0
            # Sent again: the chunks (one at least) and the Done; not the Started, which had arrived.
            assert node._running is not None and node._running.replay.resent >= 2
            assert h.edge.nc.stats["reconnects"] == 1


async def test_a_stream_cut_off_half_way_reaches_its_client_whole_and_in_order(nats_server: EmbeddedNats) -> None:
    # 40 tokens 50 ms apart: the edge is cut off after the first bytes, while the rest streams.
    async with fake_upstream(tokens=40, token_interval_s=0.05) as up, NatsCut(nats_server) as cut:
        dep = deployment(one_provider_yaml(up.url))
        async with running_edge(dep, cut.url) as h, running_node(dep, "n", nats_server.url) as node, h.http() as http:
            node.probe_interval_s = 60
            await h.edge.registry.wait_connected(["n"], timeout_s=10)
            body = {"model": "m", "stream": True, "messages": [{"role": "user", "content": "once"}]}
            sent = asyncio.create_task(http.post("/v1/chat/completions", json=body))
            relay = h.edge.relay

            async def first_bytes_in() -> bool:
                return any(ch.order.next_seq > 0 for ch in relay.channels.values())

            async def cut_off() -> bool:
                return not h.edge.nc.is_connected

            await eventually(first_bytes_in)
            cut.cut()
            await eventually(cut_off)
            cut.heal()
            r = await asyncio.wait_for(sent, 30)
            reconnected = h.edge.nc.stats["reconnects"]
            assert node._running is not None
            resent = node._running.replay.resent
    assert r.status_code == 200, r.text
    text = "".join(e["choices"][0]["delta"].get("content") or "" for e in sse_events(r.text) if e.get("choices"))
    assert text == up.text()
    assert up.total == 1 and reconnected == 1
    # What streamed while the edge was away was lost, and sent again.
    assert relay.recovery.resends >= 1 and relay.recovery.resends_unknown == 0 and resent >= 1
    print(
        f"\nedge cut off mid-stream: {relay.recovery.resends} resends, {resent} replies sent again, "
        f"{relay.duplicates} copies dropped"
    )


async def test_a_node_that_no_longer_has_the_lost_answer_fails_it_with_relay_gap_at_once(
    nats_server: EmbeddedNats,
) -> None:
    gate = asyncio.Event()
    async with fake_upstream(gate=gate, tokens=3) as up, NatsCut(nats_server) as cut:
        dep = deployment(one_provider_yaml(up.url))
        async with (
            running_edge(dep, cut.url) as h,
            running_node(dep, "n", nats_server.url) as node,
            h.http() as http,
        ):
            node.probe_interval_s = 60
            assert node._running is not None
            node._running.replay.grace_s = 0  # forgets an answer as soon as it ended
            await h.edge.registry.wait_connected(["n"], timeout_s=10)
            r = await answer_lost_while_the_edge_is_cut_off(h, node, up, cut, gate, http)
            # A stream already begun (headers sent) ends with an error event; the code says why.
            assert "relay_gap" in r.text, r.text
            assert h.edge.relay.recovery.resends_unknown == 1
            assert up.total == 1


# --- the pieces, without NATS ---------------------------------------------------------------------


def chunk(seq: int) -> wire.Chunk:
    return wire.Chunk("r", seq, f"<{seq}>".encode())


def test_reorder_drops_copies_holds_what_came_past_a_gap_and_ends_after_the_last_chunk() -> None:
    o = Reorder()
    started = wire.Started("r", "n", "i")
    assert o.take(started) == [started]
    assert o.take(started) == []
    assert o.take(chunk(0)) == [chunk(0)]
    assert o.take(chunk(2)) == [] and o.missing
    done = wire.Done("r", 4)
    assert o.take(done) == []
    assert o.take(chunk(0)) == []
    assert o.take(chunk(1)) == [chunk(1), chunk(2)]
    assert o.missing and o.next_seq == 3
    assert o.take(chunk(3)) == [chunk(3), done]
    assert not o.missing
    assert o.take(done) == [] and o.take(chunk(3)) == []
    assert o.duplicates == 4


def test_reorder_passes_an_end_that_counts_fewer_chunks_so_the_reader_reports_it() -> None:
    o = Reorder()
    o.take(chunk(0))
    o.take(chunk(1))
    failure = wire.Failure("r", 1, 502, "x", "y")
    assert o.take(failure) == [failure] and not o.missing


def test_replay_store_keeps_what_the_edge_has_not_confirmed_and_forgets_after_grace() -> None:
    store = ReplayStore(max_bytes=10_000, grace_s=60)
    started = wire.Started("r", "n", "i")
    store.keep("reply.r", started)
    for i in range(4):
        store.keep("reply.r", chunk(i))
    store.confirm("r", 2)  # the edge's client took chunks 0 and 1
    found = store.replies(wire.Resend("r", 2, started=True))
    assert found == ("reply.r", [started, chunk(2), chunk(3)])
    assert store.replies(wire.Resend("r", 1)) is None  # confirmed: not kept any more
    done = wire.Done("r", 4)
    store.keep("reply.r", done)
    assert store.replies(wire.Resend("r", 4)) == ("reply.r", [done])
    assert store.replies(wire.Resend("other", 0)) is None
    store.grace_s = 0
    store.expire()
    assert store.replies(wire.Resend("r", 4)) is None and store.nbytes == 0


def test_replay_store_over_its_bound_forgets_ended_answers_first_then_running_ones() -> None:
    big = b"x" * 3000
    one = replay.ENTRY_BYTES + replay.CHUNK_BYTES + len(big)  # a request with one kept chunk
    store = ReplayStore(max_bytes=3 * one - 1, grace_s=60)
    store.keep("reply.a", wire.Chunk("a", 0, big))
    store.keep("reply.a", wire.Done("a", 1))
    store.keep("reply.b", wire.Chunk("b", 0, big))
    store.keep("reply.c", wire.Chunk("c", 0, big))
    assert store.evicted == 1 and store.replies(wire.Resend("a", 0)) is None
    assert store.replies(wire.Resend("b", 0)) is not None
    store.keep("reply.d", wire.Chunk("d", 0, big))
    # b still runs: it is marked, so a resend says it cannot help rather than send a hole.
    assert store.evicted == 2 and store.replies(wire.Resend("b", 0)) is None
    assert store.replies(wire.Resend("c", 0)) is not None
    assert store.nbytes <= store.max_bytes


def test_replay_store_never_sends_an_answer_with_a_hole() -> None:
    store = ReplayStore()
    store.keep("reply.r", chunk(0))
    store.keep("reply.r", chunk(1))
    store.confirm("r", 1)
    assert store.replies(wire.Resend("r", 0)) is None


async def test_answers_the_edge_received_whole_are_forgotten_by_the_node_at_once(nats_server: EmbeddedNats) -> None:
    # Without the edge saying so, a node kept every ended answer REPLAY_GRACE_S (30 s): at 2,000
    # requests a second that was 60,000 answers held, and the node's memory and throughput paid.
    async with fake_upstream(tokens=5) as up:
        dep = deployment(one_provider_yaml(up.url))
        await nats_server.authorize(dep.nodes)
        async with (
            running_edge(dep, nats_server.url) as h,
            running_node(dep, "n", nats_server.address, nats_server.node_access("n")) as node,
            h.http() as http,
        ):
            await h.edge.registry.wait_connected(["n"], timeout_s=10)
            for stream in (False, True, False):
                body = {"model": "m", "stream": stream, "messages": [{"role": "user", "content": "hi"}]}
                assert (await http.post("/v1/chat/completions", json=body)).status_code == 200
            assert node._running is not None
            store = node._running.replay

            async def forgotten() -> bool:
                return not store.by_id

            waited_s = await eventually(forgotten, timeout_s=10)
            assert store.received_count == 3 and store.nbytes == 0
            assert waited_s < wire.REPLAY_GRACE_S / 3  # told, not expired
